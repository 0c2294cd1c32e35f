"""The patterns of JAX's shard_map tutorial, written here in our own words and run unchanged
under use_for_jax_lax(): collective matmul over ppermute, FSDP, FSDP + tensor parallelism and a
pipeline over ppermute. Each loss and gradient is bitwise what jax.lax gives, and no XLA
collective is left inside any shard_map (the lowered program holds strata's calls only, and
coverage() records nothing on XLA). 4 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj

XLA_COLLECTIVES = (
    "stablehlo.all_reduce",
    "stablehlo.all_gather",
    "stablehlo.reduce_scatter",
    "stablehlo.all_to_all",
    "stablehlo.collective_permute",
    "stablehlo.collective_broadcast",
)


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _run_both(f, *args):
    """(value and gradient on jax.lax, the same on strata); checks that the strata program
    keeps no XLA collective."""
    g = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))
    want = g(*args)
    with sj.use_for_jax_lax():
        text = g.lower(*args).as_text()
        got = g(*args)
    rec = sj.coverage()[-1]
    assert rec.on_xla == 0 and rec.on_strata > 0, str(rec)
    for op in XLA_COLLECTIVES:
        assert op not in text, op
    assert "@strata_" in text
    return want, got


def _assert_bitwise(want, got):
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _randn(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def test_collective_matmul_over_ppermute(rng):
    """all_gather(lhs) @ rhs without the gather: each device multiplies the lhs block it holds
    and passes it to its neighbour, n times (the overlap of communication and compute)."""
    n = 4
    mesh = _mesh((n,), ("x",))

    @jax.shard_map(mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"))
    def matmul(lhs, rhs):  # lhs [m/n, k], rhs [k, p/n] -> [m, p/n]
        i = jax.lax.axis_index("x")
        rows = lhs.shape[0]
        out = jnp.zeros((rows * n, rhs.shape[1]), lhs.dtype)
        block = lhs
        for j in range(n):
            held = (i + j) % n  # which device's lhs block this one holds now
            out = jax.lax.dynamic_update_slice_in_dim(out, block @ rhs, held * rows, 0)
            block = jax.lax.ppermute(block, "x", [(d, (d - 1) % n) for d in range(n)])
        return out

    def loss(lhs, rhs):
        return jnp.sum(jnp.tanh(matmul(lhs, rhs)))

    lhs, rhs = _randn(rng, 8, 6), _randn(rng, 6, 8)
    want, got = _run_both(loss, lhs, rhs)
    _assert_bitwise(want, got)
    np.testing.assert_allclose(
        jax.jit(matmul)(lhs, rhs), np.asarray(lhs) @ np.asarray(rhs), rtol=1e-5, atol=1e-5
    )


def _mlp_params(rng, widths):
    return [
        (_randn(rng, a, b) * 0.5, _randn(rng, b) * 0.1)
        for a, b in zip(widths, widths[1:], strict=False)
    ]


def test_fsdp(rng):
    """Fully sharded data parallel: each layer's weights sharded over the data axis, gathered
    just before use (their gradient: psum_scatter, the transpose JAX emits)."""
    mesh = _mesh((4,), ("data",))
    params = _mlp_params(rng, [8, 16, 16, 4])
    x, y = _randn(rng, 16, 8), _randn(rng, 16, 4)

    @jax.shard_map(mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=P())
    def loss(params, x, y):
        h = x
        for k, (w, b) in enumerate(params):
            w = jax.lax.all_gather(w, "data", tiled=True)
            b = jax.lax.all_gather(b, "data", tiled=True)
            h = h @ w + b
            h = jnp.tanh(h) if k < len(params) - 1 else h
        return jax.lax.pmean(jnp.mean((h - y) ** 2), "data")

    want, got = _run_both(loss, params, x, y)
    _assert_bitwise(want, got)


def _fsdp_tp_loss():
    mesh = _mesh((2, 2), ("batch", "feats"))

    @jax.shard_map(
        mesh=mesh,
        in_specs=(
            P("batch", "feats"),
            P(("feats", "batch"), None),
            P("batch", None),
            P("batch", None),
        ),
        out_specs=P(),
    )
    def loss(w1, w2, x, y):  # w1 [d, h] over (batch, feats); w2 [h, d] rows over (feats, batch)
        w1 = jax.lax.all_gather(w1, "batch", tiled=True)  # [d, h/2]: the feats shard
        w2 = jax.lax.all_gather(w2, "batch", tiled=True)  # [h/2, d]: the feats shard
        h = jnp.tanh(x @ w1)  # [b/2, h/2]
        out = jax.lax.psum(h @ w2, "feats")  # [b/2, d]: the row-parallel sum
        return jax.lax.pmean(jnp.mean((out - y) ** 2), "batch")

    return loss


def _fsdp_tp_args(rng):
    return _randn(rng, 8, 8) * 0.5, _randn(rng, 8, 8) * 0.5, _randn(rng, 8, 8), _randn(rng, 8, 8)


def test_fsdp_with_tensor_parallelism(rng):
    """FSDP over "batch" and tensor (Megatron) parallelism over "feats" on a 2x2 mesh: weights
    sharded over both axes, gathered over "batch" along their first dimension, the second
    matmul summed over "feats"."""
    want, got = _run_both(_fsdp_tp_loss(), *_fsdp_tp_args(rng))
    _assert_bitwise(want, got)


def _fsdp_tp_scatter_loss():
    mesh = _mesh((2, 2), ("batch", "feats"))

    @jax.shard_map(
        mesh=mesh,
        in_specs=(P("batch", "feats"), P("feats", "batch"), P("batch", None), P("batch", None)),
        out_specs=P(),
    )
    def loss(w1, w2, x, y):
        w1 = jax.lax.all_gather(w1, "batch", tiled=True)
        w2 = jax.lax.all_gather(w2, "batch", axis=1, tiled=True)
        h = jnp.tanh(x @ w1)
        # The row-parallel sum left scattered over the features (sequence parallelism style).
        out = jax.lax.psum_scatter(h @ w2, "feats", scatter_dimension=1, tiled=True)
        ys = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("feats") * 4, 4, 1)
        return jax.lax.pmean(jnp.mean((out - ys) ** 2), ("batch", "feats"))

    return loss


def test_fsdp_with_tensor_parallelism_tutorial_layout(rng):
    """The tutorial's layout: w2 gathered along dimension 1 and the second matmul's sum
    scattered over the features (psum_scatter over dimension 1, and the gather's gradient is
    one too), both next to dots: bitwise (strata's calls work in place over any dimension)."""
    want, got = _run_both(_fsdp_tp_scatter_loss(), *_fsdp_tp_args(rng))
    _assert_bitwise(want, got)


def test_pipeline_over_ppermute(rng):
    """A 4-stage pipeline: stage s holds layer s; microbatches enter at stage 0, every step each
    stage applies its layer and hands its activation to the next stage (ppermute), the last
    stage's outputs are collected; loss and gradients through the whole schedule."""
    stages, micro, width = 4, 3, 6
    mesh = _mesh((stages,), ("stage",))
    ws = _randn(rng, stages, width, width) * 0.5
    xs = _randn(rng, micro, 2, width)

    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P()), out_specs=P())
    def loss(w, xs):
        w = w[0]
        s = jax.lax.axis_index("stage")
        act = jnp.zeros(xs.shape[1:], xs.dtype)
        outs = []
        for t in range(micro + stages - 1):
            inject = xs[min(t, micro - 1)] if t < micro else jnp.zeros_like(act)
            act = jnp.where(s == 0, inject, act)
            act = jnp.tanh(act @ w)
            if t >= stages - 1:
                outs.append(jnp.where(s == stages - 1, act, 0.0))
            act = jax.lax.ppermute(act, "stage", [(d, (d + 1) % stages) for d in range(stages)])
        out = jax.lax.psum(jnp.stack(outs), "stage")  # the last stage's outputs, everywhere
        return jnp.sum(out**2)

    want, got = _run_both(loss, ws, xs)
    _assert_bitwise(want, got)
