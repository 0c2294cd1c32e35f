"""MoE dispatch/combine on unusual routings, values asserted against numpy: no tokens anywhere,
an expert rank that receives nothing (across processes too), drops that leave no garbage behind
(rows past the counts exactly zero, nothing of an earlier NaN call left), and an expert axis of
size one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mp_util import launch
from _util import mesh1d
from jax.sharding import PartitionSpec as P

import strata_jax as sj

X = P("x")


def smap(body, n, in_specs=X, out_specs=X, check_vma=True):
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh1d(n), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    )


# MoE: no tokens anywhere ----------------------------------------------------------------
def _moe(n, num_experts, capacity, expert=lambda r: 3.0 * r):
    def body(x, idx, w):
        recv, lay = sj.moe.dispatch(
            x, idx, num_experts=num_experts, axis_name="x", capacity=capacity
        )
        return recv, lay.recv_counts, lay.recv_dropped, sj.moe.combine(expert(recv), lay, w)

    return smap(body, n, in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 4)


def test_moe_with_no_tokens_anywhere(rng):
    f = _moe(2, 4, 4)
    x = jnp.zeros((0, 16), jnp.float32)
    recv, counts, _, y = f(x, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), jnp.float32))
    assert recv.shape == (2 * 2, 4, 16) and not np.asarray(recv).any()
    np.testing.assert_array_equal(np.asarray(counts), [0, 0, 0, 0])
    assert y.shape == (0, 16) and y.dtype == jnp.float32
    # T = 3 per rank; all of rank 0's ids are -1: rank 0's y is zeros
    x = rng.standard_normal((6, 16)).astype(np.float32)
    idx = rng.integers(0, 4, (6, 2)).astype(np.int32)
    idx[:3] = -1
    w = rng.random((6, 2)).astype(np.float32)
    _, _, _, y = f(x, idx, w)
    y = np.asarray(y)
    np.testing.assert_array_equal(y[:3], 0.0)
    np.testing.assert_allclose(y[3:], 3.0 * x[3:] * w[3:].sum(1, keepdims=True), rtol=1e-5)


# An expert rank that receives nothing, across processes -----------------------------
def test_moe_idle_expert_rank_across_processes():
    r, dt = launch(2, "moe_idle_expert.py")
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.count("OK moe-idle 3 checks") == 2, r.stdout[-2000:]
    assert dt < 60, f"took {dt:.0f} s"


# Drops leave no garbage -----------------------------------------------------------------
def test_moe_drops_leave_no_garbage(rng):
    f = _moe(2, 2, 2)
    idx = np.zeros((8, 1), np.int32)
    w = np.ones((8, 1), np.float32)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    recv, counts, rdrop, y = (np.asarray(a) for a in f(x, idx, w))
    np.testing.assert_array_equal(counts, [2, 0])
    np.testing.assert_array_equal(rdrop, [6, 0])
    np.testing.assert_array_equal(recv[0], x[:2])  # rows (source rank, token) order
    np.testing.assert_array_equal(recv[1], 0.0)  # rank 1's expert: every row past count 0
    np.testing.assert_allclose(y[:2], 3.0 * x[:2], rtol=1e-6)
    np.testing.assert_array_equal(y[2:], 0.0)  # dropped tokens: exactly 0
    # A NaN call, then a finite one: nothing of the NaN call is left anywhere
    xn = np.full_like(x, np.nan)
    assert np.isnan(np.asarray(f(xn, idx, w)[3])[:2]).all()
    for a in f(x, idx, w):
        assert not np.isnan(np.asarray(a, np.float64)).any()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_moe_large_rows_leave_no_garbage(rng, dtype):
    """Drops with rows of 2-4 KiB: the unused capacity rows (hundreds of KiB per expert) are
    zeroed and combine's rows stored with non-temporal stores; after a NaN call in the same
    buffers nothing of it is left, and every value equals numpy's."""
    h, c = 1024, 96
    f = _moe(2, 4, c)
    idx = rng.integers(0, 4, (16, 2)).astype(np.int32)
    idx[3] = [1, 1]  # a token naming one expert twice: one slot, the weights add
    w = rng.random((16, 2)).astype(np.float32)
    x = rng.standard_normal((16, h)).astype(dtype)
    # First a NaN call that fills more rows of experts 0 and 2 than the next call will
    xn = np.full_like(x, np.nan)
    idx_n = np.tile(np.array([[0, 2]], np.int32), (16, 1))
    assert np.isnan(np.asarray(f(xn, idx_n, w)[0], np.float32)).any()
    recv, counts, rdrop, y = f(x, idx, w)
    recv, y = np.asarray(recv, np.float32), np.asarray(y, np.float32)
    counts = np.asarray(counts)
    np.testing.assert_array_equal(np.asarray(rdrop), 0)
    for e in range(4):  # rows of expert e: [0, count) hold tokens, the rest exactly 0
        assert recv[e, counts[e] :].size and not recv[e, counts[e] :].any(), e
        assert not np.isnan(recv[e, : counts[e]]).any()
    xf = x.astype(np.float32)
    want = 3.0 * xf * w.sum(1, keepdims=True)  # every choice kept: the weights add up
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(y, want.astype(dtype).astype(np.float32), rtol=tol, atol=tol)


# Expert-parallel axis of size 1 ----------------------------------------------------
def test_moe_expert_axis_of_size_one(rng):
    t, k, e, c, h = 5, 2, 4, 10, 3
    scale = np.array([2.0, 3.0, 5.0, 7.0], np.float32)
    f = _moe(1, e, c, expert=lambda r: r * jnp.asarray(scale)[:, None, None])
    x = rng.standard_normal((t, h)).astype(np.float32)
    idx = rng.integers(0, e, (t, k)).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    recv, counts, _, y = f(x, idx, w)
    assert recv.shape == (e, c, h)
    want = np.zeros((t, h), np.float32)
    for i in range(t):
        for j in range(k):  # y = sum_k w_k f_{e_k}(x); a repeated expert: weights add
            want[i] += w[i, j] * scale[idx[i, j]] * x[i]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(counts), [len({i for i in range(t) if ex in idx[i]}) for ex in range(e)]
    )
