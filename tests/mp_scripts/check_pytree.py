"""A pytree's psum/pmax as one call across processes, and psum_scatter over a non-leading
dimension in place, against numpy on the same global data (bitwise).

Run under the launcher: ``python -m strata_jax.launch -n P [--devices-per-proc D]
check_pytree.py``. The leaves straddle the allocator's threshold (64 KiB), so one call mixes
zero-copy leaves (pool memory) and staged ones (libc memory), with 0-d and zero-size leaves and
several dtypes; one-shot and two-shot; a pytree of small leaves only takes the low-latency path
as one packed input. The oracle folds the ranks in rank order as strata does
(bfloat16 in float32, rounded once), so every value must match bitwise. Prints "OK pytree <n>
checks" per process; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import sys

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)
sj.set_timeout(60)
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
mesh = Mesh(np.array(devs), ("x",))
checks = 0

# Per-device leaf shapes and dtypes: small (staged), large (zero-copy), 0-d, zero-size.
LEAVES = [
    ((), np.float32),
    ((3, 5), jnp.bfloat16),
    ((0, 4), np.float32),
    ((7,), np.int32),
    ((300, 256), np.float32),  # 300 KiB: from the allocator's pool
    ((2, 3, 4), np.float64),
    ((70_000,), np.int64),  # 547 KiB
    ((129,), np.uint8),
]


class Leaf:
    """Leaf ``k`` of the tree: rank r's value drawn from a seed of (k, r), so a process makes its
    own devices' values and folds the others' one at a time (the global leaves held ~200 MiB a
    process at 96 ranks; the OOM killer ended the job)."""

    def __init__(self, k: int, shape: tuple, dt):
        self.k, self.shape, self.dt = k, shape, dt
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        self.folded: dict[str, np.ndarray] = {}

    def of(self, r: int) -> np.ndarray:
        v = np.random.default_rng([7, self.k, r]).standard_normal(self.shape) * 4
        return v.astype(np.float32).astype(self.dt) if self.dt != np.int64 else v.astype(self.dt)


def fold(leaf: Leaf, op: str) -> np.ndarray:
    """Rank-order fold over the ranks (rank 0 first), as strata's kernels do."""
    if op not in leaf.folded:
        bf = leaf.dt == jnp.bfloat16
        acc = leaf.of(0).astype(np.float32) if bf else leaf.of(0)
        for r in range(1, N):
            v = leaf.of(r).astype(np.float32) if bf else leaf.of(r)
            acc = {"psum": np.add, "pmax": np.maximum, "pmin": np.minimum}[op](acc, v)
        leaf.folded[op] = acc.astype(leaf.dt)
    return leaf.folded[op]


