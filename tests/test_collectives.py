"""Every collective against jax.lax (or numpy where jax.lax has no CPU lowering, or no such
operator: pprod) on the same fresh random inputs: dtypes x shapes x parameters, on 8 devices and
on a 2x4 mesh.

Each case compiles its own programs (XLA's compile time grows with the number of collectives in
a program, so putting several cases in one program saves nothing), so the grids run as a
rotation by default (``_util.rotation``: every dtype, every shape and every axis setting of each
operator at least once); ``pytest -m slow`` runs the rest of each grid."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    assert_close,
    grid,
    mesh1d,
    mesh2d,
    ppermute_reference,
    random_array,
    rotation,
    shard_run,
)
from jax.sharding import PartitionSpec as P

import strata_jax as sj

SHAPES = [(), (0,), (1,), (1000,), (3, 5, 7), (65537,)]


def per_rank(body):
    """Body over the per-rank block [1, *shape] -> strips and restores the rank axis."""
    return lambda v: jax.tree_util.tree_map(lambda o: o[None], body(v[0]))


def compare(body_of, x, dtype, mesh=None, nranks=8, check_vma=True):
    mesh = mesh or mesh1d()
    got = shard_run(per_rank(body_of(sj)), mesh, x, check_vma=check_vma)
    want = shard_run(per_rank(body_of(jax.lax)), mesh, x, check_vma=check_vma)
    assert_close(got, want, dtype, nranks)
    return got


@pytest.mark.parametrize("dtype,shape", rotation([], [ALL_DTYPES, [(), (0,), (1000,), (3, 5, 7)]]))
def test_psum_dtypes(rng, dtype, shape):
    x = random_array(rng, (8, *shape), dtype)
    got = compare(lambda impl: lambda v: impl.psum(v, "x"), x, dtype)
    # every rank holds bitwise the same result
    for r in range(1, 8):
        np.testing.assert_array_equal(got[r], got[0])


# (count, dtype): one-shot and two-shot sizes, float32 and bfloat16, rotated over the group sizes.
_FOLD_CASES = [(1000, "float32"), (70001, "bfloat16"), (70001, "float32"), (1000, "bfloat16")]


@pytest.mark.parametrize("n,case", rotation(grid(range(2, 9)), [_FOLD_CASES]))
def test_psum_folds_in_rank_order(n, case):
    """Every element is summed rank 0, 1, ..., n-1, in a float32 accumulator for bfloat16: the
    result is bitwise numpy's left fold, for every group size (the kernel folds four sources per
    pass, then the one to three left in one pass), one-shot and two-shot sizes alike."""
    count, dtype = case
    rng = np.random.default_rng(n * count)
    # Magnitudes over 12 decades: almost any other order rounds differently.
    x = (rng.standard_normal((n, count)) * 10.0 ** rng.integers(-6, 6, (n, count))).astype(dtype)
    got = shard_run(per_rank(lambda v: sj.psum(v, "x")), mesh1d(n), x)
    acc = x[0].astype(np.float32)
    for j in range(1, n):
        acc = acc + x[j].astype(np.float32)
    want = acc.astype(dtype)
    for r in range(n):
        np.testing.assert_array_equal(
            got[r].view(np.uint16 if dtype == "bfloat16" else np.uint32),
            want.view(np.uint16 if dtype == "bfloat16" else np.uint32),
        )


@pytest.mark.parametrize(
    "shape,dtype", rotation(grid(SHAPES + [(2**20 + 3,)]), [["float32", "bfloat16", "int32"]])
)
def test_psum_sizes(rng, dtype, shape):
    x = random_array(rng, (8, *shape), dtype)
    compare(lambda impl: lambda v: impl.psum(v, "x"), x, dtype)


@pytest.mark.parametrize(
    "op,dtype", rotation(grid(["pmax", "pmin"]), [[d for d in ALL_DTYPES if "complex" not in d]])
)
def test_pmax_pmin_dtypes(rng, op, dtype):
    x = random_array(rng, (8, 1000), dtype)
    compare(lambda impl: lambda v: getattr(impl, op)(v, "x"), x, dtype)


@pytest.mark.parametrize("op,shape", rotation(grid(["pmax", "pmin", "pmean"]), [SHAPES]))
def test_reductions_sizes(rng, op, shape):
    x = random_array(rng, (8, *shape), "float32")
    compare(lambda impl: lambda v: getattr(impl, op)(v, "x"), x, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int8"])
def test_pmean(rng, dtype):
    x = random_array(rng, (8, 77), dtype)
    got = shard_run(per_rank(lambda v: sj.pmean(v, "x")), mesh1d(), x)
    want = shard_run(per_rank(lambda v: jax.lax.pmean(v, "x")), mesh1d(), x)
    assert_close(got, want, want.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("nranks,size", [(8, 77), (3, 100_003), (6, 70_001)])
def test_pmean_divides_inside_the_reduction(rng, dtype, nranks, size):
    """A floating pmean is one strata call that divides as it stores its result
    (ReduceOp::kMean), with no divide left to XLA: bitwise strata's psum followed by the
    divide (one-shot and two-shot; group sizes that are not powers of two, where a multiply by
    1/n would differ), and close to jax.lax.pmean."""
    x = random_array(rng, (nranks, size), dtype)
    mesh = mesh1d(nranks)
    got = shard_run(per_rank(lambda v: sj.pmean(v, "x")), mesh, x)
    ref = shard_run(per_rank(lambda v: sj.psum(v, "x") / nranks), mesh, x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))
    want = shard_run(per_rank(lambda v: jax.lax.pmean(v, "x")), mesh, x)
    assert_close(got, want, dtype, nranks)
    body = jax.shard_map(lambda v: sj.pmean(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    hlo = jax.jit(body).lower(x).as_text()
    assert hlo.count("custom_call") == 1 and "divide" not in hlo, hlo


def test_pmean_bfloat16_group_larger_than_bfloat16_integers():
    """jax's `y / n` rounds n to y's dtype first: bfloat16 holds integers exactly only to 256,
    so a group of 257 divides by 256 in jax.lax.pmean, in strata's psum / n and in pmean's
    transpose; the native mean must too (a review found it dividing by 257)."""
    code = textwrap.dedent(
        """
        import jax, numpy as np, jax.numpy as jnp
        import strata_jax as sj
        from jax.sharding import Mesh, PartitionSpec as P
        n = 257
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((n, 64)), jnp.bfloat16)
        def run(fn):
            f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
            return np.asarray(jax.jit(f)(x)).view(np.uint16)
        got = run(lambda v: sj.pmean(v, "x"))
        assert (got == run(lambda v: sj.psum(v, "x") / n)).all()
        assert (got == run(lambda v: jax.lax.pmean(v, "x"))).all()
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=257")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_pmean_counted_as_pmean(rng):
    """comm_stats names a pmean's calls "pmean" (they went to "other" at first)."""
    sj.reset_stats()
    x = random_array(rng, (8, 100), "float32")
    shard_run(per_rank(lambda v: sj.pmean(v, "x")), mesh1d(), x)
    ops = sj.comm_stats()["ops"]
    assert ops.get("pmean", {}).get("calls", 0) == 8 and "other" not in ops, ops


