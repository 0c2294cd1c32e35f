"""The low-latency path for small messages across processes (native/fabric/shm_ll.h).

Run under the launcher: ``python -m strata_jax.launch -n P check_low_latency.py``. Checks, each
rank its own shards, against numpy on the same global data:

1. every operator on both sides of the direct form's threshold (STRATA_DIRECT_BYTES, 4 KiB by
   default: float32 counts 1, 1001 per rank take a slot, 1025 and more the direct form, which
   reads the callers' own buffers), several dtypes, and psum against jax.lax; then, on a
   communicator made with the direct form off, on both sides of the slots' size
   (STRATA_LL_BYTES, 64 KiB: float32 counts 16383, 16384 per rank take a slot, 16385 the general
   path); comm_stats' ``low_latency_calls`` and ``direct_calls`` say which path each took;
2. many consecutive calls reusing the slots: a 300-step scan whose steps psum 4 B, 1028 B,
   64 KiB + 4 B and 16 KiB arrays derived from the step (exact int32), two independent
   collectives in one program (XLA runs them at once on a device), and 200 dispatches of a
   jitted psum chained on the device (more calls than slots: the ring wraps many times);
3. ranks that disagree: rank 0 psums f32[1000], the others f32[1002] (both low-latency), then
   f32[1000] against f32[100000] (one side on each path): every rank fails within 2 s naming
   psum and both sizes, never returns a value; afterwards the job still computes right.

Prints ``OK ll <n> checks`` per rank at the end; exits non-zero on the first failure.

With the argument ``kill``: rank 2 SIGKILLs itself just before a 4 KiB psum; every other
rank must fail that psum within 2 s naming rank 2 ("exited or was killed"), never hang or
return a value, and prints ``OK ll killed peer``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import strata_jax as sj
from strata_jax._src.runtime import native

sj.init()
# The paths checked here are the slot path and the general one: the staged form (on by default
# when processes outnumber cores) is check_ll_staged.py's.
native().set_ll_stage_bytes(0)

import jax  # noqa: E402
import jax.experimental.multihost_utils  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mp_checks  # noqa: E402  (tests/mp_checks.py)
from mp_checks import expect_fast_failure, fail, local_ones  # noqa: E402

sj.set_timeout(30)
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
rank = jax.process_index()
mesh, sm, global_array = mp_checks.on_devices(devs)
spec = P("x")
checks = 0


def data(seed: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.floating) or dt == jnp.bfloat16:
        return rng.standard_normal(shape).astype(np.float32).astype(dt)
    return rng.integers(-100, 100, size=shape).astype(dt)


def check(name: str, out, want: np.ndarray) -> None:
    global checks
    for s in out.addressable_shards:
        got = np.asarray(s.data)
        exp = np.asarray(want[s.index])
        if got.shape != exp.shape or got.dtype != exp.dtype:
            fail(f"{name}: shape/dtype {got.shape} {got.dtype}, want {exp.shape} {exp.dtype}")
        if exp.dtype.kind == "f" or exp.dtype == jnp.bfloat16:
            tol = 2e-2 if exp.dtype in (jnp.bfloat16, np.float16) else 1e-5
            ok = np.allclose(got.astype(np.float64), exp.astype(np.float64), rtol=tol, atol=tol)
        else:
            ok = np.array_equal(got, exp)
        if not ok:
            fail(f"{name} on device {s.device.id}: got {got.ravel()[:6]} want {exp.ravel()[:6]}")
        checks += 1


def ll_calls() -> tuple[int, int, int]:
    s = sj.comm_stats()
    return int(s["low_latency_calls"]), int(s["direct_calls"]), int(s["rendezvous_steps"])


DIRECT = native().get_direct_bytes()  # 4 KiB unless STRATA_DIRECT_BYTES says otherwise
LL = sj.get_low_latency_threshold()  # 64 KiB


def path_of(nbytes: int, direct: bool = True) -> str:
    """Where a one-input call of `nbytes` per rank goes: a slot, the direct form or (with the
    direct form off) the general path."""
    if direct and nbytes > DIRECT:
        return "direct"
    return "slot" if nbytes <= LL else "general"


def expect_path(name: str, before: tuple[int, int], calls: int, path: str) -> None:
    ll, direct, steps = ll_calls()
    got = (ll - before[0], direct - before[1])
    want = {"slot": (calls, 0), "direct": (0, calls), "general": (0, 0)}[path]
    if got != want:
        fail(f"{name}: {got} (low-latency, direct) calls, want {want} ({path})")
    # docs/scaling.md: one publication per call on the low-latency path, two barriers (arrive,
    # depart) on the general path.
    want_steps = calls * (2 if path == "general" else 1)
    if steps - before[2] != want_steps:
        fail(f"{name}: {steps - before[2]} rendezvous steps, want {want_steps} ({path})")


def reduce_np(x: np.ndarray, op: str) -> np.ndarray:
    if op == "psum":
        if x.dtype == np.bool_:
            return x.astype(np.int32).sum(0, keepdims=True)
        if x.dtype == jnp.bfloat16:
            return x.astype(np.float32).sum(0, keepdims=True).astype(x.dtype)
        return x.sum(0, keepdims=True, dtype=x.dtype)
    return (x.max if op == "pmax" else x.min)(0, keepdims=True)


if sys.argv[1:] == ["kill"]:
    g = sm(lambda u: sj.psum(u, "x"))
    x = global_array(np.ones((N, 1024), np.float32))
    g(x).block_until_ready()  # compiled, the channel made and used once
    jax.experimental.multihost_utils.sync_global_devices("ll kill")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        g(x).block_until_ready()
        fail("a psum with a killed peer returned a value")
    except sj.COLLECTIVE_ERRORS as e:
        dt = time.monotonic() - t
        msg = str(e)
        if "rank 2" not in msg or "exited or was killed" not in msg or dt > 2.0:
            fail(f"killed peer after {dt:.2f} s: {msg[:600]}")
        print(f"OK ll killed peer after {dt:.3f} s: {msg[:300]}", flush=True)
    os._exit(0)

# ---- 1. every operator, both sides of the thresholds, several dtypes ----
seed = 100
for op in ("psum", "pmax", "pmin"):
    for dtype in ("float32", "bfloat16", "int32", "int8", "bool"):
        if dtype == "bool" and op != "psum":
            continue
        counts = (1, 1001, 1025, 16385) if dtype == "float32" else (3, 5000)
        for n in counts:
            seed += 1
            x = data(seed, (N, n), dtype)
            before = ll_calls()
            out = sm(lambda v, op=op: getattr(sj, op)(v, "x"))(global_array(x))
            want = np.broadcast_to(reduce_np(x, op), (N, n))
            check(f"{op} {dtype}[{n}]", out, want.astype(out.dtype))
            nbytes = n * np.dtype(out.dtype).itemsize
            expect_path(f"{op} {dtype}[{n}]", before, jax.local_device_count(), path_of(nbytes))

# psum against jax.lax (over gloo) on the same data, below the threshold
x = data(7, (N, 2048), "float32")
a = sm(lambda v: sj.psum(v, "x"))(global_array(x))
b = sm(lambda v: jax.lax.psum(v, "x"))(global_array(x))
for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
    if not np.allclose(np.asarray(sa.data), np.asarray(sb.data), rtol=1e-5, atol=1e-5):
        fail("psum differs from jax.lax.psum")
    checks += 1

for n in (2, 4095, 4097):  # all_gather input per rank: 16380 / 16388 B of output per rank
    seed += 1
    x = data(seed, (N, n), "float32")
    out = sm(lambda v: sj.all_gather(v, "x", axis=1, tiled=True))(global_array(x))
    check(f"all_gather tiled [{n}]", out, np.broadcast_to(x.reshape(1, -1), (N, N * n)))
    out = sm(lambda v: sj.all_gather(v[0], "x")[None])(global_array(x))
    check(f"all_gather [{n}]", out, np.broadcast_to(x[None], (N, N, n)))
for n in (1, 3, 4097):  # per rank input N * n floats
    seed += 1
    x = data(seed, (N, N * n), "int32")
    out = sm(lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True))(global_array(x))
    check(f"psum_scatter [{n}]", out, x.sum(0, dtype=x.dtype).reshape(N, n))
    x3 = data(seed, (N, N, n), "float32")
    out = sm(lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None])(global_array(x3))
    check(f"all_to_all [{n}]", out, x3.transpose(1, 0, 2))
for n in (7, 16385):
    seed += 1
    x = data(seed, (N, n), "float32")
    perm = [(i, (i + 1) % N) for i in range(N)]
    out = sm(lambda v, perm=perm: sj.ppermute(v, "x", perm))(global_array(x))
    check(f"ppermute [{n}]", out, np.roll(x, 1, axis=0))
    out = sm(lambda v: sj.pbroadcast(v, "x", N - 1))(global_array(x))
    check(f"pbroadcast [{n}]", out, np.broadcast_to(x[N - 1], x.shape))

# The same on a communicator made with the direct form off (the devices in reverse order: a
# group of its own, whose channel keeps the threshold it was made with): slots up to 64 KiB, the
# general path above.
native().set_direct_bytes(1 << 50)
mesh_r = Mesh(np.array(devs[::-1]), ("x",))
for n in (1001, 16383, 16384, 16385):
    seed += 1
    x = data(seed, (N, n), "float32")
    xr = jax.make_array_from_callback(x.shape, NamedSharding(mesh_r, spec), lambda i, x=x: x[i])
    for op in ("psum", "pmax"):
        before = ll_calls()
        f = jax.jit(
            jax.shard_map(
                lambda v, op=op: getattr(sj, op)(v, "x"), mesh=mesh_r, in_specs=spec, out_specs=spec
            )
        )
        out = f(xr)
        check(f"{op} [{n}], direct form off", out, np.broadcast_to(reduce_np(x, op), (N, n)))
        expect_path(
            f"{op} [{n}], direct form off",
            before,
            jax.local_device_count(),
            path_of(4 * n, direct=False),
        )
native().set_direct_bytes(-1)
print(f"OK ll operators rank {rank}", flush=True)

# ---- 2. many consecutive calls: slot reuse, both paths alternating, two calls at once ----
SIZES = (1, 257, 16385, 4096)  # 4 B, 1028 B (slots), 64 KiB + 4 B, 16 KiB (the direct form)


def scan_body(v):
    def step(carry, i):
        outs = []
        for k, n in enumerate(SIZES):
            a = jnp.arange(n, dtype=jnp.int32) + i * (k + 1) + v[0]
            outs.append(sj.psum(a, "x")[-1])
        return carry + jnp.stack(outs), None

    tot, _ = jax.lax.scan(step, jnp.zeros(len(SIZES), jnp.int32), jnp.arange(300))
    return tot[None]


ranks = np.arange(N, dtype=np.int32)
before = ll_calls()
out = sm(scan_body)(global_array(ranks))
steps = np.arange(300)
want = np.array(
    [
        (N * ((n - 1) + steps * (k + 1)) + ranks.sum()).sum(dtype=np.int64)
        for k, n in enumerate(SIZES)
    ],
    np.int64,
).astype(np.int32)
check("scan of 300 steps x 4 sizes", out, np.broadcast_to(want, (N, len(SIZES))))
ll, direct, rsteps = ll_calls()
got = (ll - before[0], direct - before[1], rsteps - before[2])
if got != tuple(v * jax.local_device_count() for v in (600, 600, 1200)):
    fail(f"scan: {got} low-latency calls, direct calls and rendezvous steps")


def two_at_once(v):
    return sj.psum(v, "x") + sj.pmax(2 * v, "x") + sj.psum(jnp.sin(v), "x")


x = data(11, (N, 1000), "float32")
f2 = sm(two_at_once)
want = x.sum(0) + (2 * x).max(0) + np.sin(x).sum(0)
for _ in range(20):
    check(
        "independent collectives in one program",
        f2(global_array(x)),
        np.broadcast_to(want, x.shape),
    )

step_fn = sm(lambda v: sj.psum(v, "x") - (N - 1) * v)  # = own value + the others' values
v = global_array(np.tile(np.arange(1024, dtype=np.int32), (N, 1)) + ranks[:, None])
for _ in range(200):
    v = step_fn(v)  # chained on the device, dispatched ahead up to XLA's limit
# each step: v_r <- sum_j v_j - (N-1) v_r; the sum S is invariant (S <- N S - (N-1) S),
# exactly, also when the int32 values wrap
S = (np.arange(1024) * N + ranks.sum()).astype(np.int64)
back = sm(lambda u: sj.psum(u, "x"))(v)
check("200 chained calls keep the sum", back, np.broadcast_to(S.astype(np.int32), (N, 1024)))
print(f"OK ll consecutive calls rank {rank}", flush=True)

# ---- 3. ranks that disagree fail fast, on one path and across two ----
for mine, theirs, m, label in (
    (500, 502, mesh, "both low-latency"),
    (1000, 100_000, mesh, "across paths"),  # a slot and the direct form
    (1000, 100_000, mesh_r, "slot and general path"),  # the direct form off
):
    n = mine if rank == 0 else theirs
    g = jax.jit(jax.shard_map(lambda u: sj.psum(u, "x"), mesh=m, in_specs=spec, out_specs=spec))
    arr = local_ones(m, spec, n, devs)
    g.lower(arr).compile()
    msg, dt = expect_fast_failure(
        g,
        (arr,),
        ("psum", f"[{mine}]", f"[{theirs}]"),
        fail,
        f"mismatch {label}",
    )
    print(f"OK ll mismatch {label} raised after {dt:.3f} s: {msg[:300]}", flush=True)

# the job goes on computing right after the failures
x = data(12, (N, 300), "int32")
for _ in range(40):
    check(
        "after the failures",
        sm(lambda u: sj.psum(u, "x"))(global_array(x)),
        np.broadcast_to(x.sum(0, dtype=x.dtype), x.shape),
    )
native().set_ll_stage_bytes(-1)
print(f"OK ll {checks} checks rank {rank}", flush=True)
sys.stdout.flush()
