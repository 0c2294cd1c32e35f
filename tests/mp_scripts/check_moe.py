"""strata_jax.moe dispatch/combine (and their gradients) across processes against numpy.

Run under the launcher: ``python -m strata_jax.launch -n P [--devices-per-proc D]
check_moe.py``. Every process builds the same global tokens, routing and weights from a fixed
seed, feeds its own shards, runs dispatch + combine over all devices of all processes (one
expert-parallel axis) and checks its own output shards and gradient shards against a numpy
reference. One case has x rows above the allocator's threshold (zero-copy) and the others
small buffers (staged through bounce buffers). Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import strata_jax as sj

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_reference import ref_plan  # noqa: E402  (tests/moe_reference.py)

info = sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(60)
stats0 = (
    sj.memory_stats()
)  # counters are per process: another script may have run before (run_checks.py)
devs = sorted(jax.devices(), key=lambda d: d.id)
R = len(devs)
mesh = Mesh(np.array(devs), ("x",))
spec = P("x")
checks = 0


def put(a: np.ndarray):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def check(name: str, out, want: np.ndarray, tol: float) -> None:
    global checks
    for s in out.addressable_shards:
        got = np.asarray(s.data, np.float64)
        exp = want[s.index]
        if got.shape != exp.shape or not np.allclose(got, exp, rtol=tol, atol=tol):
            err = np.abs(got - exp).max() if got.shape == exp.shape else "shape"
            print(f"MISMATCH {name} on device {s.device.id}: max err {err}", flush=True)
            sys.exit(3)
        checks += 1


mine = [i for i, d in enumerate(devs) if d.process_index == jax.process_index()]


class Local:
    """Rows ``index`` of a global reference (``rows[i]`` is global row ``index[i]``), indexed like
    the global array for the rows check() reads (the addressable shards)."""

    def __init__(self, index: np.ndarray, rows: np.ndarray, size: int):
        self.rows, self.at, self.size = rows, {int(g): i for i, g in enumerate(index)}, size

    def __getitem__(self, idx):
        sel = range(self.size)[idx[0]]
        return self.rows[[self.at[g] for g in sel]][(slice(None), *idx[1:])]


def case(seed: int, t: int, h: int, k: int, experts_per_rank: int, capacity) -> None:
    rng = np.random.default_rng(seed)
    n, e = R * t, R * experts_per_rank
    cap = capacity if capacity is not None else n
    idx = rng.integers(-1, e, (n, k)).astype(np.int32)
    idx[0, :2] = 0  # a token naming one expert twice (every case has k >= 2)
    w = rng.random((n, k)).astype(np.float32)
    x = rng.standard_normal((n, h)).astype(np.float32)
    ey = rng.standard_normal((e, cap, h)).astype(np.float32)
    cr = rng.standard_normal((e, cap, h)).astype(np.float32)
    cy = rng.standard_normal((n, h)).astype(np.float32)
    src, cidx, _, _ = ref_plan(idx, e, cap)

    # Reference forward and gradients of L = sum(recv * cr) + sum(y * cy), for this process's
    # tokens and experts only (check() reads the addressable shards): the global float64
    # intermediates ([N, K, H] rows, [E, C, H] recv and dey) held ~250 MiB a process at 96 ranks
    # (the OOM killer ended the job).
    f64 = np.float64
    loc_t = np.concatenate([np.arange(r * t, (r + 1) * t) for r in mine])
    loc_e = np.concatenate(
        [np.arange(r * experts_per_rank, (r + 1) * experts_per_rank) for r in mine]
    )
    pos_t = np.full(n, -1, np.int64)
    pos_t[loc_t] = np.arange(len(loc_t))
    pos_e = np.full(e, -1, np.int64)
    pos_e[loc_e] = np.arange(len(loc_e))
    src_l = src[loc_e]
    recv = np.where((src_l >= 0)[..., None], x[np.maximum(src_l, 0)].astype(f64), 0.0)
    c_l = cidx[loc_t]
    kept = c_l >= 0
    rows = np.where(kept[..., None], ey.reshape(-1, h)[np.maximum(c_l, 0)].astype(f64), 0.0)
    y = np.einsum("nk,nkh->nh", np.where(kept, w[loc_t], 0.0), rows)
    dw = np.where(kept, np.einsum("nkh,nh->nk", rows, cy[loc_t].astype(f64)), 0.0)
    del rows
    srcf = src.ravel()
    m = (srcf >= 0) & (pos_t[np.maximum(srcf, 0)] >= 0)  # slots holding a token of this process
    dx = np.zeros((len(loc_t), h), f64)
    np.add.at(dx, pos_t[srcf[m]], cr.reshape(-1, h)[m])
    gi, ki = np.nonzero(cidx >= 0)
    slot = cidx[gi, ki]
    m = pos_e[slot // cap] >= 0  # slots of this process's experts
    gi, ki, slot = gi[m], ki[m], slot[m]
    dey = np.zeros((len(loc_e) * cap, h), f64)
    np.add.at(dey, pos_e[slot // cap] * cap + slot % cap, w[gi, ki, None] * cy[gi].astype(f64))
    recv, dey = Local(loc_e, recv, e), Local(loc_e, dey.reshape(len(loc_e), cap, h), e)
    y, dw, dx = Local(loc_t, y, n), Local(loc_t, dw, n), Local(loc_t, dx, n)

    def body(x, idx, w, ey):
        r, lay = sj.moe.dispatch(x, idx, num_experts=e, axis_name="x", capacity=capacity)
        return r, sj.moe.combine(ey, lay, w)

    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))
    xs, idxs, ws, eys, crs, cys = map(put, (x, idx, w, ey, cr, cy))

    @jax.jit
    def fwd_and_grad(x, idx, w, ey, cr, cy):
        def loss(x, w, ey):
            r, yy = f(x, idx, w, ey)
            return (r * cr).sum() + (yy * cy).sum()

        return f(x, idx, w, ey), jax.grad(loss, argnums=(0, 1, 2))(x, w, ey)

    (got_recv, got_y), (gx, gw, gey) = fwd_and_grad(xs, idxs, ws, eys, crs, cys)
    tol = 2e-5 * k * 4
    tag = f"case {seed} (T={t}, H={h}, K={k}, C={capacity})"
    check(f"{tag} recv", got_recv, recv, 0.0)
    check(f"{tag} y", got_y, y, tol)
    check(f"{tag} d/dx", gx, dx, tol)
    check(f"{tag} d/dweights", gw, dw, tol)
    check(f"{tag} d/dexpert_y", gey, dey, tol)


def transforms_case(seed: int, t: int, h: int, capacity: int) -> None:
    """vmap (a batch of 2 routings) and jvp across processes against separate forward calls:
    the vmapped call must equal each element's own call bitwise, and the tangent equal the
    forward calls it is linear in (dispatch of tx; combine of (t_ey, w) plus (ey, t_w))."""
    rng = np.random.default_rng(seed)
    n, e, k, b = R * t, 2 * R, 2, 2
    idx = rng.integers(-1, e, (b, n, k)).astype(np.int32)
    x, tx = (rng.standard_normal((b, n, h)).astype(np.float32) for _ in range(2))
    w, tw = (rng.random((b, n, k)).astype(np.float32) for _ in range(2))
    ey, tey = (rng.standard_normal((b, e, capacity, h)).astype(np.float32) for _ in range(2))

    def body(x, idx, w, ey):
        r, lay = sj.moe.dispatch(x, idx, num_experts=e, axis_name="x", capacity=capacity)
        return r, sj.moe.combine(ey, lay, w)

    one = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec)))
    bspec = P(None, "x")
    batched = jax.jit(
        jax.shard_map(jax.vmap(body), mesh=mesh, in_specs=(bspec,) * 4, out_specs=(bspec, bspec))
    )

    def put_b(a):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, bspec), lambda i: a[i])

    def local(arr):
        return {sh.device.id: np.asarray(sh.data) for sh in arr.addressable_shards}

    def same(name, got: dict, want: dict, tol=0.0):
        for d, g in got.items():
            if g.shape != want[d].shape or not np.allclose(g, want[d], rtol=tol, atol=tol):
                print(f"MISMATCH {name} on device {d}", flush=True)
                sys.exit(3)

    got = batched(*map(put_b, (x, idx, w, ey)))
    for i in range(b):
        want = one(*map(put, (x[i], idx[i], w[i], ey[i])))
        for name, g, wv in zip(("vmap recv", "vmap y"), got, want, strict=True):
            same(f"{name} [{i}]", {d: v[i] for d, v in local(g).items()}, local(wv))

    jvp = jax.jit(
        lambda x, i, w, ey, tx, tw, tey: jax.jvp(
            lambda x, w, ey: one(x, i, w, ey), (x, w, ey), (tx, tw, tey)
        )[1]
    )
    args = [put(a[0]) for a in (x, idx, w, ey, tx, tw, tey)]
    t_recv, t_y = jvp(*args)
    xs, i0, ws, eys, txs, tws, teys = args
    same("jvp recv", local(t_recv), local(one(txs, i0, ws, eys)[0]))
    y1, y2 = one(xs, i0, ws, teys)[1], one(xs, i0, tws, eys)[1]
    want_y = {d: v + local(y2)[d] for d, v in local(y1).items()}
    same("jvp y", local(t_y), want_y, 1e-5)


case(1, t=7, h=5, k=3, experts_per_rank=2, capacity=None)  # small: staged buffers
case(2, t=9, h=6, k=2, experts_per_rank=3, capacity=2)  # capacity drops
# x past the threshold; capacity = every token up to 8 ranks, 128 rows beyond (the reference's
# global expert arrays grow with ranks x capacity: 32 ranks at full capacity were 1 GiB a
# process); beyond 32 ranks 16 tokens (70 KiB of x, still past the threshold) and 32 rows (64
# processes at 64 tokens and 128 rows held ~400 MiB each; the OOM killer ended the job)
big = R > 32
case(
    3,
    t=16 if big else 64,
    h=1100,
    k=2,
    experts_per_rank=1,
    capacity=None if R <= 8 else 32 if big else 128,
)
stats = sj.memory_stats()
stats = {k: stats[k] - stats0[k] for k in ("zero_copy_bytes", "staged_bytes")}
print(
    f"OK moe {checks} checks on {R} ranks, mode {info['registration']}, zero_copy_bytes "
    f"{stats['zero_copy_bytes']}, staged_bytes {stats['staged_bytes']}",
    flush=True,
)
if info["registration"] != "staging":
    # The large case's x and expert rows (> 256 KiB per rank) are pool memory: shared, never staged.
    assert stats["staged_bytes"] < 256 * 1024, stats
# After the staging check above (its small buffers are staged); a mismatch exits non-zero.
transforms_case(4, t=6, h=300, capacity=3)
