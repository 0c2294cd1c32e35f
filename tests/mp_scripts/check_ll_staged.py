"""The staged form of the low-latency path across processes (native/fabric/shm_ll.h): calls
larger than a slot go through the owner's bounce buffer with no departure barrier.

Run under the launcher (``python -m strata_jax.launch -n P [--devices-per-proc D]``); by
default (processes not outnumbering the cores) the form is off, so the script turns it on
(16 MiB) for a communicator of its own: the job's devices in a rotated order, which no other
check script uses (a communicator keeps the limits it was created with). Checks, each rank its
own shards, against numpy on the same global data, and which path each call took
(comm_stats' ``low_latency_calls``, memory_stats' ``staged_calls``):

1. all_to_all (128 KiB to 8 MiB per rank), all_gather, psum_scatter, ppermute staged; psum
   and pbroadcast staged up to 1 MiB per rank and on the general path above it; a staged psum
   equal bit for bit to the same values summed on the general path;
2. 40 chained all_to_alls of 1 MiB (the ring of slots wraps, bounce buffers are reused only
   once every peer has read them), and two staged calls in one program;
3. ranks that disagree: a staged psum against a general one (1.2 MiB on ranks 1.., 800 KB on
   rank 0) and two staged all_to_alls of different sizes: every rank fails within 2 s naming
   both sizes; afterwards the job computes right.

Prints ``OK ll staged <n> checks rank <r>`` at the end; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import strata_jax as sj
from strata_jax._src.runtime import native

sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mp_checks  # noqa: E402  (tests/mp_checks.py)
from mp_checks import expect_fast_failure, fail, local_ones  # noqa: E402

sj.set_timeout(30)
native().set_ll_stage_bytes(16 << 20)
devs = sorted(jax.devices(), key=lambda d: d.id)
devs = devs[1:] + devs[:1]  # a communicator of this script's own
N = len(devs)
rank = jax.process_index()
mesh, sm, global_array = mp_checks.on_devices(devs)
spec = P("x")
checks = 0


def data(seed: int, shape, dtype="float32") -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def check(name: str, out, want: np.ndarray, exact: bool = True) -> None:
    global checks
    for s in out.addressable_shards:
        got, exp = np.asarray(s.data), np.asarray(want[s.index])
        ok = got.shape == exp.shape and (
            np.array_equal(got, exp) if exact else np.allclose(got, exp, rtol=1e-5, atol=1e-5)
        )
        if not ok:
            fail(f"{name} on device {s.device.id}: got {got.ravel()[:6]} want {exp.ravel()[:6]}")
        checks += 1


def counters() -> tuple[int, int]:
    return int(sj.comm_stats()["low_latency_calls"]), int(sj.memory_stats()["staged_calls"])


def expect(name: str, before: tuple[int, int], calls: int, staged: bool) -> None:
    ll, st = (a - b for a, b in zip(counters(), before, strict=True))
    want = calls * jax.local_device_count() if staged else 0
    if ll != want or st != want:
        fail(f"{name}: {ll} low-latency and {st} staged calls, want {want} of each")


# ---- 1. operators ----
for n in (8 * 1024, 100_000, 512 * 1024):  # floats per destination
    x = data(n, (N, N, n))
    b = counters()
    out = sm(lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None])(global_array(x))
    check(f"all_to_all [{N}x{n}]", out, x.transpose(1, 0, 2))
    expect(f"all_to_all [{N}x{n}]", b, 1, True)
x = data(1, (N, 50_000))
b = counters()
out = sm(lambda v: sj.all_gather(v, "x", axis=1, tiled=True))(global_array(x))
check("all_gather", out, np.broadcast_to(x.reshape(1, -1), (N, N * 50_000)))
expect("all_gather", b, 1, True)
x = data(2, (N, N * 20_000), "int32")
b = counters()
out = sm(lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True))(global_array(x))
check("psum_scatter", out, x.sum(0, dtype=x.dtype).reshape(N, 20_000))
expect("psum_scatter", b, 1, True)
x = data(3, (N, 70_000))
perm = [(i, (i + 1) % N) for i in range(N)]
b = counters()
out = sm(lambda v: sj.ppermute(v, "x", perm))(global_array(x))
check("ppermute", out, np.roll(x, 1, axis=0))
expect("ppermute", b, 1, True)
for n, staged in ((100_000, True), (300_000, False)):  # 400 KB and 1.2 MB per rank
    x = data(n, (N, n), "int32")
    b = counters()
    out = sm(lambda v: sj.psum(v, "x"))(global_array(x))
    check(f"psum int32[{n}]", out, np.broadcast_to(x.sum(0, dtype=x.dtype), x.shape))
    expect(f"psum int32[{n}]", b, 1, staged)
    x = data(n + 1, (N, n))
    b = counters()
    out = sm(lambda v: sj.pbroadcast(v, "x", N - 1))(global_array(x))
    check(f"pbroadcast [{n}]", out, np.broadcast_to(x[N - 1], x.shape))
    expect(f"pbroadcast [{n}]", b, 1, staged)
# Bit for bit: a staged psum of x (800 KB per rank) against the general path's psum of x, x, x.
x = data(4, (N, 200_000))
staged = sm(lambda v: sj.psum(v, "x"))(global_array(x))
general = sm(lambda v: sj.psum(jnp.tile(v, 3), "x")[..., : v.shape[-1]])(global_array(x))
for a, b in zip(staged.addressable_shards, general.addressable_shards, strict=True):
    if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
        fail(f"staged psum differs from the general path's on device {a.device.id}")
    checks += 1
check("staged psum", staged, np.broadcast_to(x.sum(0), x.shape), exact=False)
print(f"OK ll staged operators rank {rank}", flush=True)

# ---- 2. many calls: the ring wraps, bounce buffers are reused; two staged calls at once ----
step = sm(lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None] + 1)
v0 = data(5, (N, N, 65536), "int32")
v = global_array(v0)
for _ in range(40):
    v = step(v)  # chained on the device; all_to_all twice is the identity, plus the 1s
check("40 chained all_to_alls", v, v0 + 40)


def two(v):
    return (
        sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None]
        + sj.all_gather(v[0, :1], "x", axis=0, tiled=True)[None]
    )


x = data(6, (N, N, 40_000))
want = x.transpose(1, 0, 2) + np.broadcast_to(x[:, 0][None], (N, N, 40_000))
b = counters()
for _ in range(10):
    check("two staged calls in one program", sm(two)(global_array(x)), want)
expect("two staged calls in one program", b, 20, True)
print(f"OK ll staged consecutive calls rank {rank}", flush=True)

# ---- 3. ranks that disagree fail fast: staged against general, staged against staged ----
cases = (
    ("psum", 200_000, 300_000, "across paths", lambda u: sj.psum(u, "x")),
    ("all_to_all", 200_000, 240_000, "both staged", None),
)
for op, mine, theirs, label, fn in cases:
    n = mine if rank == 0 else theirs
    if fn is None:
        fn = lambda u: sj.all_to_all(u, "x", 0, 0, tiled=True)  # noqa: E731
    g = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    arr = local_ones(mesh, spec, n, devs)
    g.lower(arr).compile()
    msg, dt = expect_fast_failure(
        g,
        (arr,),
        (op, f"[{mine}]", f"[{theirs}]"),
        fail,
        f"mismatch {label}",
    )
    print(f"OK ll staged mismatch {label} raised after {dt:.3f} s: {msg[:200]}", flush=True)

x = data(7, (N, N, 30_000))
for _ in range(5):
    out = sm(lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None])(global_array(x))
    check("after the failures", out, x.transpose(1, 0, 2))
native().set_ll_stage_bytes(-1)
print(f"OK ll staged {checks} checks rank {rank}", flush=True)
sys.stdout.flush()
