"""The nine collectives across many processes against numpy, with per-rank sizes that stay small
as the job grows (the whole global input lives in every process).

Run under the launcher: ``python -m strata_jax.launch -n P [--devices-per-proc D] [--hosts H]
check_at_scale.py``. Each operator runs at one size below the low-latency/allocator threshold
(64 KiB per rank) and one above it (zero-copy, two-shot), over all devices of all processes.
Prints ``OK scale <checks> checks on <N> devices`` per process; exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(240)
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
mesh = Mesh(np.array(devs), ("x",))
checks = 0


def run(body, x, spec=None):
    spec = P("x") if spec is None else spec
    arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(arr)


def check(name, out, want, exact=False):
    global checks
    # Each program is compiled once: dropping it after its check keeps a process's memory flat
    # (XLA's compiled programs and their buffers are most of what many processes hold).
    jax.clear_caches()
    for s in out.addressable_shards:
        got, exp = np.asarray(s.data), want[s.index]
        ok = np.array_equal(got, exp) if exact else np.allclose(got, exp, rtol=1e-4, atol=1e-4)
        if not ok or got.shape != exp.shape:
            print(
                f"MISMATCH {name} on device {s.device.id}: {got.ravel()[:4]} vs {exp.ravel()[:4]}",
                flush=True,
            )
            sys.exit(3)
        checks += 1


rng = np.random.default_rng(44)
# float32 elements per rank: 4 KB and 80 KB (above the 64 KiB thresholds). Every process holds
# the global input (N x per rank): kept small, 96 processes hold 7.7 MB each of it.
small, large = 1000, 20_000
for n in (small, large):
    x = rng.standard_normal((N, n)).astype(np.float32)
    for op, ref in (
        ("psum", x.sum(0)),
        ("pmean", x.mean(0)),
        ("pmax", x.max(0)),
        ("pmin", x.min(0)),
    ):
        out = run(lambda v, op=op: getattr(sj, op)(v, "x"), x)
        check(f"{op} {n}", out, np.broadcast_to(ref, x.shape))
    out = run(lambda v: sj.all_gather(v, "x", axis=1, tiled=True), x[:, : max(n // N, 3)])
    xs = x[:, : max(n // N, 3)]
    check(f"all_gather {n}", out, np.broadcast_to(xs.reshape(1, -1), (N, xs.size)), exact=True)
    per = max(n // N, 2)  # psum_scatter / all_to_all: N blocks of `per` per rank
    y = rng.standard_normal((N, N * per)).astype(np.float32)
    out = run(lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True), y)
    check(f"psum_scatter {n}", out, y.sum(0).reshape(N, per))
    z = rng.integers(-50, 50, size=(N, N, per)).astype(np.int32)
    out = run(lambda v: sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None], z)
    check(f"all_to_all {n}", out, z.transpose(1, 0, 2), exact=True)
    perm = [(i, (i + 3) % N) for i in range(N)]
    out = run(lambda v, perm=perm: sj.ppermute(v, "x", perm), x)
    check(f"ppermute {n}", out, np.roll(x, 3, axis=0), exact=True)
    root = N - 1
    out = run(lambda v, root=root: sj.pbroadcast(v, "x", root), x)
    check(f"pbroadcast {n}", out, np.broadcast_to(x[root], x.shape), exact=True)

print(
    f"OK scale {checks} checks on {N} devices, fabric {info['fabric']}, "
    f"{info.get('num_fabrics', 1)} fabric(s)",
    flush=True,
)