def test_pmean_mixed_pytree_and_transforms(rng):
    """pmean of a pytree mixing floats (divided natively), ints and bool (psum, then XLA's
    divide), under grad (check_vma on and off) and vmap over a mesh axis: as jax.lax."""
    tree = {
        "f": random_array(rng, (8, 33), "float32"),
        "h": random_array(rng, (8, 5), "bfloat16"),
        "i": random_array(rng, (8, 7), "int32"),
        "b": random_array(rng, (8, 3), "bool"),
    }
    mesh = mesh1d()

    def run(impl):
        body = lambda t: impl.pmean(jax.tree_util.tree_map(lambda a: a[0], t), "x")  # noqa: E731
        specs = jax.tree_util.tree_map(lambda _: P("x"), tree)
        f = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P())
        return jax.jit(f)(tree)

    got, want = run(sj), run(jax.lax)
    for k in tree:
        assert got[k].dtype == want[k].dtype, k
        assert_close(got[k], want[k], str(want[k].dtype), 8, k)
    w = random_array(rng, (8, 16), "float32")
    for vma in (True, False):

        def grad_of(impl, vma=vma):
            loss = lambda v: jnp.sum(jnp.sin(impl.pmean(v * v, "x")))  # noqa: E731
            return shard_run(per_rank(jax.grad(loss)), mesh, w, check_vma=vma)

        assert_close(grad_of(sj), grad_of(jax.lax), "float32", 8, f"grad vma={vma}")
    x = random_array(rng, (4, 2, 10), "float32")
    mesh2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("y",))

    def vmapped(impl):
        inner = lambda v: impl.pmean(v, ("v", "y"))  # noqa: E731
        body = lambda v: jax.vmap(inner, axis_name="v")(v[:, 0])[:, None]  # noqa: E731
        # check_vma off: jax.lax refuses a vmap axis beside a mesh axis under it.
        return shard_run(
            body, mesh2, x, in_specs=P(None, "y"), out_specs=P(None, "y"), check_vma=False
        )

    assert_close(vmapped(sj), vmapped(jax.lax), "float32", 8, "vmap")


