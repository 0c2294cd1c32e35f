"""Every strata collective across processes against numpy on the same global data.

Run under the launcher: ``python -m strata_jax.launch -n P [--devices-per-proc D]
check_collectives.py OUT_DIR``. Every process builds the same global input from a fixed seed,
feeds its own shards, and checks its own output shards. Sizes straddle the allocator's threshold
(pool memory, zero-copy, above it; libc memory below it, which takes the low-latency path up to
its threshold and is staged above it); the staging mode stages every buffer. A sha256 of every
strata output is written to OUT_DIR/digest-<mode>-<pid>.txt so the test can compare registration
modes bit for bit. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)
sj.set_timeout(60)
out_dir = Path(sys.argv[1])
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
pid = jax.process_index()
digest = hashlib.sha256()
checks = 0


def data(seed: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
        return rng.standard_normal(shape).astype(np.float32).astype(dt)
    if dt == jnp.bool_:
        return rng.random(shape) < 0.5
    return rng.integers(-50, 50, size=shape).astype(dt)


def run(mesh: Mesh, body, x: np.ndarray, spec, out_spec=None):
    sh = NamedSharding(mesh, spec)
    arr = jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec or spec))
    return f(arr)


def check(name: str, out, want: np.ndarray, dtype) -> None:
    global checks
    dt = jnp.dtype(dtype)
    for s in sorted(out.addressable_shards, key=lambda s: s.device.id):
        got = np.asarray(s.data)
        exp = want[s.index]
        digest.update(got.tobytes())
        if jnp.issubdtype(dt, jnp.floating):
            tol = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-5, "float64": 1e-12}[str(dt)]
            ok = np.allclose(got.astype(np.float64), exp.astype(np.float64), rtol=tol, atol=tol)
        else:
            ok = np.array_equal(got, exp)
        if not ok or got.shape != exp.shape:
            print(
                f"MISMATCH {name} on device {s.device.id}: got {got.ravel()[:6]} want "
                f"{exp.ravel()[:6]}",
                flush=True,
            )
            sys.exit(3)
        checks += 1


def reduce_np(x: np.ndarray, op: str, axis: int) -> np.ndarray:
    if op == "psum":
        if x.dtype in (jnp.bfloat16, np.float16):
            return x.astype(np.float32).sum(axis, keepdims=True).astype(x.dtype)
        return x.sum(axis, keepdims=True, dtype=x.dtype)
    if op == "pmean":
        return (x.astype(np.float64).mean(axis, keepdims=True)).astype(x.dtype)
    if op == "pprod":  # in rank order; bfloat16 multiplied in float32 and rounded once
        wide = x.astype(np.float32) if x.dtype == jnp.bfloat16 else x
        out = np.take(wide, [0], axis)
        for r in range(1, x.shape[axis]):
            out = out * np.take(wide, [r], axis)
        return out.astype(x.dtype)
    return (x.max if op == "pmax" else x.min)(axis, keepdims=True)


mesh = Mesh(np.array(devs), ("x",))
# Element counts per rank: tiny (libc, staged), odd (not a multiple of the rank count or a cache
# line) and above the allocator's threshold (64 KiB: pool memory, zero-copy), 4 MiB (two-shot).
SIZES = [1, 1001, 96_001, 1 << 20]
seed = 0
for op in ("psum", "pmax", "pmin", "pmean", "pprod"):
    for dtype, sizes in (("float32", SIZES), ("bfloat16", SIZES[:3]), ("int32", SIZES[1:3])):
        if op == "pmean" and dtype == "int32":
            continue
        for n in sizes:
            seed += 1
            x = data(seed, (N, n), dtype)
            out = run(mesh, lambda v, op=op: getattr(sj, op)(v, "x"), x, P("x"))
            want = np.broadcast_to(reduce_np(x, op, 0), x.shape)
            check(f"{op} {dtype} {n}", out, want, dtype)

for n in (3, 70_001):
    seed += 1
    x = data(seed, (N, n), "float32")
    out = run(mesh, lambda v: sj.all_gather(v[0], "x")[None], x, P("x"))
    check(f"all_gather {n}", out, np.broadcast_to(x[None], (N, N, n)), "float32")
    out = run(mesh, lambda v: sj.all_gather(v, "x", axis=1, tiled=True), x, P("x"))
    check(f"all_gather tiled {n}", out, np.broadcast_to(x.reshape(1, -1), (N, N * n)), "float32")

for n in (5, 40_000):
    seed += 1
    x = data(seed, (N, N * n), "float32")
    out = run(mesh, lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True), x, P("x"))
    check(f"psum_scatter {n}", out, x.sum(0).reshape(N, n), "float32")

for n in (2, 30_000):
    seed += 1
    x = data(seed, (N, N, n), "int32")
    out = run(mesh, lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None], x, P("x"))
    check(f"all_to_all {n}", out, x.transpose(1, 0, 2), "int32")

for n in (7, 80_000):
    seed += 1
    x = data(seed, (N, n), "float32")
    perm = [(i, (i + 1) % N) for i in range(N)]
    out = run(mesh, lambda v, perm=perm: sj.ppermute(v, "x", perm), x, P("x"))
    check(f"ppermute {n}", out, np.roll(x, 1, axis=0), "float32")
    root = N - 1
    out = run(mesh, lambda v, root=root: sj.pbroadcast(v, "x", root), x, P("x"))
    check(f"pbroadcast {n}", out, np.broadcast_to(x[root], x.shape), "float32")

if N == 4 and jax.local_device_count() == 2:
    # A 2x2 mesh: axis "b" stays inside a process, axis "a" crosses processes, both mix them.
    mesh2 = Mesh(np.array(devs).reshape(2, 2), ("a", "b"))
    for axes in (("a",), ("b",), ("a", "b")):
        for n in (9, 70_000):
            seed += 1
            x = data(seed, (2, 2, n), "float32")
            out = run(mesh2, lambda v, axes=axes: sj.psum(v, axes), x, P("a", "b"))
            ax = tuple({"a": 0, "b": 1}[a] for a in axes)
            want = np.broadcast_to(x.sum(ax, keepdims=True), x.shape)
            check(f"2d psum {axes} {n}", out, want, "float32")
        seed += 1
        x = data(seed, (2, 2, 4, 3), "float32")
        out = run(
            mesh2, lambda v, axes=axes: sj.all_gather(v, axes, axis=2, tiled=True), x, P("a", "b")
        )
        g = x.reshape(4, 4, 3) if axes == ("a", "b") else None
        if axes == ("a", "b"):
            want = np.broadcast_to(np.concatenate(list(g), 0)[None, None], (2, 2, 16, 3))
        elif axes == ("a",):
            want = np.broadcast_to(np.concatenate([x[0], x[1]], 1)[None], (2, 2, 8, 3))
        else:
            want = np.broadcast_to(np.concatenate([x[:, 0], x[:, 1]], 1)[:, None], (2, 2, 8, 3))
        check(f"2d all_gather {axes}", out, want, "float32")

stats = sj.memory_stats()
mode = info["registration"]
(out_dir / f"digest-{mode}-{N}-{pid}.txt").write_text(digest.hexdigest())
print(
    f"OK {checks} checks, mode {mode}, zero_copy_bytes {stats['zero_copy_bytes']}, "
    f"staged_bytes {stats['staged_bytes']}, registrations_critical "
    f"{stats['registrations_critical']}",
    flush=True,
)
# on_alloc keeps a reserve of segments made and faulted in ahead of demand (default 128 MiB, in
# one segment, less on a host with many processes: limits.default_reserve); the other modes keep
# none.
if mode == "on_alloc":
    from strata_jax._src import limits

    want_reserve = limits.default_reserve(len(info["fabric_processes"]))
    assert stats["pool_reserve_bytes"] == want_reserve, stats
    assert stats["pool_segments_made_ahead"] >= 1, stats
else:
    assert stats["pool_reserve_bytes"] == 0 and stats["pool_segments_made_ahead"] == 0, stats
if mode == "staging":
    assert stats["zero_copy_bytes"] == 0, stats
else:
    assert stats["zero_copy_bytes"] > 0, stats
    # Buffers above the low-latency threshold but below the allocator's are libc memory, staged
    # through a bounce buffer; with the defaults (both 64 KiB) there are none, and the staging
    # mode's run of this script (and check_pytree.py's small leaves beside pool ones) stage.
    if stats["pool_threshold"] > sj.get_low_latency_threshold():
        assert stats["staged_bytes"] > 0, stats
