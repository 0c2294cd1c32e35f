"""strata_jax.moe dispatch/combine against a dense single-device reference.

The reference plan is a plain numpy loop over tokens and experts (global token order
(source rank, token), a token naming an expert twice counted once, pairs past the capacity
dropped); the reference data movement is dense jnp gathers through that plan, so gradients of
the reference come from jax.grad. At the end: empty ranks and no tokens, weights applied once, two
dispatches in flight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import mesh1d, rotation
from jax.sharding import PartitionSpec as P
from moe_reference import ref_plan

import strata_jax as sj

TOL = {"float32": 2e-5, "float64": 1e-12, "bfloat16": 3e-2, "float16": 4e-3}


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def ref_forward(x, ey, w, src, cidx):
    """Dense reference: recv [E, C, H] = x rows through src; y [N, H] = weighted rows of ey."""
    h = x.shape[1]
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xp = jnp.concatenate([x.astype(acc), jnp.zeros((1, h), acc)])
    recv = xp[np.where(src < 0, x.shape[0], src)]
    eyf = ey.reshape(-1, h).astype(acc)
    eyp = jnp.concatenate([eyf, jnp.zeros((1, h), acc)])
    rows = eyp[np.where(cidx < 0, eyf.shape[0], cidx)]  # [N, K, H]
    wm = jnp.where(cidx >= 0, w.astype(acc), 0.0)
    return recv, jnp.einsum("nk,nkh->nh", wm, rows)


# --------------------------------------------------------------------------------------
# Running strata under shard_map
# --------------------------------------------------------------------------------------


def strata_fn(n, num_experts, capacity, check_vma=True):
    def body(x, idx, w, ey):
        recv, lay = sj.moe.dispatch(
            x, idx, num_experts=num_experts, axis_name="x", capacity=capacity
        )
        y = sj.moe.combine(ey, lay, w)
        return recv, y, lay.recv_counts, lay.dropped[None], lay.recv_dropped

    spec = P("x")
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh1d(n), in_specs=(spec,) * 4, out_specs=(spec,) * 5, check_vma=check_vma
        )
    )


def check(
    rng, n, t, h, num_experts, k, capacity, dtype, idx=None, w=None, check_vma=True, grads=True
):
    """Runs dispatch + combine (and their gradients) and compares with the reference."""
    dt = jnp.dtype(dtype)
    if idx is None:
        idx = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    if w is None:
        w = rng.random((n * t, k)).astype(np.float32)
    cap = capacity if capacity is not None else n * t
    x = jnp.asarray(rng.standard_normal((n * t, h)), dt)
    ey = jnp.asarray(rng.standard_normal((num_experts, cap, h)), dt)
    wj = jnp.asarray(w, dt)
    src, cidx, counts, dropped = ref_plan(idx, num_experts, cap)

    f = strata_fn(n, num_experts, capacity, check_vma)
    recv, y, got_counts, got_dropped, got_rdrop = f(x, idx, wj, ey)
    assert recv.dtype == dt and y.dtype == dt
    assert recv.shape == (num_experts, cap, h) and y.shape == (n * t, h)
    r_recv, r_y = ref_forward(x, ey, wj, src, cidx)
    np.testing.assert_array_equal(np.asarray(recv, np.float64), np.asarray(r_recv))
    tol = TOL[str(dt)] * k
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(r_y), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got_counts), counts)
    np.testing.assert_array_equal(np.asarray(got_rdrop), dropped)
    np.testing.assert_array_equal(np.asarray(got_dropped), dropped.reshape(n, -1).sum(1))
    if not grads:
        return
    acc = jnp.float64 if dt == jnp.float64 else jnp.float32
    cr = jnp.asarray(rng.standard_normal(recv.shape), acc)
    cy = jnp.asarray(rng.standard_normal(y.shape), acc)

    def loss(fwd):
        def run(x, ey, wj):
            a, b = fwd(x, ey, wj)
            return (a.astype(cr.dtype) * cr).sum() + (b.astype(cr.dtype) * cy).sum()

        return jax.grad(run, argnums=(0, 1, 2))(x, ey, wj)

    got = loss(lambda x, ey, wj: f(x, idx, wj, ey)[:2])
    want = loss(lambda x, ey, wj: ref_forward(x, ey, wj, src, cidx))
    for name, a, b in zip(("x", "expert_y", "weights"), got, want, strict=True):
        assert a.dtype == b.dtype == dt, name
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            np.asarray(b, np.float64),
            rtol=tol * 4,
            atol=tol * 4,
            err_msg=f"d/d{name}",
        )


# --------------------------------------------------------------------------------------
# Routing patterns, dtypes, group sizes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,check_vma", rotation([8, 4], [[True, False]]))
def test_random_routing(rng, n, check_vma):
    check(
        rng,
        n,
        t=7,
        h=5,
        num_experts=2 * n,
        k=3,
        capacity=None,
        dtype="float32",
        check_vma=check_vma,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_dtypes(rng, dtype):
    check(rng, 4, t=6, h=9, num_experts=8, k=2, capacity=None, dtype=dtype)


def test_skewed_routing_with_capacity_drops(rng):
    n, t, k, num_experts = 8, 9, 2, 16
    idx = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    idx[rng.random(n * t) < 0.7, 0] = 0  # expert 0 (rank 0) is hot
    idx[::3, 1] = 5
    check(rng, n, t, h=4, num_experts=num_experts, k=k, capacity=5, dtype="float32", idx=idx)


def test_duplicates_and_minus_one(rng):
    n, t, k, num_experts = 4, 5, 4, 8
    idx = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    idx[0] = [3, 3, 3, -1]  # one expert three times
    idx[1] = [-1, -1, -1, -1]  # no expert at all
    idx[2] = [2, 3, 2, 3]  # two experts of one rank, each twice
    idx[3] = [0, 7, 99, -5]  # out-of-range ids mean "no expert"
    check(rng, n, t, h=3, num_experts=num_experts, k=k, capacity=3, dtype="float32", idx=idx)


def test_odd_sizes_many_experts(rng):
    # T, H, K not divisible by anything; 3 experts per rank; capacity smaller than T.
    check(rng, 8, t=11, h=13, num_experts=24, k=5, capacity=7, dtype="float32")


@pytest.mark.parametrize(
    "h,dtype",
    [
        (1, "bfloat16"),
        (3, "float16"),
        (17, "float32"),
        pytest.param(1, "float32", marks=pytest.mark.slow),
        pytest.param(5, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_rows_shorter_than_a_cache_line(rng, h, dtype):
    """Rows of 2-68 bytes at unaligned slots: dispatch writes every row with streaming stores
    (native/coll/kernels.cc copy_bytes_stream), which once ran past rows under 16 bytes and
    crashed the process (found by a new-user review)."""
    check(rng, 8, 6, h=h, num_experts=8, k=2, capacity=None, dtype=dtype)


def test_layout_counts_and_dispatch_layout(rng):
    n, t, k, num_experts = 4, 10, 3, 8
    idx = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    idx[0] = [5, 5, 1]

    def body(i):
        per_rank, per_expert, in_rank = sj.moe.dispatch_layout(i, num_experts, "x")
        return per_rank[None], per_expert[None], in_rank

    f = jax.jit(
        jax.shard_map(body, mesh=mesh1d(n), in_specs=P("x"), out_specs=(P("x"), P("x"), P("x")))
    )
    per_rank, per_expert, in_rank = (np.asarray(a) for a in f(idx))
    el = num_experts // n
    for s in range(n):
        mine = idx[s * t : (s + 1) * t]
        want_in = np.array(
            [
                [any(0 <= e < num_experts and e // el == r for e in row) for r in range(n)]
                for row in mine
            ]
        )
        np.testing.assert_array_equal(in_rank[s * t : (s + 1) * t], want_in)
        np.testing.assert_array_equal(per_rank[s], want_in.sum(0))
        want_e = np.array([sum(e in set(row.tolist()) for row in mine) for e in range(num_experts)])
        np.testing.assert_array_equal(per_expert[s], want_e)
    assert per_rank.dtype == np.int32 and per_expert.dtype == np.int32


def test_errors():
    x = jnp.zeros((8 * 4, 6), jnp.float32)
    idx = jnp.zeros((8 * 4, 2), jnp.int32)

    def run(body, *args):
        f = jax.shard_map(body, mesh=mesh1d(8), in_specs=(P("x"),) * len(args), out_specs=P("x"))
        return jax.jit(f).lower(*args)

    with pytest.raises(ValueError, match="not divisible"):
        run(lambda a, b: sj.moe.dispatch(a, b, num_experts=12, axis_name="x")[0], x, idx)
    with pytest.raises(ValueError, match="x must be a float"):
        run(
            lambda a, b: sj.moe.dispatch(a.astype(jnp.int32), b, num_experts=8, axis_name="x")[0],
            x,
            idx,
        )
    with pytest.raises(ValueError, match="tokens"):
        run(lambda a, b: sj.moe.dispatch(a[:2], b, num_experts=8, axis_name="x")[0], x, idx)
    with pytest.raises(ValueError, match="topk_idx"):
        run(lambda a, b: sj.moe.dispatch(a, b[:, 0], num_experts=8, axis_name="x")[0], x, idx)
    with pytest.raises(ValueError, match="capacity"):
        run(
            lambda a, b: sj.moe.dispatch(a, b, num_experts=8, axis_name="x", capacity=-1)[0], x, idx
        )

    def bad_combine(a, b):
        r, lay = sj.moe.dispatch(a, b, num_experts=8, axis_name="x", capacity=4)
        return sj.moe.combine(r[:, :3], lay, jnp.ones(b.shape, jnp.float32))

    with pytest.raises(ValueError, match="expert_y must have shape"):
        run(bad_combine, x, idx)

    def bad_weights(a, b):
        r, lay = sj.moe.dispatch(a, b, num_experts=8, axis_name="x", capacity=4)
        return sj.moe.combine(r, lay, jnp.ones((b.shape[0], 3), jnp.float32))

    with pytest.raises(ValueError, match="topk_weights"):
        run(bad_weights, x, idx)


# --------------------------------------------------------------------------------------
# Empty ranks, weights applied once, two dispatches in flight
# --------------------------------------------------------------------------------------


def test_empty_source_and_destination_ranks(rng):
    """Rank 2 has no tokens, nobody routes to rank 3; everything completes, backward too.

    shard_map needs equal per-rank shapes, so "rank 2 has zero tokens" is emulated the way a
    padded batch does it: rank 2's tokens all route to -1 (it sends nothing, its combine
    output is all zero and its gradients are zero). The literal shape-(0, H) case, where
    *every* rank has T = 0, is run in test_14_zero_tokens_everywhere.
    """
    n, t, k, num_experts = 4, 6, 2, 8
    el = num_experts // n
    idx = rng.integers(0, 3 * el, (n * t, k)).astype(np.int32)  # ranks 0..2 only
    idx[2 * t : 3 * t] = -1  # rank 2 sends nothing
    check(rng, n, t, h=5, num_experts=num_experts, k=k, capacity=None, dtype="float32", idx=idx)
    src, _, counts, _ = ref_plan(idx, num_experts, n * t)
    assert counts[3 * el :].sum() == 0  # rank 3 receives zero rows


def test_zero_tokens_everywhere():
    n, h, k, num_experts = 4, 5, 2, 8
    x = jnp.zeros((0, h), jnp.float32)
    idx = jnp.zeros((0, k), jnp.int32)
    w = jnp.zeros((0, k), jnp.float32)
    for cap in (None, 3):
        c = 0 if cap is None else cap
        ey = jnp.ones((num_experts, c, h), jnp.float32)
        f = strata_fn(n, num_experts, cap)
        recv, y, counts, dropped, _ = f(x, idx, w, ey)
        assert recv.shape == (num_experts, c, h) and y.shape == (0, h)
        assert not np.asarray(recv).any() and not np.asarray(counts).any()
        g = jax.grad(lambda ey, f=f: f(x, idx, w, ey)[0].sum() + f(x, idx, w, ey)[1].sum())(ey)
        assert g.shape == ey.shape and not np.asarray(g).any()


def test_weights_applied_exactly_once():
    """One token per rank; expert e computes c_e * x."""
    n, num_experts = 2, 4  # experts 0, 1 on rank 0; 2, 3 on rank 1
    c = np.array([2.0, 3.0, 5.0, 7.0], np.float32)
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)

    def run(idx, w):
        def body(x, i, w):
            recv, lay = sj.moe.dispatch(x, i, num_experts=num_experts, axis_name="x")
            ce = jnp.asarray(c).reshape(n, -1)[jax.lax.axis_index("x")]
            return sj.moe.combine(recv * ce[:, None, None], lay, w)

        f = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=P("x"), out_specs=P("x")))
        return np.asarray(f(x, np.asarray(idx, np.int32), np.asarray(w, np.float32)))

    # different ranks
    y = run([[1, 2], [1, 2]], [[0.3, 0.7], [0.3, 0.7]])
    np.testing.assert_allclose(y, (0.3 * c[1] + 0.7 * c[2]) * x, rtol=1e-6)
    # the same expert twice: (w1 + w2) * c_e * x
    y = run([[2, 2], [0, 0]], [[0.3, 0.7], [0.25, 0.5]])
    np.testing.assert_allclose(y[0], 1.0 * c[2] * x[0], rtol=1e-6)
    np.testing.assert_allclose(y[1], 0.75 * c[0] * x[1], rtol=1e-6)
    # a -1 slot contributes nothing; all -1 gives zeros
    y = run([[-1, 3], [-1, -1]], [[0.3, 0.7], [0.3, 0.7]])
    np.testing.assert_allclose(y[0], 0.7 * c[3] * x[0], rtol=1e-6)
    np.testing.assert_array_equal(y[1], 0.0)


def test_two_dispatches_in_flight(rng):
    n, t, h, k, num_experts = 4, 5, 3, 2, 8
    x = jnp.asarray(rng.standard_normal((n * t, h)), jnp.float32)
    ia = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    ib = rng.integers(-1, num_experts, (n * t, k)).astype(np.int32)
    w = jnp.asarray(rng.random((n * t, k)), jnp.float32)

    def expert(r):
        return r * 2.0 + 1.0  # row-wise, so unused (zero) rows do not matter to combine

    def interleaved(x, ia, ib, w):
        ra, la = sj.moe.dispatch(x, ia, num_experts=num_experts, axis_name="x")
        rb, lb = sj.moe.dispatch(x * 3.0, ib, num_experts=num_experts, axis_name="x")
        ya = sj.moe.combine(expert(ra), la, w)
        yb = sj.moe.combine(expert(rb), lb, w)
        return ya, yb

    def sequential(x, ia, ib, w):
        ra, la = sj.moe.dispatch(x, ia, num_experts=num_experts, axis_name="x")
        ya = sj.moe.combine(expert(ra), la, w)
        rb, lb = sj.moe.dispatch(x * 3.0, ib, num_experts=num_experts, axis_name="x")
        yb = sj.moe.combine(expert(rb), lb, w)
        return ya, yb

    def run(body):
        f = jax.jit(
            jax.shard_map(body, mesh=mesh1d(n), in_specs=(P("x"),) * 4, out_specs=(P("x"), P("x")))
        )
        out = f(x, ia, ib, w)
        g = jax.grad(lambda x, w: sum(o.sum() for o in f(x, ia, ib, w)), (0, 1))(x, w)
        return [np.asarray(v) for v in (*out, *g)]

    got, want = run(interleaved), run(sequential)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    # and against the dense reference
    for idx, scale, y in ((ia, 1.0, got[0]), (ib, 3.0, got[1])):
        src, cidx, _, _ = ref_plan(idx, num_experts, n * t)
        ey = expert(
            ref_forward(x * scale, jnp.zeros((num_experts, n * t, h)), w, src, cidx)[0]
        ).reshape(num_experts, n * t, h)
        np.testing.assert_allclose(y, ref_forward(x, ey, w, src, cidx)[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_rows_from_peers_are_counted(rng, mode):
    """memory_stats() counts the MoE rows read from other ranks (intra_fabric_bytes; they were
    not counted at all): dispatch reads each token's row once per other destination rank,
    combine each kept choice's row held by another rank. H and 2H with the same routing differ
    by exactly those rows (everything else, e.g. the ids' all_gather, is the same in both)."""
    n, t, e, k = 4, 6, 8, 3
    cap = 5 if mode == "normal" else n * t  # low latency: nothing dropped
    idx = rng.integers(-1, e, (n * t, k)).astype(np.int32)
    idx[0] = [1, 1, 6]
    _, cidx, _, _ = ref_plan(idx, e, cap)
    owner = np.where(cidx >= 0, cidx // cap // (e // n), -1)  # rank of each kept choice
    src = np.arange(n * t) // t
    disp_rows = sum(len({int(o) for o in owner[g] if o >= 0} - {int(src[g])}) for g in range(n * t))
    comb_rows = int(((owner >= 0) & (owner != src[:, None])).sum())

    def body(x, idx, w):
        if mode == "normal":
            recv, lay = sj.moe.dispatch(x, idx, num_experts=e, axis_name="x", capacity=cap)
            return sj.moe.combine(recv * 2.0, lay, w)
        recv, _, handle = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        return sj.moe.low_latency_combine(recv * 2.0, handle, w)

    f = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=(P("x"),) * 3, out_specs=P("x")))

    def moved(h):
        x = jnp.asarray(rng.standard_normal((n * t, h)), jnp.float32)
        w = jnp.asarray(rng.random((n * t, k)), jnp.float32)
        jax.block_until_ready(f(x, idx, w))  # compile and warm up
        before = sj.memory_stats()["intra_fabric_bytes"]
        jax.block_until_ready(f(x, idx, w))
        return sj.memory_stats()["intra_fabric_bytes"] - before

    h = 16
    assert moved(2 * h) - moved(h) == (disp_rows + comb_rows) * h * 4
