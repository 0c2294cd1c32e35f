"""The collectives on unusual inputs, each result asserted against jax.lax or numpy: identity
values and infinities of pmax/pmin, NaN, bool, every dtype, non-row-major and transposed
operands, scalars, empty and zero-size shapes, negative, out-of-range and empty axes, gradients,
vmap, fresh inputs call after call, sizes alternating across the one-shot/two-shot switch, more
than 2^31 elements, uneven all_to_all groups, rank-dependent branches, and bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mp_util import launch
from _util import ALL_DTYPES, assert_close, mesh1d, random_array, shard_run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from two_shot_switch import SWITCH_THRESHOLD, switch_scan

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


# Max/min start values -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "int32", "int8", "int64", "float16", "bfloat16"])
def test_pmax_pmin_of_all_negative_values(dtype):
    x = np.array([-1, -3], dtype=jnp.dtype(dtype))
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), x, n=2), [-1, -1])
    np.testing.assert_array_equal(run(lambda v: sj.pmin(v, "x"), x, n=2), [-3, -3])


def test_pmax_pmin_at_int32_min_and_infinities():
    x = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).min + 1], np.int32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), x, n=2), [x[1], x[1]])
    ninf = np.array([-np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), ninf, n=2), ninf)
    pinf = np.array([np.inf, np.inf], np.float32)
    np.testing.assert_array_equal(run(lambda v: sj.pmin(v, "x"), pinf, n=2), pinf)
    u = np.array([0, 0], np.uint32)
    np.testing.assert_array_equal(run(lambda v: sj.pmax(v, "x"), u, n=2), u)


# NaN is sticky whatever the rank order (deliberately differs from jax.lax on CPU) ------
@pytest.mark.parametrize("vals", [[np.nan, 5.0], [5.0, np.nan]])
@pytest.mark.parametrize("op,oracle", [("pmax", np.max), ("pmin", np.min)])
def test_pmax_pmin_keep_nan_on_two_ranks(vals, op, oracle):
    x = np.array(vals, np.float32)
    got = run(lambda v: getattr(sj, op)(v, "x"), x, n=2)
    assert np.isnan(oracle(x))
    assert np.all(np.isnan(got))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_pmax_pmin_keep_nan_on_four_ranks(dtype):
    x = np.array([1, np.nan, 3, 4], jnp.dtype(dtype))
    for op in ("pmax", "pmin"):
        got = run(lambda v, op=op: getattr(sj, op)(v, "x"), x, n=4)
        assert np.all(np.isnan(got.astype(np.float32))), op


def test_pmax_of_nan_and_seven_numbers_is_nan_on_eight_ranks():
    """The case docs/guide/collectives.md names: ``[nan, 1, ..., 7]`` over 8 devices gives NaN
    on every rank (jax.lax on XLA CPU gives 7.0 there); pmin likewise."""
    x = np.array([np.nan, *range(1, 8)], np.float32)
    for op in ("pmax", "pmin"):
        got = np.asarray(run(lambda v, op=op: getattr(sj, op)(v, "x"), x, n=8))
        assert got.shape == (8,) and np.all(np.isnan(got)), (op, got)


def _fold_max_min(x: np.ndarray, op: str) -> np.ndarray:
    """The documented rule, rank by rank: take the next rank's value when it is greater (pmax)
    or less (pmin), or NaN; else keep the lower rank's (ties between +0.0 and -0.0 included)."""
    acc = x[0].copy()
    for b in x[1:]:
        take = (b > acc if op == "pmax" else b < acc) | np.isnan(b)
        acc = np.where(take, b, acc)
    return acc


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_pmax_pmin_bitwise_with_nan_zeros_and_infinities(dtype, n):
    """NaN, +-0.0 and +-inf scattered over 1031 elements per rank (the vectorized loops and
    their remainders; 3 and 8 ranks: the kernel's fold of 4 sources and the 1-3 left), every
    element bitwise against the documented rule. Guards the kernel's select: GCC 14 did not
    vectorize the earlier form, which was rewritten (reduce_impl.h)."""
    rng = np.random.default_rng()
    dt = jnp.dtype(dtype)
    x = rng.standard_normal((n, 1031)).astype(np.float32)
    special = np.array([np.nan, 0.0, -0.0, np.inf, -np.inf, -np.nan, 6e-8, -3e-5], np.float32)
    mask = rng.random(x.shape) < 0.3
    x[mask] = rng.choice(special, int(mask.sum()))
    x = x.astype(dt)
    bits = np.uint16 if dt.itemsize == 2 else np.uint32 if dt.itemsize == 4 else np.uint64
    for op in ("pmax", "pmin"):
        got = np.asarray(run(lambda v, op=op: getattr(sj, op)(v, "x"), x.reshape(-1), n=n))
        want = _fold_max_min(x, op)  # in the dtype itself: NaN signs and payloads as given
        got = got.reshape(n, -1)
        for r in range(n):  # every rank bitwise the same as the fold, NaN signs included
            same = got[r].view(bits) == want.view(bits)
            assert same.all(), (op, r, np.flatnonzero(~same)[:5])


