"""How calls meet across processes, and the ordering they rely on.

Run under the launcher with -n 2 --devices-per-proc 2 (or 1):

- two call sites: one jitted shard_map psum, called on a different source line on each rank: every
  rank gets the sum (XLA's run ids differ per call site; strata keys calls by communicator);
- independent collectives inside one program (XLA runs them at once on a device) and several
  programs dispatched ahead without blocking: every result equals numpy, and no two
  executions were ever in flight on one device (comm_stats);
- sizes that differ: rank 0 psums f32[409600], rank 1 f32[409598] (per device) with a 20 s timeout:
  every rank raises well under a second, naming psum and both sizes;
- empty on one rank: rank 0's array is empty, rank 1's is not: both fail at once naming both sizes
  (the empty call runs too: its program-order token keeps XLA from removing it);
- processes whose programs give a ppermute different permutations: every rank fails at once,
  saying the parameters differ;
- the exception types a failed collective raises (strata_jax.COLLECTIVE_ERRORS).
Prints ``OK <what> ...`` lines; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import expect_fast_failure, local_ones  # noqa: E402  (tests/mp_checks.py)

from strata_jax._src.jax_compat import distributed  # noqa: E402

sj.set_timeout(20)
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
L = jax.local_device_count()
rank = jax.process_index()
mesh = Mesh(np.array(devs), ("x",))
spec = NamedSharding(mesh, P("x"))


def sm(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def global_array(x: np.ndarray):
    return jax.make_array_from_callback(x.shape, spec, lambda idx: x[idx])


def local(out) -> np.ndarray:
    return np.concatenate(
        [np.asarray(s.data) for s in sorted(out.addressable_shards, key=lambda s: s.device.id)]
    )


def fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    sys.exit(3)


# ---- the same function from two call sites ----
f = sm(lambda v: sj.psum(v, "x"))
x = global_array(np.ones(4 * N, np.float32))
if rank == 0:
    y = f(x)
else:
    y = f(x)
if not np.array_equal(local(y), np.full(4 * L, N, np.float32)):
    fail(f"two call sites: {local(y)}")
print("OK two call sites", local(y)[:4].tolist(), flush=True)

# ---- independent collectives in one program; several programs dispatched ahead ----
rng = np.random.default_rng(7)
xs = rng.standard_normal((N, 1 << 18)).astype(np.float32)
multi = sm(
    lambda v: jnp.stack(
        [sj.psum(v, "x"), sj.psum(jnp.sin(v), "x"), sj.pmax(2 * v, "x"), sj.psum(v * v, "x")]
    )[None]
)
want = np.stack([xs.sum(0), np.sin(xs).sum(0), (2 * xs).max(0), (xs * xs).sum(0)])
gx = global_array(xs)
for out in [multi(gx) for _ in range(4)]:
    for s in out.addressable_shards:
        got = np.asarray(s.data)[0, :, 0]
        if not np.allclose(got, want, rtol=1e-5, atol=1e-3):
            bad = [i for i in range(4) if not np.allclose(got[i], want[i], rtol=1e-5, atol=1e-3)]
            fail(f"independent collectives in one program paired wrongly: rows {bad}")
progs = [
    sm(lambda v: sj.psum(v, "x") / N),
    sm(lambda v: sj.all_gather(v, "x", tiled=True).reshape(N, -1).mean(0)),
    sm(lambda v: (sj.psum(v, "x") + sj.pmax(v, "x")) / (N + 1)),
]
y = global_array(np.ones(N * 256, np.float32))
for i in range(300):  # dispatched ahead: nothing blocks until the end
    y = progs[i % 3](y)
if not np.allclose(local(y), 1.0):
    fail(f"dispatch ahead: {local(y)[:4]}")
st = sj.comm_stats()
if st["max_runs_in_flight_per_device"] != 1:
    fail(f"two executions in flight on one device: {st}")
print(
    "OK ordering: max calls in flight per device",
    st["max_calls_in_flight_per_device"],
    "max executions in flight per device",
    st["max_runs_in_flight_per_device"],
    flush=True,
)

# ---- the ranks disagree on the size ----
n = 409600 if rank == 0 else 409598
g = sm(lambda v: sj.psum(v, "x"))
sh = local_ones(mesh, spec, n, devs)
g.lower(sh).compile()
msg, dt = expect_fast_failure(g, (sh,), ("psum", "[409600]", "[409598]"), fail, "sizes differ")
print(f"OK sizes differ mismatch raised after {dt:.3f} s: {msg[:400]}", flush=True)


# ---- one rank's array is empty ----
# XLA removes a computation whose results are all empty, but the shard_map region's
# program-order token (program_order.py: _chain_shard_map_regions) is not empty, so rank 0's empty
# call runs and meets rank 1's: they differ (f32[0] vs f32[5]) and both fail at once, naming
# both. (Before the token, rank 0's empty call ran nothing and its next call, f32[3], met
# rank 1's; a rank that does not reach that next call never fails.)
empty = local_ones(mesh, spec, 0 if rank == 0 else 5, devs)
_, dt = expect_fast_failure(g, (empty,), ("[0]", "[5]"), fail, "empty on one rank")
print(f"OK empty on one rank raised after {dt:.3f} s", flush=True)

# ---- ranks (processes running different programs) disagree on a ppermute's permutation ----
# Process 0 sends right, process 1 left (N >= 3: with 2 devices both are the same swap). Each
# used to follow its own permutation and return a value; the permutation is part of the
# descriptor now: every rank fails at once saying the parameters differ.
if N >= 3:
    perm = [(i, (i + 1) % N) if rank == 0 else (i, (i - 1) % N) for i in range(N)]
    pp = sm(lambda v: sj.ppermute(v, "x", perm))
    x8 = global_array(np.arange(N * 8, dtype=np.float32))
    _, dt = expect_fast_failure(
        pp,
        (x8,),
        ("ppermute", "parameters"),
        fail,
        "ppermute with different permutations",
    )
    print(f"OK ppermute permutations differ raised after {dt:.3f} s", flush=True)

# ---- which exception a failed collective raises (JAX decides: runtime.COLLECTIVE_ERRORS) ----
# Last: rank 0 times out alone in these calls, leaving its executions ahead of rank 1's.
client = distributed.global_state.client
ran = sm(lambda v: sj.pmax(v, "x"))  # runs once first: later failures come from C++ dispatch
fresh = sm(lambda v: sj.pmin(v, "x"))  # fails on its first call: Python dispatch
one = global_array(np.ones(N, np.float32))
ran(one).block_until_ready()
client.wait_at_barrier("cm/errors-start", 60_000)
if rank == 0:
    sj.set_timeout(0.5)
    kinds = []
    for fn in (fresh, fresh, ran, ran):
        try:
            fn(one).block_until_ready()
            fail("a collective without its peers returned")
        except sj.COLLECTIVE_ERRORS as e:
            if "strata_jax" not in str(e) or "timed out" not in str(e):
                fail(f"unexpected error: {e}")
            kinds.append(type(e).__name__)
    print("OK errors", kinds, flush=True)
client.wait_at_barrier("cm/errors-end", 60_000)
print("OK all", flush=True)
sys.stdout.flush()
# Rank 0 hosts the coordination service: if it exits first, another rank's error poller can
# abort that process ("Socket closed") before it prints (seen once in CI). Everyone prints, meets,
# then the others exit while rank 0 waits a moment.
client.wait_at_barrier("cm/printed", 60_000)
if rank == 0:
    time.sleep(1.0)
os._exit(0)  # calls failed on purpose above; skip jax.distributed's shutdown dance
