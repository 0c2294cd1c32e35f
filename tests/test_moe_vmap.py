"""jax.vmap of strata_jax.moe.dispatch/combine (and moe_mlp) against the numpy reference plan.

A batch of B routings must give, element by element, what B separate calls give: the same
slots, the same drops in (source rank, token) order, the same sums and the same gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import mesh1d, on_one_and_two_fabrics, rotation
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_reference import ref_plan
from test_moe import TOL, ref_forward

import strata_jax as sj

R, T, H, E, K, B = 4, 6, 8, 8, 2, 3
EL = E // R


def _inputs(seed, dtype, shared_routing=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, R * T, H)).astype(np.float32)
    # ids in [-1, E]: -1 and E are "no expert"; repeats within a token happen at K = 2
    idx = rng.integers(-1, E + 1, (1 if shared_routing else B, R * T, K)).astype(np.int32)
    idx = np.broadcast_to(idx, (B, R * T, K)).copy()
    w = rng.random((B, R * T, K)).astype(np.float32)
    ct = rng.standard_normal((B, R * T, H)).astype(np.float32)
    return jnp.asarray(x, dtype), idx, jnp.asarray(w), jnp.asarray(ct, dtype)


def _body(capacity):
    def body(x, idx, w):
        recv, lay = sj.moe.dispatch(x, idx, num_experts=E, axis_name="x", capacity=capacity)
        y = sj.moe.combine(2.0 * recv + 1.0, lay, w)
        return y, recv, lay.recv_counts, lay.recv_dropped, lay.dropped

    return body


def _ref(x, idx, w, capacity):
    """Element-wise reference: recv, y (of the expert 2 * row + 1), counts, dropped."""
    cap = R * T if capacity is None else capacity
    src, cidx, counts, dropped = ref_plan(idx, E, cap)

    def f(x, w):
        recv, _ = ref_forward(x, jnp.zeros((E, cap, H), x.dtype), w, src, cidx)
        # the expert maps the padding rows (zeros) to 1: combine never reads them
        ey = jnp.where((src >= 0)[:, :, None], 2.0 * recv + 1.0, 1.0)
        _, y = ref_forward(x, ey, w, src, cidx)
        return recv, y

    return f, counts, dropped


@pytest.mark.parametrize(
    "capacity,dtype,shared_routing",
    rotation([None, 3, 0], [["float32", "bfloat16"], [False, True]]),
)
def test_vmap_dispatch_combine(dtype, capacity, shared_routing):
    x, idx, w, ct = _inputs(7 + (capacity or 1), dtype, shared_routing)
    body = _body(capacity)
    idx_axis = None if shared_routing else 0

    def batched(x, idx, w, ct):
        # x batched on axis 1 here, to exercise moving the batch dimension
        fwd = jax.vmap(body, in_axes=(1, idx_axis, 0))
        y, recv, counts, rdrop, drop = fwd(jnp.swapaxes(x, 0, 1), idx, w)

        def loss(x, w):
            return jnp.sum(fwd(x, idx, w)[0].astype(jnp.float32) * ct.astype(jnp.float32))

        gx, gw = jax.grad(loss, argnums=(0, 1))(jnp.swapaxes(x, 0, 1), w)
        return y, recv, counts, rdrop, drop[:, None], jnp.swapaxes(gx, 0, 1), gw

    mesh = mesh1d(R)
    s1 = P(None, "x")
    f = jax.jit(
        jax.shard_map(
            lambda x, i, w, ct: batched(x, i[0] if shared_routing else i, w, ct),
            mesh=mesh,
            in_specs=(s1, s1, s1, s1),
            out_specs=(s1, s1, s1, s1, s1, s1, s1),
        )
    )
    put = lambda a: jax.device_put(a, NamedSharding(mesh, s1))  # noqa: E731
    y, recv, counts, rdrop, drop, gx, gw = f(put(x), put(idx), put(w), put(ct))
    tol = TOL[dtype]
    for b in range(B):
        fref, counts_r, dropped_r = _ref(x[b], idx[b], w[b], capacity)
        recv_r, y_r = fref(x[b], w[b])
        np.testing.assert_array_equal(np.asarray(counts[b]), counts_r)
        np.testing.assert_array_equal(np.asarray(rdrop[b]), dropped_r)
        np.testing.assert_array_equal(
            np.asarray(drop[b]), dropped_r.reshape(R, EL).sum(1, dtype=np.int32)
        )
        np.testing.assert_allclose(
            np.asarray(recv[b], np.float64).reshape(recv_r.shape), recv_r, rtol=tol, atol=tol
        )
        np.testing.assert_allclose(np.asarray(y[b], np.float64), y_r, rtol=tol, atol=tol * 4)

        def loss_r(xb, wb, b=b, fref=fref):
            return jnp.sum(fref(xb, wb)[1] * ct[b].astype(jnp.float32))

        gx_r, gw_r = jax.grad(loss_r, argnums=(0, 1))(x[b].astype(jnp.float32), w[b])
        scale = float(np.abs(gx_r).max()) + 1
        np.testing.assert_allclose(np.asarray(gx[b], np.float64), gx_r, rtol=tol, atol=tol * scale)
        np.testing.assert_allclose(np.asarray(gw[b], np.float64), gw_r, rtol=tol, atol=tol * scale)


def test_vmap_moe_mlp_matches_reference_impl():
    rng = np.random.default_rng(3)
    f_dim = 16
    x = rng.standard_normal((B, R * T, H)).astype(np.float32)
    router = rng.standard_normal((H, E)).astype(np.float32)
    w1 = (rng.standard_normal((E, H, f_dim)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((E, f_dim, H)) / 4).astype(np.float32)

    def run(impl):
        def layer(x, r, w1, w2):
            return sj.moe.moe_mlp(
                x, r, w1, w2, num_experts=E, top_k=K, axis_name="x", capacity=5, impl=impl
            )

        def body(x, r, w1, w2):
            y = jax.vmap(layer, in_axes=(0, None, None, None))(x, r, w1, w2)
            g = jax.grad(lambda w1: jnp.sum(jax.vmap(layer, (0, None, None, None))(x, r, w1, w2)))
            return y, g(w1)

        f = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh1d(R),
                in_specs=(P(None, "x"), P(), P("x"), P("x")),
                out_specs=(P(None, "x"), P("x")),
            )
        )
        return [np.asarray(v) for v in f(x, router, w1, w2)]

    y_s, g_s = run("strata")
    y_r, g_r = run("reference")
    np.testing.assert_allclose(y_s, y_r, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(g_s, g_r, rtol=2e-4, atol=2e-4)


def test_vmap_low_latency_says_what_to_do():
    x = jnp.zeros((B, R * 2, H), jnp.float32)
    idx = jnp.zeros((B, R * 2, K), jnp.int32)

    def body(x, idx):
        recv, _, _ = sj.moe.low_latency_dispatch(x, idx, num_experts=E, axis_name="x")
        return recv

    f = jax.jit(
        jax.shard_map(
            jax.vmap(body), mesh=mesh1d(R), in_specs=(P(None, "x"),) * 2, out_specs=P(None, "x")
        )
    )
    with pytest.raises(NotImplementedError, match="fold the batch into the tokens"):
        f(x, idx)


def test_vmap_across_fake_fabrics(monkeypatch):
    """The folded routing through the hierarchical lowering (an expert axis spanning two
    fabrics) equals the single-fabric result, forward and gradients."""
    from jax.sharding import Mesh

    x, idx, w, ct = _inputs(11, "float32")
    devs = sorted(jax.devices(), key=lambda d: d.id)[:R]
    mesh = Mesh(np.array([devs[i] for i in (0, 2, 1, 3)]), ("x",))  # fabrics interleaved
    body = _body(3)

    def batched(x, idx, w, ct):
        def loss(x, w):
            return jnp.sum(jax.vmap(body)(x, idx, w)[0] * ct)

        y, recv = jax.vmap(body)(x, idx, w)[:2]
        return (y, recv, *jax.grad(loss, argnums=(0, 1))(x, w))

    s1 = P(None, "x")

    def run():
        f = jax.jit(jax.shard_map(batched, mesh=mesh, in_specs=(s1,) * 4, out_specs=(s1,) * 4))
        return [np.asarray(v) for v in f(x, idx, w, ct)]

    want, got = on_one_and_two_fabrics(run, monkeypatch)
    for name, a, b in zip(["y", "recv", "dx", "dw"], got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("shape", [(2, 0, K), (2, H, 0), (0, H, K)])  # H = 0, K = 0, B = 0
def test_vmap_empty_dimensions(shape):
    """vmap keeps the zero-size cases that work without it (a review found reshape(-1, 0))."""
    b, h, k = shape
    x = jnp.ones((b, R * T, h), jnp.float32)
    idx = jnp.zeros((b, R * T, k), jnp.int32)
    w = jnp.ones((b, R * T, k), jnp.float32)

    def layer(x, i, w):
        r, lay = sj.moe.dispatch(x, i, num_experts=E, axis_name="x", capacity=2)
        return sj.moe.combine(r, lay, w), r

    def body(x, i, w):
        y, r = jax.vmap(layer)(x, i, w)
        g = jax.grad(lambda x: jnp.sum(jax.vmap(layer)(x, i, w)[0]))(x)
        return y, r, g

    s1 = P(None, "x")
    f = jax.jit(jax.shard_map(body, mesh=mesh1d(R), in_specs=(s1,) * 3, out_specs=(s1,) * 3))
    y, r, g = f(x, idx, w)
    assert y.shape == (b, R * T, h) and g.shape == (b, R * T, h)
    assert r.shape == (b, E, 2, h)
    if b and h and k:  # pragma: no cover (every case has a zero)
        raise AssertionError
    assert not np.asarray(y).any()


def test_vmap_axis_name_as_expert_axis_is_refused():
    def body(x, i):
        return jax.vmap(
            lambda x, i: sj.moe.dispatch(x, i, num_experts=4, axis_name="v")[0], axis_name="v"
        )(x, i)

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh1d(R), in_specs=(P(None, "x"),) * 2, out_specs=P(), check_vma=False
        )
    )
    with pytest.raises(NotImplementedError, match="bound by jax.vmap"):
        f(jnp.ones((4, R * 2, H)), jnp.zeros((4, R * 2, K), jnp.int32))