def test_float16_every_value_through_the_reduce_kernel():
    """All 65536 float16 bit patterns on rank 0, -0.0 on rank 1: psum gives each value back
    bitwise (x + -0.0 = x, zeros' signs included) and pmax/pmin the documented fold, every NaN
    made quiet as the F16C instruction makes it. Checks the kernels' own float16 to float32
    conversion (coll/elem.h), which replaced the compiler's, on every input it can get."""
    pats = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    x = np.concatenate([pats.view(np.float16), np.full(65536, -0.0, np.float16)])
    nan = np.isnan(pats.view(np.float16))
    want = np.where(nan, pats | 0x0200, pats).astype(np.uint16)
    got = np.asarray(run(lambda v: sj.psum(v, "x"), x, n=2)).view(np.uint16).reshape(2, -1)
    for r in range(2):
        bad = np.flatnonzero(got[r] != want)
        assert bad.size == 0, [(hex(pats[i]), hex(got[r][i]), hex(want[i])) for i in bad[:5]]
    two = x.reshape(2, -1)
    for op in ("pmax", "pmin"):
        fold = _fold_max_min(two, op).view(np.uint16)
        fold = np.where(np.isnan(fold.view(np.float16)), fold | 0x0200, fold)
        got = np.asarray(run(lambda v, op=op: getattr(sj, op)(v, "x"), x, n=2)).view(np.uint16)
        for r in range(2):
            bad = np.flatnonzero(got.reshape(2, -1)[r] != fold)
            assert bad.size == 0, (
                op,
                [(hex(pats[i]), hex(got.reshape(2, -1)[r][i])) for i in bad[:5]],
            )


# bool ---------------------------------------------------------------------------------
def test_bool_reductions():
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
def test_every_dtype_against_jax_lax(rng, dtype):
    """psum, all_gather, ppermute and all_to_all of every dtype give jax.lax's values, dtype and
    shape (bool psum: int32, as jax.lax; int8 sums wrap alike), and pbroadcast numpy's (jax.lax
    has no CPU lowering of it): every rank gets the source's block."""
    x = random_array(rng, (8, 3), dtype).reshape(-1)
    for name, body in (
        ("psum", lambda m: lambda v: m.psum(v, "x")),
        ("all_gather", lambda m: lambda v: m.all_gather(v, "x", tiled=True)),
        ("ppermute", lambda m: lambda v: m.ppermute(v, "x", [(0, 1)])),
        ("all_to_all", lambda m: lambda v: m.all_to_all(jnp.tile(v, 8), "x", 0, 0, tiled=True)),
    ):
        got, want = run(body(sj), x), run(body(jax.lax), x)
        assert_close(got, want, dtype, msg=f"{name} of {dtype}")
    got = run(lambda v: sj.pbroadcast(v, "x", 1), x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.reshape(8, 3), np.tile(x.reshape(8, 3)[1], (8, 1)))


# Non-row-major inputs -----------------------------------------------------------------
def test_psum_scatter_of_a_transposed_operand():
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


# all_to_all under jit after a transpose equals eager and numpy -------------------------
def test_all_to_all_after_a_transpose(rng):
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


# Scalars ------------------------------------------------------------------------------
def test_scalars():
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


# all_to_all shapes --------------------------------------------------------------------
def test_all_to_all_untiled_and_tiled_shapes(rng):
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


# Negative axes, out-of-range axes, empty axis tuple -----------------------------------
def test_negative_out_of_range_and_empty_axes(rng):
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


# Gradients ----------------------------------------------------------------------------
def test_gradient_of_replicated_weight():
    mesh = mesh1d(2)

    def local(w, d):
        return jax.grad(lambda w: sj.psum((w**2 + 1) * d, "x").sum())(w)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P()))
    g = f(jnp.float32(1.0), jnp.array([0.0, 1.0], jnp.float32))
    assert float(g) == 2.0
    # the same as without sharding
    assert float(jax.grad(lambda w: jnp.sum((w**2 + 1) * jnp.array([0.0, 1.0])))(1.0)) == 2.0