def put(x):
    sh = NamedSharding(mesh, P("x"))
    if isinstance(x, np.ndarray):  # a global array [N, ...]
        g = x.reshape((N * x.shape[1], *x.shape[2:])) if x.ndim > 1 else x
        return jax.make_array_from_callback(g.shape, sh, lambda idx: g[idx])
    if not x.shape:  # 0-d leaves: one element per rank
        return jax.make_array_from_callback(
            (N,), sh, lambda idx: np.stack([x.of(r) for r in range(N)[idx[0]]])
        )
    rows = x.shape[0]

    def shard(idx):
        lo, hi, _ = idx[0].indices(N * rows)
        if rows == 0:
            return np.zeros(x.shape, x.dt)
        return np.concatenate([x.of(r) for r in range(lo // rows, hi // rows)])[
            (slice(None), *idx[1:])
        ]

    return jax.make_array_from_callback((N * rows, *x.shape[1:]), sh, shard)


# Across fabrics (launch --hosts) a psum is reduced inside each fabric, then between them: not
# in rank order, so float sums are compared to a tolerance there, and the structure of the
# lowered program (one list call, the low-latency path) is that of one fabric only.
ONE_FABRIC = info.get("num_fabrics", 1) == 1


def same(got: np.ndarray, exp: np.ndarray) -> bool:
    if got.dtype != exp.dtype:
        return False
    fp = got.dtype == jnp.bfloat16 or np.issubdtype(got.dtype, np.inexact)
    if ONE_FABRIC or not fp:
        return got.tobytes() == exp.tobytes()
    g, e = got.astype(np.float64), exp.astype(np.float64)
    tol = 2e-2 if got.dtype == jnp.bfloat16 else 1e-4
    return np.allclose(g, e, rtol=tol, atol=tol * max(1.0, float(np.abs(e).max(initial=0))))


def check(name: str, out, want: np.ndarray) -> None:
    """Every local shard of ``out`` (one device's result) equals ``want`` bitwise (within a
    tolerance for float sums across fabrics)."""
    global checks
    for s in out.addressable_shards:
        got = np.asarray(s.data)
        exp = np.ascontiguousarray(want).reshape(got.shape) if got.size == want.size else None
        if exp is None or not same(got, exp):
            print(f"MISMATCH {name} on device {s.device.id}: got {got.ravel()[:4]}", flush=True)
            sys.exit(3)
        checks += 1


rng = np.random.default_rng(7)
hosts = [Leaf(k, shape, dt) for k, (shape, dt) in enumerate(LEAVES)]

# The whole pytree (general path: a table of its buffers), then its small leaves alone (under
# 64 KiB in all: the low-latency path, the leaves packed into one slot).
for small in (False, True):
    picked = [h for h in hosts if not small or h.nbytes < 4096]
    tree = [put(h) for h in picked]
    ranks0 = [not h.shape for h in picked]
    ll_before = sj.comm_stats()["low_latency_calls"]
    for op in ("psum", "pmax"):
        for threshold in (1 << 40, 0):  # one-shot, then two-shot
            sj.set_two_shot_threshold(threshold)

            def body(t, op=op, ranks0=ranks0):
                t = [v.reshape(()) if r0 else v for v, r0 in zip(t, ranks0, strict=True)]
                out = getattr(sj, op)(t, "x")
                return [v.reshape((1,)) if r0 else v for v, r0 in zip(out, ranks0, strict=True)]

            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            if op == "psum" and threshold and ONE_FABRIC:
                text = f.lower(tree).as_text()
                assert text.count("stablehlo.custom_call @strata_all_reduce_list") == 1, text
            outs = f(tree)
            for k, (h, out) in enumerate(zip(picked, outs, strict=True)):
                check(f"{op} leaf {k} threshold {threshold} small {small}", out, fold(h, op))
    took_ll = sj.comm_stats()["low_latency_calls"] > ll_before
    # The low-latency path serves groups of up to 64 ranks (a 64-bit read mask per slot);
    # larger groups take the general path.
    assert not ONE_FABRIC or took_ll == (small and N <= 64), (small, N, took_ll)
sj.set_two_shot_threshold(1024)

# The same pytree through jax.lax.psum/pmax under use_for_jax_lax(): JAX binds one all-reduce
# per leaf; the combiner (lax_hooks.py) makes them one strata call.
tree = [put(h) for h in hosts]
ranks0 = [not h.shape for h in hosts]
for op in ("psum", "pmax"):

    def body(t, op=op):
        t = [v.reshape(()) if r0 else v for v, r0 in zip(t, ranks0, strict=True)]
        out = getattr(jax.lax, op)(t, "x")
        return [v.reshape((1,)) if r0 else v for v, r0 in zip(out, ranks0, strict=True)]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with sj.use_for_jax_lax():
        text = f.lower(tree).as_text()
        assert not ONE_FABRIC or text.count("stablehlo.custom_call @strata_") == 1, text
        assert "@strata_all_reduce_list" in text or not ONE_FABRIC, text
        outs = f(tree)
    for k, (h, out) in enumerate(zip(hosts, outs, strict=True)):
        check(f"jax.lax.{op} leaf {k} combined", out, fold(h, op))

# psum_scatter over dimension 1 (in place, strided) and its transpose (all_gather over dim 1).
x = rng.standard_normal((N, 6, 4 * N, 5)).astype(np.float32)
xs = put(x)
f = jax.jit(
    jax.shard_map(
        lambda v: sj.psum_scatter(v, "x", scatter_dimension=1, tiled=True),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
)
assert "strata_psum_scatter_rows" in f.lower(xs).as_text() or not ONE_FABRIC
out = f(xs)
total = x[0].copy()  # [6, 4N, 5], folded in rank order
for r in range(1, N):
    total = total + x[r]
for s in out.addressable_shards:
    r = devs.index(s.device)
    got = np.asarray(s.data)
    if not same(got, np.ascontiguousarray(total[:, 4 * r : 4 * r + 4])):
        print(f"MISMATCH psum_scatter dim 1 on rank {r}")
        sys.exit(3)
    checks += 1
print(f"OK pytree {checks} checks", flush=True)
