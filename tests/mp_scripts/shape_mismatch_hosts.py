"""Ranks on different simulated hosts that disagree on a call's shape.

Run as ``python -m strata_jax.launch -n 4 --hosts 2 shape_mismatch_hosts.py``: one flat axis
over the 4 devices (2 fabrics of 2). For psum, all_gather, all_to_all, psum_scatter and MoE
dispatch and combine, the processes of fabric 1 call with another shape than those of fabric 0
(psum and all_to_all: other byte counts; all_gather: the same bytes in another shape, which
XLA's collective would exchange as if nothing were wrong). Every process must get an error
naming the user's call (``strata_jax.moe.dispatch``, not the all_gather of the expert ids inside
it), both shapes of its operands as passed and the devices/processes, well within strata's
timeout (STRATA_TIMEOUT_S, set to 20 s here); the same for two psums, a small and a large one,
called in the other order on fabric 1; then a psum with agreeing shapes is right on every
process (the job goes on). Prints ``MISMATCH <op> <seconds>`` per error and ``OK mismatch <n>``
at the end.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

TIMEOUT_S = 20.0
sj.set_timeout(TIMEOUT_S)
pid = jax.process_index()
fabric = sj.topology()["fabric"]
devs = sorted(jax.devices(), key=lambda d: d.id)
n = len(devs)
mesh = Mesh(np.array(devs), ("x",))
spec = P("x")
other = fabric == 1  # the processes of fabric 1 disagree


def put(a: np.ndarray):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def smap(body, out_spec=spec):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec))


def expect_error(op: str, fn, x, mine: str, theirs: str, *more: str) -> None:
    t = time.monotonic()
    try:
        out = fn(x)
        jax.block_until_ready(out)
    except sj.COLLECTIVE_ERRORS as e:
        dt = time.monotonic() - t
        msg = str(e)
        # The user's call by its public name (strata_jax.moe.dispatch, not the all_gather of
        # the expert ids inside it), its shapes as passed, and the devices/processes.
        want = [f"strata_jax.{op}: ", mine, theirs, *more, "device", "process", "fabric"]
        missing = [w for w in want if w not in msg]
        if missing or dt > TIMEOUT_S:
            print(f"FAIL {op}: missing {missing} after {dt:.1f} s in: {msg[:600]}", flush=True)
            sys.exit(1)
        print(f"MISMATCH {op} {dt:.2f} s: {msg[:300]}", flush=True)
        return
    vals = [np.asarray(s.data).ravel()[:4].tolist() for s in out.addressable_shards]
    print(f"FAIL {op}: no error; got {vals}", flush=True)
    sys.exit(1)


# psum: [4] per device on fabric 0, [8] on fabric 1 (different bytes).
k = 8 if other else 4
expect_error(
    "psum",
    smap(lambda v: sj.psum(v, "x")),
    put(np.ones((n * k,), np.float32)),
    "float32[4]",
    "float32[8]",
)
# all_gather: [2, 4] per device against [4, 2]: the same 32 bytes, another shape.
shape = (2, 4) if other else (4, 2)
expect_error(
    "all_gather",
    smap(lambda v: sj.all_gather(v, "x", tiled=True)),
    put(np.ones((n * shape[0], shape[1]), np.float32)),
    "float32[4,2]",
    "float32[2,4]",
)
# all_to_all: [8] per device against [16].
k = 16 if other else 8
expect_error(
    "all_to_all",
    smap(lambda v: sj.all_to_all(v, "x", 0, 0, tiled=True)),
    put(np.ones((n * k,), np.float32)),
    "float32[8]",
    "float32[16]",
)
# psum_scatter over dimension 1: [2, 8] per device against [2, 16] (hierarchical: the
# dimension moved to the front, reduce-scatter inside, then across). The error shows the
# shapes as passed, not the moved [8, 2].
k = 16 if other else 8
expect_error(
    "psum_scatter",
    smap(lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True)),
    put(np.ones((n * 2, k), np.float32)),
    "float32[2,8]",
    "float32[2,16]",
)
# MoE dispatch: T = 4 tokens per rank against 6 (E = 4, K = 2, H = 8). The first exchange
# across fabrics is the all_gather of the expert ids inside dispatch: the error names
# dispatch and both of its operands as the user passed them.
t = 6 if other else 4
rng = np.random.default_rng(0)
x = rng.standard_normal((n * t, 8)).astype(np.float32)
idx = rng.integers(0, 4, (n * t, 2)).astype(np.int32)
idx[:, 1] = (idx[:, 0] + 1) % 4


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
def dispatch(x, idx):
    recv, _ = sj.moe.dispatch(x, idx, num_experts=4, axis_name="x", capacity=None)
    return recv


expect_error(
    "moe.dispatch",
    lambda a: dispatch(*a),
    (put(x), put(idx)),
    "float32[4,8], int32[4,2]",
    "float32[6,8], int32[6,2]",
)

# MoE combine: agreeing dispatch, then expert outputs of H = 8 against 4.
t = 4
x, idx = x[: n * t], idx[: n * t]
w = rng.random((n * t, 2)).astype(np.float32)
h = 4 if other else 8


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
def roundtrip(x, idx, w):
    recv, layout = sj.moe.dispatch(x, idx, num_experts=4, axis_name="x")
    return sj.moe.combine(recv[..., :h], layout, w)


expect_error(
    "moe.combine",
    lambda a: roundtrip(*a),
    (put(x), put(idx), put(w)),
    f"float32[1,{n * t},8], float32[4,2]",
    f"float32[1,{n * t},4], float32[4,2]",
)

# Two psums in the other order on fabric 1: a small one (its data crosses inside the check's
# message, after its step inside the host) and a large one (its check goes at once, its data
# after it). Every call's exchanges between fabrics run after the previous call's, so the
# hosts' first messages are both checks, and disagree. Before that ordering the large call's
# checks met first and agreed, and the small call's message then met the large call's data:
# gloo's abort on one host and a wait on the other (a reviewer's case).
small = np.ones((n * 4, 256), np.float32)
big = np.ones((n * 4, 65536), np.float32)


def two_psums(small_first: bool):
    def body(a, b):
        if small_first:
            p = sj.psum(a, "x")
            return p, sj.psum(b, "x")
        q = sj.psum(b, "x")
        return sj.psum(a, "x"), q

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))


ordered = two_psums(not other)
expect_error(
    "psum",
    lambda a: ordered(*a),
    (put(small), put(big)),
    "float32[4,256]",
    "float32[4,65536]",
)

# The job goes on: a psum with agreeing shapes.
got = smap(lambda v: sj.psum(v, "x"), P())(put(np.arange(n * 3, dtype=np.float32)))
want = np.arange(n * 3, dtype=np.float32).reshape(n, 3).sum(0)
if not np.array_equal(np.asarray(got.addressable_data(0)), want):
    print(f"FAIL psum after the errors: {np.asarray(got.addressable_data(0))}", flush=True)
    sys.exit(1)
print(f"OK mismatch 7 (process {pid}, fabric {fabric})", flush=True)