# pprod: jax.lax has none, so against numpy's product in rank order and jax.lax's all_gather
# followed by a product.


def rank_order_product(x: np.ndarray) -> np.ndarray:
    """x[0] * x[1] * ... * x[n-1] in numpy (integers wrap, bool is AND); bfloat16 and float16
    multiplied in float32 and rounded once, as strata's kernels do."""
    dt = x.dtype
    wide = x.astype(np.float32) if dt in (jnp.bfloat16, np.float16) else x
    out = wide[0]
    for r in wide[1:]:
        out = out * r
    return out.astype(dt)


def lax_pprod(v, axis_name):
    """The product over the group with jax.lax: all_gather, then a product over the ranks."""
    g = jax.lax.all_gather(v, axis_name)
    if g.dtype == jnp.bool_:
        return jnp.all(g, axis=0)
    return jax.lax.reduce(g, np.ones((), g.dtype), jax.lax.mul, (0,))


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if "complex" not in d])
def test_pprod_dtypes(rng, dtype):
    """Bitwise numpy's product in rank order on every rank, and jax.lax's all_gather + product
    within the dtype's tolerance (XLA's reduce multiplies in its own order)."""
    x = random_array(rng, (8, 3, 37), dtype)
    got = shard_run(per_rank(lambda v: sj.pprod(v, "x")), mesh1d(), x)
    want = rank_order_product(x)
    for r in range(8):
        np.testing.assert_array_equal(got[r].view(np.uint8), want.view(np.uint8), err_msg=dtype)
    ref = shard_run(per_rank(lambda v: lax_pprod(v, "x")), mesh1d(), x)
    assert_close(got, ref, dtype, 8, dtype)


def test_pprod_one_shot_and_two_shot(rng):
    """Both all-reduce algorithms multiply in rank order (bitwise numpy's), sizes off any
    chunk boundary and zero-size included; comm_stats counts the calls under "pprod", split by
    algorithm."""
    old = sj.get_two_shot_threshold()
    try:
        for thr in (0, 1 << 40):
            sj.set_two_shot_threshold(thr)
            sj.reset_stats()
            for shape in [(), (0,), (1,), (40_001,)]:
                x = random_array(rng, (8, *shape), "float32")
                got = shard_run(per_rank(lambda v: sj.pprod(v, "x")), mesh1d(), x)
                np.testing.assert_array_equal(got, np.broadcast_to(rank_order_product(x), x.shape))
            split = sj.comm_stats()["ops"]["pprod"]["algorithm"]
            assert split["two_shot" if thr == 0 else "one_shot"] > 0, (thr, split)
    finally:
        sj.set_two_shot_threshold(old)


def test_pprod_pytree_vmap_constants_and_errors(rng):
    """A pytree is one call; under vmap over a mesh axis and for a constant the product is the
    group's; complex, axis_index_groups and differentiation are clear errors."""
    tree = {"f": random_array(rng, (8, 9), "float32"), "i": random_array(rng, (8, 4), "int16")}
    mesh = mesh1d()
    specs = jax.tree_util.tree_map(lambda _: P("x"), tree)
    body = lambda t: sj.pprod(jax.tree_util.tree_map(lambda a: a[0], t), "x")  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P()))
    assert f.lower(tree).as_text().count("custom_call @strata_all_reduce_list") == 1
    got = f(tree)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(got[k]), rank_order_product(tree[k]), err_msg=k)
    x = random_array(rng, (4, 2, 10), "float32")
    mesh2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("y",))
    inner = lambda v: sj.pprod(v, ("v", "y"))  # noqa: E731
    vbody = lambda v: jax.vmap(inner, axis_name="v")(v[:, 0])[:, None]  # noqa: E731
    out = shard_run(vbody, mesh2, x, in_specs=P(None, "y"), out_specs=P(None, "y"), check_vma=False)
    want = np.prod(x.astype(np.float64), axis=(0, 1)).astype(np.float32)
    assert_close(out, np.broadcast_to(want[None, None], x.shape), "float32", 8, "vmap")
    const = shard_run(lambda v: v * 0 + sj.pprod(np.float32(1.5), "x"), mesh, tree["f"])
    np.testing.assert_array_equal(const, np.full((8, 9), np.float32(1.5) ** 8))
    with pytest.raises(TypeError, match="real numbers"):
        shard_run(lambda v: sj.pprod(v, "x"), mesh, random_array(rng, (8, 3), "complex64"))
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        shard_run(lambda v: sj.pprod(v, "x", axis_index_groups=[[0, 1]]), mesh, tree["f"])
    with pytest.raises(NotImplementedError, match="jnp.prod"):
        shard_run(jax.grad(lambda v: sj.pprod(v, "x").sum()), mesh, tree["f"])


