"""The collective cases 1-13 of shared/cases/edge-cases.md, each with its value asserted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import ALL_DTYPES, mesh1d, random_array, shard_run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import strata_jax as sj


def run(body, x, n=8, check_vma=True, out_specs=None):
    return shard_run(
        body,
        mesh1d(n),
        x,
        in_specs=P("x"),
        out_specs=P("x") if out_specs is None else out_specs,
        check_vma=check_vma,
    )


# 1. Max/min start values -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "int32", "int8", "int64", "float16", "bfloat16"])
def test_01_max_of_all_negative(dtype):
    x = np.array([-1, -3], dtype=jnp.dtype(dtype))
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), x, n=2), [-1, -1])
    np.testing.assert_array_equal(run(lambda v: sj.pmin(v, "x"), x, n=2), [-3, -3])


def test_01_int32_identity_and_infinities():
    x = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).min + 1], np.int32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), x, n=2), [x[1], x[1]])
    ninf = np.array([-np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), ninf, n=2), ninf)
    pinf = np.array([np.inf, np.inf], np.float32)
    np.testing.assert_array_equal(run(lambda v: sj.pmin(v, "x"), pinf, n=2), pinf)
    u = np.array([0, 0], np.uint32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), u, n=2), u)


# 2. NaN is sticky whatever the rank order (deliberately differs from jax.lax on CPU) ------
@pytest.mark.parametrize("vals", [[np.nan, 5.0], [5.0, np.nan]])
@pytest.mark.parametrize("op,oracle", [("pmax", np.max), ("pmin", np.min)])
def test_02_nan_two_ranks(vals, op, oracle):
    x = np.array(vals, np.float32)
    got = run(lambda v: getattr(sj, op)(v, "x"), x, n=2)
    assert np.isnan(oracle(x))
    assert np.all(np.isnan(got))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_02_nan_four_ranks(dtype):
    x = np.array([1, np.nan, 3, 4], jnp.dtype(dtype))
    for op in ("pmax", "pmin"):
        got = run(lambda v, op=op: getattr(sj, op)(v, "x"), x, n=4)
        assert np.all(np.isnan(got.astype(np.float32))), op


# 3. bool ---------------------------------------------------------------------------------
def test_03_bool():
    x = np.zeros((8, 2), bool)
    x[:, 0] = True
    got = run(lambda v: sj.psum(v, "x"), x)
    want = run(lambda v: jax.lax.psum(v, "x"), x)
    assert got.dtype == np.int32 and want.dtype == np.int32
    np.testing.assert_array_equal(got, np.tile([8, 0], (8, 1)))
    np.testing.assert_array_equal(got, want)
    y = np.zeros((8, 3), bool)
    y[2, 0] = True  # OR: any True -> True ; AND: all True needed
    y[:, 1] = True
    np.testing.assert_array_equal(
        run(lambda v: sj.pmax(v, "x"), y), np.tile([True, True, False], (8, 1))
    )
    np.testing.assert_array_equal(
        run(lambda v: sj.pmin(v, "x"), y), np.tile([False, True, False], (8, 1))
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_03_no_crash_for_any_dtype(rng, dtype):
    x = random_array(rng, (8, 3), dtype)
    for body in (
        lambda v: sj.psum(v, "x"),
        lambda v: sj.all_gather(v, "x", tiled=True),
        lambda v: sj.ppermute(v, "x", [(0, 1)]),
        lambda v: sj.pbroadcast(v, "x", 1),
        lambda v: sj.all_to_all(jnp.tile(v, 8), "x", 0, 0, tiled=True),
    ):
        run(body, x.reshape(-1) if x.ndim > 1 else x)


# 4. Non-row-major inputs -----------------------------------------------------------------
def test_04_transposed_view_reduce_scatter():
    base = np.arange(24).reshape(4, 3, 2)
    x = np.stack([base] * 4)  # each of 4 ranks holds arange(24).reshape(4,3,2)

    def body(v):
        t = jnp.transpose(v[0], (0, 2, 1))  # (4, 2, 3), transposed just before the collective
        return sj.psum_scatter(t, "x", scatter_dimension=0, tiled=False)[None]

    got = shard_run(body, mesh1d(4), x, in_specs=P("x"), out_specs=P("x"))
    np.testing.assert_array_equal(got[0], [[0, 8, 16], [4, 12, 20]])
    np.testing.assert_array_equal(got[0], 4 * base[0].T)
    for r in range(4):
        np.testing.assert_array_equal(got[r], 4 * base[r].T)


# 5. all_to_all under jit after a transpose equals eager and numpy -------------------------
def test_05_all_to_all_after_transpose(rng):
    x = rng.standard_normal((8, 8, 6)).astype(np.float32)  # rank j holds x[j]: (8, 6)

    def body(v):
        t = v.T  # (6, 8): the split axis is the one that was leading before the transpose
        return sj.all_to_all(t, "x", 1, 0, tiled=False)  # (8, 6)

    got = shard_run(body, mesh1d(), x.reshape(64, 6), in_specs=P("x"), out_specs=P("x"))
    want = np.concatenate([np.stack([x[j][i] for j in range(8)]) for i in range(8)])
    np.testing.assert_array_equal(got, want)
    eager = jax.shard_map(body, mesh=mesh1d(), in_specs=P("x"), out_specs=P("x"))(x.reshape(64, 6))
    np.testing.assert_array_equal(np.asarray(eager), want)
    lax = shard_run(
        lambda v: jax.lax.all_to_all(v.T, "x", 1, 0, tiled=False), mesh1d(), x.reshape(64, 6)
    )
    np.testing.assert_array_equal(lax, want)


# 6. Scalars ------------------------------------------------------------------------------
def test_06_scalars():
    x = np.full((8,), 1.5, np.float32)
    got = run(lambda v: sj.psum(v[0], "x")[None], x)
    np.testing.assert_array_equal(got, np.full(8, 12.0))
    got = shard_run(lambda v: sj.psum(v[0], "x"), mesh1d(), x, out_specs=P())
    assert got.shape == ()
    ag = run(lambda v: sj.all_gather(v[0], "x")[None], np.arange(8, dtype=np.float32))
    assert ag.shape == (8, 8)
    np.testing.assert_array_equal(ag[3], np.arange(8))
    with pytest.raises(ValueError, match="0-d"):
        run(lambda v: sj.all_gather(v[0], "x", tiled=True)[None], x)
    with pytest.raises(ValueError, match="0-d"):
        run(lambda v: sj.psum_scatter(v[0], "x", tiled=True)[None], x)


# 7. all_to_all shapes --------------------------------------------------------------------
def test_07_all_to_all_shapes(rng):
    x = rng.standard_normal((8, 8, 64)).astype(np.float32)
    un = shard_run(lambda v: sj.all_to_all(v[0], "x", 0, 1, tiled=False)[None], mesh1d(), x)
    assert un.shape == (8, 64, 8)
    for i in range(8):
        for j in range(8):
            np.testing.assert_array_equal(un[i][:, j], x[j][i, :])
    ti = shard_run(lambda v: sj.all_to_all(v[0], "x", 0, 1, tiled=True)[None], mesh1d(), x)
    assert ti.shape == (8, 1, 512)
    for i in range(8):
        for j in range(8):
            np.testing.assert_array_equal(ti[i][0, 64 * j : 64 * j + 64], x[j][i, :])


# 8. Negative axes, out-of-range axes, empty axis tuple -----------------------------------
def test_08_axes(rng):
    x = rng.standard_normal((8, 3, 16)).astype(np.float32)
    a = shard_run(
        lambda v: sj.psum_scatter(v[0], "x", scatter_dimension=-1, tiled=True)[None], mesh1d(), x
    )
    b = shard_run(
        lambda v: sj.psum_scatter(v[0], "x", scatter_dimension=1, tiled=True)[None], mesh1d(), x
    )
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="out of range"):
        shard_run(
            lambda v: sj.psum_scatter(v[0], "x", scatter_dimension=2, tiled=True)[None], mesh1d(), x
        )
    with pytest.raises(ValueError, match="out of range"):
        shard_run(lambda v: sj.all_gather(v[0], "x", axis=5)[None], mesh1d(), x)
    with pytest.raises(ValueError, match="out of range"):
        shard_run(lambda v: sj.all_to_all(v[0], "x", 3, 0)[None], mesh1d(), x)
    for fn in (
        lambda v: sj.psum(v, ()),
        lambda v: sj.all_gather(v, ()),
        lambda v: sj.psum_scatter(v, ()),
        lambda v: sj.all_to_all(v, (), 0, 0),
        lambda v: sj.ppermute(v, (), []),
        lambda v: sj.pmax(v, ()),
    ):
        np.testing.assert_array_equal(shard_run(fn, mesh1d(), x), x)


# 9. Gradients ----------------------------------------------------------------------------
def test_09_gradient_of_replicated_weight():
    mesh = mesh1d(2)

    def local(w, d):
        return jax.grad(lambda w: sj.psum((w**2 + 1) * d, "x").sum())(w)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P()))
    g = f(jnp.float32(1.0), jnp.array([0.0, 1.0], jnp.float32))
    assert float(g) == 2.0
    # the same as without sharding
    assert float(jax.grad(lambda w: jnp.sum((w**2 + 1) * jnp.array([0.0, 1.0])))(1.0)) == 2.0


def test_09_pmean_gradient_is_mean_of_local_gradients(rng):
    d = rng.standard_normal(8).astype(np.float32)

    def local(w, d):
        return jax.grad(lambda w: sj.pmean(jnp.sum(w * w * d), "x"))(w)

    f = jax.jit(jax.shard_map(local, mesh=mesh1d(), in_specs=(P(), P("x")), out_specs=P()))
    g = float(f(jnp.float32(1.5), d))
    np.testing.assert_allclose(g, np.mean(2 * 1.5 * d), rtol=1e-5)


# 10. vmap: see test_transforms.py (vmap of shard_map over a tuple, tiled all_gather under
#     vmap, grad of vmap of all_gather). A direct check of tiled all_gather under vmap:
def test_10_tiled_all_gather_under_vmap(rng):
    x = rng.standard_normal((8 * 3, 4)).astype(np.float32)

    def body(impl):
        return lambda v: jax.vmap(lambda u: impl.all_gather(u, "x", tiled=True))(v)

    got = shard_run(body(sj), mesh1d(), x)
    want = shard_run(body(jax.lax), mesh1d(), x)
    np.testing.assert_array_equal(got, want)


# 11. Reuse and races ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes,iters",
    [
        (256, 300),
        (4 << 20, 4),
        pytest.param(256, 1000, marks=pytest.mark.slow),
        pytest.param(4 << 20, 12, marks=pytest.mark.slow),
    ],
)
def test_11_back_to_back_fresh_inputs(rng, nbytes, iters):
    """Fresh inputs call after call into one program: 300 calls of 256 B and 4 of 4 MiB by
    default, 1000 and 12 behind -m slow."""
    mesh = mesh1d()
    n = nbytes // 4
    f = jax.jit(
        jax.shard_map(
            lambda v: (sj.psum(v, "x"), sj.all_gather(v[:8], "x")),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=(P("x"), P("x")),
        )
    )
    sh = NamedSharding(mesh, P("x"))
    for _ in range(iters):
        x = rng.integers(-1000, 1000, size=(8 * n,)).astype(np.int32)
        s, g = f(jax.device_put(x, sh))
        s = np.asarray(s).reshape(8, n)
        np.testing.assert_array_equal(s[0], x.reshape(8, n).sum(0))
        np.testing.assert_array_equal(s[5], s[0])
        np.testing.assert_array_equal(np.asarray(g).reshape(8, 8, 8)[2], x.reshape(8, n)[:, :8])


def test_11_many_iterations_below_and_above_two_shot(rng):
    """1000+ iterations in one program (a scan), both all-reduce algorithms, exact ints."""
    mesh = mesh1d()
    for n in (1000, 1 << 16):
        x = rng.integers(-50, 50, size=(8 * n,)).astype(np.int32)

        length = 1000 if n < 4096 else 50

        def local(v, length=length):
            def step(c, _):
                return c, sj.psum(c, "x")[:4]

            _, ys = jax.lax.scan(step, v, None, length=length)
            return ys[None]

        f = jax.jit(
            jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        )
        ys = np.asarray(f(x))
        want = x.reshape(8, n).sum(0)[:4]
        assert np.all(ys == want), "a scan iteration returned a wrong sum"


# 12. Zero-sized pieces -------------------------------------------------------------------
@pytest.mark.parametrize(
    "op",
    ["psum", "pmax", "pmean", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pbroadcast"],
)
def test_12_zero_size_arrays(op):
    body = {
        "psum": lambda v: sj.psum(v, "x"),
        "pmax": lambda v: sj.pmax(v, "x"),
        "pmean": lambda v: sj.pmean(v, "x"),
        "all_gather": lambda v: sj.all_gather(v, "x", tiled=True),
        "psum_scatter": lambda v: sj.psum_scatter(v, "x", tiled=True),
        "all_to_all": lambda v: sj.all_to_all(v, "x", 1, 1, tiled=True),
        "ppermute": lambda v: sj.ppermute(v, "x", [(0, 1)]),
        "pbroadcast": lambda v: sj.pbroadcast(v, "x", 0),
    }[op]
    x = np.zeros((8 * 8, 0), np.float32)
    got = shard_run(body, mesh1d(), x)
    assert got.size == 0


def test_12_all_to_all_with_zero_counts_per_peer(rng):
    """Ragged exchange [0, 3, 0, 5] elements to peers, expressed with a padded all_to_all
    plus counts (the MoE dispatch shape), completes and delivers exactly the live rows."""
    counts = np.array([[0, 3, 0, 5]] * 4)  # rank i sends counts[i][j] rows to rank j
    cap = counts.max()
    x = rng.standard_normal((4, 4, cap, 2)).astype(np.float32)
    mask = np.arange(cap)[None, None, :] < counts[:, :, None]
    x = np.where(mask[..., None], x, 0)

    def body(v):
        return sj.all_to_all(v[0], "x", 0, 0, tiled=True)[None]

    got = shard_run(body, mesh1d(4), x)
    for i in range(4):
        for j in range(4):
            np.testing.assert_array_equal(got[i][j], x[j][i])
            assert np.all(got[i][j][counts[j][i] :] == 0)


# 13. Program order -----------------------------------------------------------------------
def test_13_rank_dependent_sequences_keep_order(rng):
    """Rank-dependent branches that each run the same collective sequence on different
    data; the result matches eager execution and numpy."""
    x = rng.integers(-9, 9, size=(8,)).astype(np.int32)

    def body(v):
        odd = jax.lax.axis_index("x") % 2 == 1
        a = jax.lax.cond(odd, lambda u: sj.psum(u * 2, "x"), lambda u: sj.psum(u + 1, "x"), v)
        b = sj.all_gather(a + v, "x", tiled=True)
        return b[:1] * 0 + b[jax.lax.axis_index("x")]

    jitted = shard_run(body, mesh1d(), x, check_vma=False)
    eager = np.asarray(
        jax.shard_map(body, mesh=mesh1d(), in_specs=P("x"), out_specs=P("x"), check_vma=False)(x)
    )
    r = np.arange(8)
    a = np.where(r % 2 == 1, x * 2, x + 1).sum()
    np.testing.assert_array_equal(jitted, a + x)
    np.testing.assert_array_equal(eager, jitted)


def test_bad_arguments_fail_at_trace_time():
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match="outside"):
        run(lambda v: sj.ppermute(v, "x", [(0, 9)]), x)
    with pytest.raises(ValueError, match="repeat"):
        run(lambda v: sj.psum(v, ("x", "x")), x)
    with pytest.raises(ValueError, match="repeats a source"):
        run(lambda v: sj.ppermute(v, "x", [(0, 1), (0, 2)]), x)
    # negative indices count from the end, as in jax.lax.ppermute
    got = run(lambda v: sj.ppermute(v, "x", [(-1, 0)]), x)
    want = run(lambda v: jax.lax.ppermute(v, "x", [(7, 0)]), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_pmax_pmin_are_not_differentiable_like_jax_lax(op):
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(NotImplementedError, match="Differentiation rule"):
        run(lambda v: jax.grad(lambda u: getattr(sj, op)(u, "x").sum())(v), x)
    with pytest.raises(NotImplementedError, match="Differentiation rule"):
        run(lambda v: jax.jvp(lambda u: getattr(sj, op)(u, "x"), (v,), (v,))[1], x)