def test_pmean_gradient_is_mean_of_local_gradients(rng):
    d = rng.standard_normal(8).astype(np.float32)

    def local(w, d):
        return jax.grad(lambda w: sj.pmean(jnp.sum(w * w * d), "x"))(w)

    f = jax.jit(jax.shard_map(local, mesh=mesh1d(), in_specs=(P(), P("x")), out_specs=P()))
    g = float(f(jnp.float32(1.5), d))
    np.testing.assert_allclose(g, np.mean(2 * 1.5 * d), rtol=1e-5)


# vmap: see test_transforms.py (vmap of shard_map over a tuple, tiled all_gather under
#   vmap, grad of vmap of all_gather). A direct check of tiled all_gather under vmap:
def test_tiled_all_gather_under_vmap(rng):
    x = rng.standard_normal((8 * 3, 4)).astype(np.float32)

    def body(impl):
        return lambda v: jax.vmap(lambda u: impl.all_gather(u, "x", tiled=True))(v)

    got = shard_run(body(sj), mesh1d(), x)
    want = shard_run(body(jax.lax), mesh1d(), x)
    np.testing.assert_array_equal(got, want)


# Reuse and races ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes,iters",
    [
        (256, 300),
        (4 << 20, 4),
        pytest.param(256, 1000, marks=pytest.mark.slow),
        pytest.param(4 << 20, 12, marks=pytest.mark.slow),
    ],
)
def test_back_to_back_fresh_inputs(rng, nbytes, iters):
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


def test_many_iterations_below_and_above_two_shot(rng):
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


# Zero-sized pieces -------------------------------------------------------------------
@pytest.mark.parametrize(
    "op",
    ["psum", "pmax", "pmean", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pbroadcast"],
)
def test_zero_size_arrays(op):
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


def test_all_to_all_with_zero_counts_per_peer(rng):
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


# Program order -----------------------------------------------------------------------
def test_rank_dependent_branches_keep_program_order(rng):
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


X = P("x")


def smap(body, n, in_specs=X, out_specs=X, check_vma=True):
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh1d(n), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    )


def both(make, *args):
    """Runs make(impl) for strata and jax.lax; returns the two results as numpy arrays."""
    return [jax.tree.map(np.asarray, make(impl)(*args)) for impl in (sj, jax.lax)]


# Uneven 3-way all_to_all ---------------------------------------------------------------
def test_three_way_all_to_all():
    x = np.arange(9, dtype=np.float32)
    got, want = both(lambda m: smap(lambda v: m.all_to_all(v, "x", 0, 0, tiled=True), 3), x)
    np.testing.assert_array_equal(got, [0, 3, 6, 1, 4, 7, 2, 5, 8])
    np.testing.assert_array_equal(got, want)
    xu = np.arange(9, dtype=np.float32).reshape(9, 1)  # per-device [3, 1]
    for split, concat in [(0, 0)]:  # jax.lax rejects other axes for this shape
        got, want = both(
            lambda m, s=split, c=concat: smap(lambda v: m.all_to_all(v, "x", s, c), 3), xu
        )
        assert got.shape == want.shape, (split, concat)
        np.testing.assert_array_equal(got, want, err_msg=f"split {split} concat {concat}")


# Empty shapes everywhere ---------------------------------------------------------------
def test_empty_shapes_everywhere():
    shapes = {}

    def gather(m, tiled):
        def body(v):
            y = m.all_gather(v, "x", tiled=tiled)
            shapes[(m.__name__, tiled)] = y.shape
            return y

        return smap(body, 4)

    x = np.zeros((4, 0, 2), np.float32)  # per-device [1, 0, 2]
    for tiled in (False, True):
        got, want = both(lambda m, t=tiled: gather(m, t), x)
        assert got.shape == want.shape and got.size == 0
    assert shapes[("strata_jax", False)] == shapes[("jax.lax", False)] == (4, 1, 0, 2)
    assert shapes[("strata_jax", True)] == shapes[("jax.lax", True)] == (4, 0, 2)

    e = np.zeros((0,), np.float32)
    for op in ("psum", "pmax"):
        got, want = both(lambda m, op=op: smap(lambda v: getattr(m, op)(v, "x"), 4), e)
        assert got.shape == want.shape == (0,) and got.dtype == want.dtype == np.float32
    a = np.zeros((16, 0), np.float32)  # per-device [4, 0]
    for tiled in (False, True):
        got, want = both(
            lambda m, t=tiled: smap(lambda v: m.all_to_all(v, "x", 0, 0, tiled=t), 4), a
        )
        assert got.shape == want.shape and got.size == 0, (tiled, got.shape, want.shape)
    perm = [(i, (i + 1) % 4) for i in range(4)]
    got, want = both(lambda m: smap(lambda v: m.ppermute(v, "x", perm), 4), e)
    assert got.shape == want.shape == (0,)