def test_two_shot_threshold_paths_agree(rng):
    """Both all-reduce algorithms, on a size just below and above the switch point."""
    x = random_array(rng, (8, 40_001), "float32")
    old = sj.get_two_shot_threshold()
    try:
        outs = []
        for thr in (0, 1 << 40):
            sj.set_two_shot_threshold(thr)
            outs.append(compare(lambda impl: lambda v: impl.psum(v, "x"), x, "float32"))
        stats = sj.comm_stats()
        assert stats["one_shot_all_reduce"] > 0 and stats["two_shot_all_reduce"] > 0
    finally:
        sj.set_two_shot_threshold(old)


@pytest.mark.parametrize("op", ["psum", "pmax", "pmean"])
def test_two_ranks_take_two_shot_from_16_mib(rng, op):
    """A group of 2 runs one-shot below 16 MiB per rank and two-shot from there (each rank
    reduces half and writes it into both outputs); both equal jax.lax's bit for bit, a pytree's
    combined call included."""
    mesh2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("y",))
    n = (16 << 20) // 4  # float32 elements per rank: 16 MiB
    for rows in (n - 16, n):
        x = jnp.asarray(rng.standard_normal((2, rows), dtype=np.float32))
        sj.reset_stats()
        before = sj.comm_stats()
        outs = [
            shard_run(lambda v, impl=impl: getattr(impl, op)(v, "y"), mesh2, x, in_specs=P("y"),
                      out_specs=P("y"))
            for impl in (sj, jax.lax)
        ]  # fmt: skip
        after = sj.comm_stats()
        np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
        two = after["two_shot_all_reduce"] - before["two_shot_all_reduce"]
        one = after["one_shot_all_reduce"] - before["one_shot_all_reduce"]
        assert (two, one) == ((2, 0) if rows == n else (0, 2)), (rows, two, one)
    tree = {"a": x[:, : n // 2], "b": x[:, n // 2 :] * 3}
    got, want = (
        jax.jit(
            jax.shard_map(
                lambda t, impl=impl: getattr(impl, op)(t, "y"), mesh=mesh2, in_specs=P("y"),
                out_specs=P("y"),
            )
        )(tree)
        for impl in (sj, jax.lax)
    )  # fmt: skip
    for k in tree:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize(
    "axis,tiled,dtype",
    rotation([(0, False), (0, True), (1, True), (-1, False), (2, False)], [ALL_DTYPES]),
)
def test_all_gather(rng, dtype, axis, tiled):
    x = random_array(rng, (8, 3, 5), dtype)
    compare(lambda impl: lambda v: impl.all_gather(v, "x", axis=axis, tiled=tiled), x, dtype)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1001,), (65537,)])
def test_all_gather_sizes(rng, shape):
    x = random_array(rng, (8, *shape), "float32")
    compare(lambda impl: lambda v: impl.all_gather(v, "x"), x, "float32")


@pytest.mark.parametrize(
    "dim,tiled,dtype",
    rotation(
        [(0, True), (0, False), (1, True), (-1, True), (1, False)],
        [[d for d in ALL_DTYPES if d != "bool"]],
    ),
)
def test_psum_scatter(rng, dtype, dim, tiled):
    shape = (8, 16, 8) if tiled else (8, 8, 8)
    x = random_array(rng, (8, *shape[1:]), dtype)
    # jax.lax.psum_scatter rejects negative dimensions on CPU; strata accepts them.
    compare(
        lambda impl: (
            lambda v: impl.psum_scatter(
                v, "x", scatter_dimension=dim if impl is sj else dim % 2, tiled=tiled
            )
        ),
        x,
        dtype,
    )