# Transposed operand ------------------------------------------------------------------
def test_transposed_operand():
    x = np.arange(48, dtype=np.float32).reshape(4, 3, 4)
    got, want = both(lambda m: smap(lambda v: m.psum(v[0].T, "x")[None], 4), x)
    expect = [[72, 88, 104], [76, 92, 108], [80, 96, 112], [84, 100, 116]]
    for d in range(4):
        np.testing.assert_array_equal(got[d], expect)
    np.testing.assert_array_equal(got, want)
    b = smap(lambda v: sj.pbroadcast(v[0][:, 1], "x", source=2)[None], 4)(x)
    np.testing.assert_array_equal(np.asarray(b), np.tile([25.0, 29.0, 33.0], (4, 1)))


# Sizes alternating across the one-shot/two-shot switch --------------------------------
@pytest.fixture
def two_shot_64k():
    old = sj.get_two_shot_threshold()
    sj.set_two_shot_threshold(SWITCH_THRESHOLD)
    yield
    sj.set_two_shot_threshold(old)


@pytest.mark.parametrize("steps", [12, pytest.param(200, marks=pytest.mark.slow)])
def test_sizes_alternating_across_the_two_shot_switch(two_shot_64k, steps):
    wrong = np.asarray(switch_scan(sj.psum, mesh1d(8), steps)(np.zeros(8, np.int32)))
    assert wrong.shape == (8 * steps,)
    assert not wrong.any(), f"wrong elements at steps {np.nonzero(wrong)[0] % steps}"


@pytest.mark.slow
@pytest.mark.parametrize("steps", [30, 200])
def test_sizes_alternating_across_the_two_shot_switch_four_processes(steps):
    r, _ = launch(4, "switch_scan.py", str(steps), STRATA_TWO_SHOT_BYTES=str(SWITCH_THRESHOLD))
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.count(f"OK switch {steps} steps wrong=0") == 4, r.stdout[-2000:]


# More than 2^31 elements ---------------------------------------------------------------
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_more_than_2_31_elements():
    n = 2**31 + 2
    # input and output of both devices (4 n bytes), the host's ones, and some slack
    if _mem_available() < 6 * n:
        pytest.skip(f"needs ~{6 * n >> 30} GiB free, have {_mem_available() >> 30} GiB")
    f = smap(lambda v: sj.psum(v, "x"), 2, in_specs=P(), out_specs=P(), check_vma=False)
    out = f(jnp.ones((n,), jnp.uint8))
    for shard in out.addressable_shards:  # both devices' own result
        d = np.asarray(shard.data)
        assert d.shape == (n,)
        assert d[-1] == 2 and d[2**31 - 1 : 2**31 + 2].tolist() == [2, 2, 2]
        for i in range(0, n, 1 << 28):  # in chunks: no 2 GiB temporary
            assert (d[i : i + (1 << 28)] == 2).all(), f"wrong values in [{i}, {i + (1 << 28)})"
    del out


# bool and int pmean --------------------------------------------------------------------
def test_bool_and_int_reductions_and_mean():
    b = np.array([True, False, True, True])
    got, want = both(lambda m: smap(lambda v: m.psum(v, "x"), 4), b)
    assert got.dtype == want.dtype == np.int32
    np.testing.assert_array_equal(got, [3, 3, 3, 3])
    got, want = both(lambda m: smap(lambda v: m.pmax(v, "x"), 4), b)
    assert got.dtype == want.dtype == np.bool_ and got.all()
    got, want = both(lambda m: smap(lambda v: m.all_gather(v, "x"), 4), b)
    assert got.dtype == want.dtype == np.bool_
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got.reshape(4, 4), np.tile(b, (4, 1)))
    perm = [(i, (i + 1) % 4) for i in range(4)]
    got, want = both(lambda m: smap(lambda v: m.ppermute(v, "x", perm), 4), b)
    assert got.dtype == want.dtype == np.bool_
    np.testing.assert_array_equal(got, np.roll(b, 1))
    np.testing.assert_array_equal(got, want)
    i = np.array([1, 2, 3, 5], np.int32)
    got, want = both(lambda m: smap(lambda v: m.pmean(v, "x"), 4), i)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got, [2.75] * 4)