@pytest.mark.parametrize("n", [8, 8 * 1001, 8 * 65537])
def test_psum_scatter_sizes(rng, n):
    x = random_array(rng, (8, n), "float32")
    compare(lambda impl: lambda v: impl.psum_scatter(v, "x", tiled=True), x, "float32")


@pytest.mark.parametrize(
    "split,concat,tiled,dtype",
    rotation(
        [
            (s, c, t)
            for t in (True, False)
            for s, c in [(0, 0), (0, 1), (1, 0), (1, 2), (2, 0), (-1, -2)]
        ],
        [ALL_DTYPES],
    ),
)
def test_all_to_all(rng, dtype, split, concat, tiled):
    shape = [3, 5, 7]
    shape[split] = 8 if not tiled else 16
    x = random_array(rng, (8, *shape), dtype)
    compare(
        lambda impl: (
            lambda v: impl.all_to_all(
                v,
                "x",
                split if impl is sj else split % 3,
                concat if impl is sj else concat % 3,
                tiled=tiled,
            )
        ),
        x,
        dtype,
    )


@pytest.mark.parametrize("n", [0, 8 * 129, 8 * 65537])
def test_all_to_all_sizes(rng, n):
    x = random_array(rng, (8, n), "float32")
    compare(lambda impl: lambda v: impl.all_to_all(v, "x", 0, 0, tiled=True), x, "float32")


# Per rank above 256 KiB (ffi/common.h kLeadBytes): in one process each pair of blocks is copied
# by the second of its two ranks to arrive (InProcTeam::arrive_pairs), whatever the axes.
_PAIR_CASES = [((16, 48, 360), 1, 2), ((64, 40, 108), 0, 2), ((6, 80, 576), 2, 0)]


@pytest.mark.parametrize(
    "case,dtype", rotation(grid(_PAIR_CASES), [["float32", "int8", "float64"]])
)
def test_all_to_all_pairs(rng, case, dtype):
    """Large all_to_alls, strided (split and concat on other axes than the first), on 8 devices
    and on the groups of a 2x4 mesh: the same values as jax.lax, and every rank's call took the
    pairs path (comm_stats()["pair_calls"], which the old build did not have)."""
    shape, split, concat = case
    x = random_array(rng, (8, *shape), dtype)
    before = sj.comm_stats()["pair_calls"]
    compare(lambda impl: lambda v: impl.all_to_all(v, "x", split, concat, tiled=True), x, dtype)
    assert sj.comm_stats()["pair_calls"] - before == 8
    axes = "b" if split == 1 else ("a", "b")
    compare2d(lambda impl: lambda v: impl.all_to_all(v, axes, split, concat, tiled=True), x, dtype)


PERMS = {
    "rotate": [(i, (i + 1) % 8) for i in range(8)],
    "reverse": [(i, 7 - i) for i in range(8)],
    "partial": [(0, 3), (3, 5), (6, 0)],
    "empty": [],
}


@pytest.mark.parametrize("perm,dtype", rotation(grid(PERMS), [ALL_DTYPES]))
def test_ppermute(rng, dtype, perm):
    x = random_array(rng, (8, 3, 7), dtype)
    compare(lambda impl: lambda v: impl.ppermute(v, "x", PERMS[perm]), x, dtype)


@pytest.mark.parametrize("source,dtype", rotation(grid([0, 5]), [ALL_DTYPES]))
def test_pbroadcast(rng, dtype, source):
    # jax.lax.pbroadcast has no CPU lowering: the oracle is numpy (its documented meaning).
    x = random_array(rng, (8, 3, 7), dtype)
    got = shard_run(per_rank(lambda v: sj.pbroadcast(v, "x", source)), mesh1d(), x)
    want = np.broadcast_to(x[source], x.shape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "shape,dtype",
    rotation(grid([(0,), (1,), (1001,), (65537,), (300001,)]), [["uint8", "float32"]]),
)
def test_pbroadcast_sizes(rng, dtype, shape):
    # Each rank copies its share of the source's input into every output (64 KiB tiles): sizes
    # below one cache line per rank, across tile edges and with a ragged last share.
    x = random_array(rng, (8, *shape), dtype)
    got = shard_run(per_rank(lambda v: sj.pbroadcast(v, "x", 6)), mesh1d(), x)
    np.testing.assert_array_equal(got, np.broadcast_to(x[6], x.shape))


# ----------------------------------------------------------------------------------------
# 2-D meshes: every axis and both, in both orders
# ----------------------------------------------------------------------------------------

AXES_2D = ["a", "b", ("a", "b"), ("b", "a")]


def compare2d(body_of, x, dtype):
    m = mesh2d()
    spec = P(("a", "b"))
    got = shard_run(per_rank(body_of(sj)), m, x, in_specs=spec, out_specs=spec)
    want = shard_run(per_rank(body_of(jax.lax)), m, x, in_specs=spec, out_specs=spec)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("axes,op", rotation(grid(AXES_2D), [["psum", "pmax", "pmin", "pmean"]]))
def test_2d_reductions(rng, axes, op):
    x = random_array(rng, (8, 129), "float32")
    compare2d(lambda impl: lambda v: getattr(impl, op)(v, axes), x, "float32")


@pytest.mark.parametrize("axes,tiled", rotation(grid(AXES_2D), [[True, False]]))
def test_2d_all_gather(rng, axes, tiled):
    x = random_array(rng, (8, 6, 5), "int32")
    compare2d(lambda impl: lambda v: impl.all_gather(v, axes, axis=1, tiled=tiled), x, "int32")


@pytest.mark.parametrize("axes", AXES_2D)
def test_2d_psum_scatter(rng, axes):
    x = random_array(rng, (8, 16, 3), "float32")
    compare2d(lambda impl: lambda v: impl.psum_scatter(v, axes, tiled=True), x, "float32")


@pytest.mark.parametrize("axes", AXES_2D)
def test_2d_all_to_all(rng, axes):
    x = random_array(rng, (8, 16, 3), "float64")
    compare2d(lambda impl: lambda v: impl.all_to_all(v, axes, 0, 1, tiled=True), x, "float64")


@pytest.mark.parametrize("axes", AXES_2D)
def test_2d_ppermute(rng, axes):
    """A group over several axes is indexed in the order named, also against the mesh's
    order (("b", "a")), which jax.lax 0.11.1+ refuses and 0.10 sorted."""
    n = 2 if axes == "a" else 4 if axes == "b" else 8
    perm = [(i, (i + 3) % n) for i in range(n - 1)]  # the last destination gets zeros
    x = random_array(rng, (8, 33), "float32")
    spec = P(("a", "b"))
    got = shard_run(per_rank(lambda v: sj.ppermute(v, axes, perm)), mesh2d(), x, spec, spec)
    np.testing.assert_array_equal(got, ppermute_reference(x, axes, perm))
    if axes != ("b", "a"):  # jax.lax agrees wherever it indexes the same way on every release
        want = shard_run(
            per_rank(lambda v: jax.lax.ppermute(v, axes, perm)), mesh2d(), x, spec, spec
        )
        np.testing.assert_array_equal(got, want)


def test_2d_pbroadcast(rng):
    m = mesh2d()
    x = random_array(rng, (8, 9), "float32")
    got = shard_run(
        per_rank(lambda v: sj.pbroadcast(v, "b", 2)),
        m,
        x,
        in_specs=P(("a", "b")),
        out_specs=P(("a", "b")),
    )
    want = np.concatenate([np.broadcast_to(x[4 * a + 2], (4, 9)) for a in range(2)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # 512 MiB in, 512 MiB out: 4 MiB per device runs by default (test_psum_sizes)
def test_large_psum_64mib(rng):
    """64 MiB per device, the size the issue names as the upper end."""
    n = 16 * 2**20
    x = rng.standard_normal((8, n), dtype=np.float32)
    got = shard_run(per_rank(lambda v: sj.psum(v, "x")), mesh1d(), x)
    np.testing.assert_allclose(got[3], x.sum(0, dtype=np.float64), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[7], got[0])


def test_axis_index_groups_is_a_clear_error(rng):
    x = random_array(rng, (8, 4), "float32")
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        shard_run(
            per_rank(lambda v: sj.psum(v, "x", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]])),
            mesh1d(),
            x,
        )


def test_unbound_axis_is_name_error():
    with pytest.raises(NameError, match="unbound axis"):
        jax.jit(lambda v: sj.psum(v, "nope"))(jnp.ones(3))
