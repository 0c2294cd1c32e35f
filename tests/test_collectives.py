"""Every collective against jax.lax (or numpy where jax.lax has no CPU lowering) on the same
fresh random inputs: dtypes x shapes x parameters, on 8 devices and on a 2x4 mesh.

Each case compiles its own programs (XLA's compile time grows with the number of collectives in
a program, so putting several cases in one program saves nothing), so the grids run as a
rotation by default (``_util.rotation``: every dtype, every shape and every axis setting of each
operator at least once); ``pytest -m slow`` runs the rest of each grid."""

from __future__ import annotations

import functools
import os
import re
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
    unordered_strata_calls,
)
from jax import custom_batching
from jax.sharding import NamedSharding
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
    # jax.lax.psum_scatter rejects negative dimensions on CPU; strata accepts them (case 8).
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


@pytest.mark.parametrize("order", ["1", "0", ""])
def test_calls_are_chained_in_program_order(rng, monkeypatch, order):
    """By default (unset, here in one process) and with STRATA_PROGRAM_ORDER=1 each strata call
    gets one byte of extra result, and the next call (same block) takes it as its last operand,
    so XLA runs a device's calls in program order (program_order.py: chain). With 0
    nothing is chained. The values are the same."""
    monkeypatch.setenv("STRATA_PROGRAM_ORDER", order)
    chained = order != "0"
    mesh = mesh1d(4)
    spec = P("x")

    def body(lax, a, e, b, c):
        return (
            lax.psum(a, "x"),
            lax.psum(e, "x"),  # moves nothing
            lax.pmax(b, "x"),
            lax.all_gather(c, "x", tiled=True),
        )

    def run(lax):
        return jax.jit(
            jax.shard_map(
                functools.partial(body, lax), mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4
            )
        )

    xs = [random_array(rng, (8, 3), np.float32) for _ in range(3)]
    xs.insert(1, np.zeros((8, 0), np.float32))
    text = run(sj).lower(*xs).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @strata_" in ln]
    assert len(calls) == 4, text
    for prev, call in zip(calls, calls[1:], strict=False):
        name, _, count = prev.split("=")[0].strip().partition(":")  # %3, or %5:2 (two results)
        last = f"{name}#{int(count) - 1}" if count else name
        # every call (the one moving nothing too) has the extra result: one more than its own
        assert (":" in call.split("=")[0]) == chained, call
        operands = [o.strip() for o in call.split("(", 1)[1].split(")", 1)[0].split(",")]
        assert (last in operands) == chained, (prev, call)
    got = run(sj)(*xs)
    want = run(jax.lax)(*xs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _strata_calls(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "stablehlo.custom_call @strata_" in ln]


def _chained_after(prev: str, call: str) -> bool:
    """Whether ``call`` takes ``prev``'s last result (its Done) as an operand."""
    name, _, count = prev.split("=")[0].strip().partition(":")
    last = f"{name}#{int(count) - 1}" if count else name
    return last in [o.strip() for o in call.split("(", 1)[1].split(")", 1)[0].split(",")]


def test_nested_jit_calls_get_own_ids_and_join_the_chain(rng):
    """A jax.jit nested in the program holding a strata call, called twice: lowered inline
    (no func.call), so its two calls have op ids of their own and are chained with the calls
    around them; values, and gradients through it, equal jax.lax's."""
    mesh = mesh1d(4)

    def body(lax, a):
        inner = jax.jit(lambda v: lax.psum(v, "x"))
        return inner(a), inner(a * 2), lax.pmax(a, "x")

    def run(lax):
        return jax.jit(
            jax.shard_map(
                functools.partial(body, lax), mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 3
            )
        )

    a = random_array(rng, (8, 3), np.float32)
    text = run(sj).lower(a).as_text()
    calls = _strata_calls(text)
    assert len(calls) == 3 and "func.call" not in text, text
    ids = [int(c.split("op_id = ")[1].split(" ")[0]) for c in calls]
    assert len(set(ids)) == 3, ids
    assert all(_chained_after(p, c) for p, c in zip(calls, calls[1:], strict=False)), calls
    for g, w in zip(run(sj)(a), run(jax.lax)(a), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    def loss(lax, v):
        inner = jax.jit(lambda u: lax.psum(jnp.sin(u), "x"))
        return (inner(v) * inner(v * 3)).sum()

    def grad(lax):
        return jax.jit(
            jax.shard_map(
                jax.grad(functools.partial(loss, lax)),
                mesh=mesh,
                in_specs=P("x"),
                out_specs=P("x"),
            )
        )

    np.testing.assert_allclose(np.asarray(grad(sj)(a)), np.asarray(grad(jax.lax)(a)), rtol=1e-5)


def test_cond_and_loops_join_the_chain(rng):
    """A cond and a fori_loop holding strata calls, between independent strata calls: each is
    put after the block's previous strata call (a strata_order on its index / smallest carry)
    and the next call after it; two equal conds and two equal checkpointed calls get op ids of
    their own (JAX's lowering cache copied them, ids included). Values equal jax.lax's."""
    mesh = mesh1d(4)

    def body(lax, a, b, c, d):
        p = lax.psum(a, "x")
        q = jax.lax.cond(p[0, 0] > 0, lambda u: lax.psum(u, "x"), lambda u: lax.pmax(u, "x"), b)
        q2 = jax.lax.cond(p[0, 0] < 0, lambda u: lax.psum(u, "x"), lambda u: lax.pmax(u, "x"), c)
        r = jax.lax.fori_loop(0, 3, lambda i, v: lax.psum(v, "x") * 0.25, c)
        ck = jax.checkpoint(lambda v: lax.psum(jnp.sin(v), "x"))
        return p, q, q2, r, ck(d), ck(d * 3), lax.pmin(d, "x")

    def run(lax):
        return jax.jit(
            jax.shard_map(
                functools.partial(body, lax),
                mesh=mesh,
                in_specs=(P("x"),) * 4,
                out_specs=(P("x"),) * 7,
                check_vma=False,
            )
        )

    xs = [random_array(rng, (8, 3), np.float32) for _ in range(4)]
    text = run(sj).lower(*xs).as_text()
    assert text.count("custom_call @strata_order") == 3, text  # two conds, one loop
    ids = [int(c.split("op_id = ")[1].split(" ")[0]) for c in _strata_calls(text) if "op_id" in c]
    # the branches of one cond share ids by design (alternatives); nothing else does
    assert len(ids) - len(set(ids)) == 2, ids
    for g, w in zip(run(sj)(*xs), run(jax.lax)(*xs), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_loops_and_jits_outside_shard_map_are_left_alone():
    """Loops holding a strata shard_map, outside any shard_map (jax.grad of a scan over layers,
    two fori_loops), compile and equal jax.lax: no strata_order in the automatically
    partitioned part, where XLA's partitioner rejects a side-effecting call without sharding (a
    review found that regression). A jit around a shard_map keeps its out_shardings."""
    mesh = mesh1d(8)
    got = {}
    for lib in (jax.lax, sj):
        layer = jax.shard_map(
            lambda a, lib=lib: lib.psum(a, "x") * 0.125,
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )

        def loss(v, layer=layer):
            return jax.lax.scan(lambda c, _: (jnp.sin(layer(c)), None), v, None, length=2)[0].sum()

        def loops(v, layer=layer):
            once = jax.lax.fori_loop(0, 2, lambda i, u: layer(u), v)
            return jax.lax.fori_loop(0, 2, lambda i, u: layer(u), once)

        inner = jax.jit(
            jax.shard_map(
                lambda a, lib=lib: lib.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            ),
            out_shardings=NamedSharding(mesh, P()),
        )
        x = jnp.linspace(-1.0, 1.0, 64 * 4, dtype=jnp.float32).reshape(64, 4)
        out = jax.jit(lambda v, inner=inner: inner(v))(x[:16])
        got[lib] = (jax.jit(jax.grad(loss))(x), jax.jit(loops)(x), out, out.sharding.spec)
    for g, w in zip(got[sj][:3], got[jax.lax][:3], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert got[sj][3] == got[jax.lax][3] == P()


def _towers(lib, mesh):
    """Two shard_map layers (a psum tower and an all_to_all + pmax one), each jitted, and a jit
    that runs them on independent inputs: four regions with no data path between them."""

    def tower(v, w):
        for _ in range(3):
            v = lib.psum(jnp.tanh(v @ w), "x") / 8
        return v

    def tower2(v, w):
        v = jnp.tanh(v @ w)
        return lib.all_to_all(v, "x", 0, 0, tiled=True) + lib.pmax(v, "x")

    f, g = (
        jax.jit(jax.shard_map(t, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
        for t in (tower, tower2)
    )
    return jax.jit(
        lambda a, b, w: (
            f(a, w),
            g(b, w),
            f(b, w * 2),
            jax.shard_map(tower2, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(a * 3, w),
        )
    )


@pytest.mark.parametrize("steps", [50, pytest.param(300, marks=pytest.mark.slow)])
def test_shard_map_regions_are_chained_in_program_order(rng, steps):
    """Independent shard_map regions in one jit (some inside a nested jit, one called twice)
    deadlocked in one process before their calls were chained across regions (the first 50 of
    3,000 steps, in 4 of 4 runs: "rank 2: waiting in psum (op 1), another call of this same
    program"). Each region now hands a token to the next (program_order.py:
    _chain_shard_map_regions): 300 steps, each equal to jax.lax's; in the lowered text every
    strata call has an op id of its own and each region takes the previous region's token.
    (50 steps by default, 300 behind -m slow.)"""
    mesh = mesh1d(8)
    a = random_array(rng, (8 * 32, 128), np.float32)
    b = random_array(rng, (8 * 32, 128), np.float32)
    w = random_array(rng, (128, 128), np.float32) / 12
    text = _towers(sj, mesh).lower(a, b, w).as_text()
    calls = _strata_calls(text)
    ids = [int(c.split("op_id = ")[1].split(" ")[0]) for c in calls]
    assert len(calls) == 10 and len(set(ids)) == 10 and " call @" not in text, text
    regions = [ln for ln in text.splitlines() if "sdy.manual_computation(" in ln]
    assert len(regions) == 4, text
    for prev, region in zip(regions, regions[1:], strict=False):
        name, count = prev.split("=")[0].strip().split(":")  # %0:2 -> its token is %0#1
        operands = region.split("sdy.manual_computation(", 1)[1].split(")", 1)[0].split(", ")
        assert operands[-1] == f"{name}#{int(count) - 1}", (prev, region)
    step, want = _towers(sj, mesh), _towers(jax.lax, mesh)(a, b, w)
    assert not unordered_strata_calls(step.lower(a, b, w).compile().as_text())
    for i in range(steps):
        got = step(a, b, w)
        if i % 50 == 0 or i == steps - 1:
            for gv, wv in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=1e-5, atol=1e-6)


def test_custom_jvp_calls_and_grad_regions_join_the_chain(rng):
    """Strata calls inside a jax.custom_jvp function chain with the calls around them (JAX
    lowered such a function on its own, outside the chain), and under jax.grad outside the
    shard_map the backward region comes after the forward one; values and gradients equal
    jax.lax's."""
    mesh = mesh1d(4)

    def make(lib):
        @jax.custom_jvp
        def twice(v):
            return lib.psum(v, "x") * 2

        @twice.defjvp
        def _(p, t):
            return twice(p[0]), lib.psum(t[0], "x") * 2

        def body(a, b):
            top = lib.pmax(jax.lax.stop_gradient(b), "x")
            return lib.psum((twice(a) * top + twice(jnp.sin(b))).sum(), "x")

        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)

    a = random_array(rng, (8, 3), np.float32)
    b = random_array(rng, (8, 3), np.float32)
    calls = _strata_calls(jax.jit(make(sj)).lower(a, b).as_text())
    assert len(calls) == 4, calls  # twice's psum, pmax, twice's psum, the loss's psum
    # the loss's psum reads the others' results, so it needs no extra operand
    assert all(_chained_after(p, c) for p, c in zip(calls[:3], calls[1:3], strict=False)), calls
    for argnums in (0, 1):
        got = jax.jit(jax.grad(make(sj), argnums))(a, b)
        want = jax.jit(jax.grad(make(jax.lax), argnums))(a, b)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _higher_order_cases(lib):
    """Programs whose strata calls sit inside higher-order primitives that JAX lowered as
    functions of their own (a review found each outside the chain)."""
    mesh = mesh1d(8)

    @custom_batching.custom_vmap
    def vm(v):
        return lib.psum(jnp.tanh(v), "x")

    vm.def_vmap(lambda n, b, v: (vm(v), b[0]))

    def solve(v):  # x = v / 8 solves psum-broadcast(x) = v for replicated rows
        return jax.lax.custom_linear_solve(
            lambda u: u * 8.0, v, lambda mv, b: lib.psum(b, "x") / 64.0
        )

    @jax.custom_vjp
    def rem(v):
        return lib.psum(jnp.sin(v), "x")

    rem.defvjp(
        lambda v: (rem(v), v), lambda v, g: (jnp.cos(v) * lib.psum(g, "x"),), optimize_remat=True
    )

    def region(body, out_specs=None):
        return jax.shard_map(
            body, mesh=mesh, in_specs=P("x"), out_specs=out_specs or P("x"), check_vma=False
        )

    mesh2 = mesh2d(2, 4)
    inner = jax.jit(
        jax.shard_map(
            lambda v: lib.psum(jnp.tanh(v), ("a", "b")),
            in_specs=P("b"),
            out_specs=P(),
            axis_names={"b"},
            check_vma=False,
        )
    )
    partly = jax.shard_map(
        lambda u, v: (inner(u), inner(v)),
        mesh=mesh2,
        in_specs=(P("a"),) * 2,
        out_specs=(P(),) * 2,
        axis_names={"a"},
        check_vma=False,
    )
    loss = region(
        lambda u, v: ((rem(u) * rem(v)).sum() + lib.pmax(jax.lax.stop_gradient(v), "x").sum())[None]
    )
    return {
        "custom_vmap": jax.jit(
            region(lambda u, v: (vm(u), vm(v), lib.all_to_all(v, "x", 0, 0, tiled=True)), P("x"))
        ),
        "custom_linear_solve": jax.jit(region(lambda u, v: (solve(u), solve(v), lib.pmax(u, "x")))),
        "custom_vjp_optimize_remat": jax.jit(jax.grad(lambda u, v: loss(u, v).sum(), (0, 1))),
        "partly_manual": jax.jit(partly),
    }


@pytest.mark.parametrize(
    "case", ["custom_vmap", "custom_linear_solve", "custom_vjp_optimize_remat", "partly_manual"]
)
def test_calls_in_higher_order_primitives_join_the_chain(rng, case):
    """Strata calls inside custom_vmap, custom_linear_solve, custom_vjp(optimize_remat=True)
    under jax.grad outside the shard_map, and a nested jit of a shard_map called twice inside
    a partly manual shard_map: in the compiled program every strata call has an op id of its
    own and a data path to every other (program_order.py: _lower_higher_order_primitives_inline,
    _chain_shard_map_regions); values equal jax.lax's."""
    a = random_array(rng, (64, 16), np.float32)
    b = random_array(rng, (64, 16), np.float32)
    f = _higher_order_cases(sj)[case]
    hlo = f.lower(a, b).compile().as_text()
    ids = re.findall(r"op_id = (\d+)", hlo)
    assert len(ids) == len(set(ids)) >= 2, ids
    assert not unordered_strata_calls(hlo), unordered_strata_calls(hlo)
    want = _higher_order_cases(jax.lax)[case](a, b)
    for g, w in zip(jax.tree.leaves(f(a, b)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _loops_around_regions(lib):
    mesh = mesh1d(8)
    layer = jax.shard_map(
        lambda v, w: lib.psum(jnp.tanh(v @ w), "x") / 8,
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=P("x"),
    )
    other = jax.shard_map(
        lambda v: lib.all_to_all(v, "x", 0, 0, tiled=True) + lib.pmax(v, "x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )

    def step(a, b, ws):
        first = other(b)
        h = jax.lax.scan(lambda c, w: (layer(c, w), None), a, ws)[0]
        h2 = jax.lax.fori_loop(0, 2, lambda i, c: layer(c, ws[i]), b)
        c = jax.lax.cond(ws[0, 0, 0] > 0, other, lambda u: layer(u, ws[0]), b)
        return h, first, other(a), h2, c

    return jax.jit(step)


def test_loops_and_conds_around_shard_maps_join_the_chain(rng):
    """A scan, a fori_loop and a cond outside any shard_map whose bodies hold strata shard_map
    regions, between independent regions: each takes the block's region token as one more
    carry (operand) and hands it on (program_order.py: _thread_region_token), so in XLA's compiled
    program every pair of strata calls and loops holding them has a data path (before: 15
    unordered pairs), with no XLA collective added; values equal jax.lax's."""
    a = random_array(rng, (8 * 16, 32), np.float32)
    b = random_array(rng, (8 * 16, 32), np.float32)
    ws = random_array(rng, (3, 32, 32), np.float32) / 6
    f = _loops_around_regions(sj)
    hlo = f.lower(a, b, ws).compile().as_text()
    assert not unordered_strata_calls(hlo), unordered_strata_calls(hlo)
    plain = _loops_around_regions(jax.lax).lower(a, b, ws).compile().as_text()
    for op in ("all-gather(", "all-reduce(", "collective-permute("):
        assert hlo.count(op) <= plain.count(op), op  # jax.lax's own exchanges aside
    want = _loops_around_regions(jax.lax)(a, b, ws)
    for _ in range(20):
        got = f(a, b, ws)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_vmapped_loop_with_batched_stop_around_a_region(rng):
    """jax.vmap of a while_loop / fori_loop around a strata shard_map whose stop differs per
    example (a batched predicate) compiles and equals jax.lax (the region token carry failed
    JAX's per-carry select there: a review found it; such loops are left unthreaded)."""
    mesh = mesh1d(8)

    def make(lib):
        region = jax.shard_map(
            lambda v: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")
        )

        def f(a, n):
            w = jax.lax.while_loop(
                lambda s: s[0] < n, lambda s: (s[0] + 1, region(s[1]) / 8), (0, a)
            )[1]
            return w + jax.lax.fori_loop(0, n, lambda i, c: region(c) / 8, a)

        return jax.jit(jax.vmap(f))

    a = random_array(rng, (3, 16), np.float32)
    n = np.array([0, 1, 3], np.int32)
    np.testing.assert_allclose(
        np.asarray(make(sj)(a, n)), np.asarray(make(jax.lax)(a, n)), rtol=1e-5, atol=1e-6
    )


def test_calls_stay_ordered_where_xla_removes_the_data_path(rng):
    """q = psum(b + p * 0) reads p = psum(a) only through a path XLA's simplifier removes
    (integers): q still takes p's Done, so in the compiled program q's call has an operand
    from p's (before, the two calls were independent there). Values equal jax.lax's."""
    mesh = mesh1d(4)

    def body(lib, a, b):
        p = lib.psum(a, "x")
        return p, lib.psum(b + p * 0, "x")

    def run(lib):
        return jax.jit(
            jax.shard_map(
                functools.partial(body, lib), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )
        )

    a = rng.integers(-50, 50, 8).astype(np.int32)
    b = rng.integers(-50, 50, 8).astype(np.int32)
    hlo = run(sj).lower(a, b).compile().as_text()
    calls = [ln for ln in hlo.splitlines() if 'custom_call_target="strata_all_reduce"' in ln]
    assert len(calls) == 2, hlo
    first = calls[0].split("=")[0].strip().lstrip("%")
    operands = calls[1].split("custom-call(", 1)[1].split(")", 1)[0].split(", ")
    producers = {ln.split("=")[0].strip().lstrip("%"): ln for ln in hlo.splitlines() if "=" in ln}
    assert any(
        first in producers.get(o.lstrip("%"), "") for o in operands if "get-tuple-element" in o
    ), calls
    for g, w in zip(run(sj)(a, b), run(jax.lax)(a, b), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    "name",
    ["STRATA_LL_BYTES", "STRATA_LL_STAGE_BYTES", "STRATA_STREAM_BYTES", "STRATA_TWO_SHOT_BYTES"],
)
def test_byte_settings_are_checked(monkeypatch, name):
    """A byte setting the native library reads itself takes digits with a K/M/G suffix; any
    other value (``1.5M``, ``-1``, ``foo``) is an error at the first strata call naming the
    variable, where it used to turn the path off without a word (a new user's ``1G``)."""
    from strata_jax._src import runtime

    for good, n in (("0", 0), ("4096", 4096), ("64K", 65536), ("1m", 1 << 20), ("2G", 2 << 30)):
        monkeypatch.setenv(name, good)
        assert runtime.env_bytes(name, 7, "") == n
    monkeypatch.delenv(name)
    assert runtime.env_bytes(name, 7, "") == 7
    for bad in ("1.5M", "-1", "foo", "1T", "M"):
        monkeypatch.setenv(name, bad)
        monkeypatch.setattr(runtime, "_env_checked", False)
        with pytest.raises(ValueError, match=f"{name}='{re.escape(bad)}': give a number of bytes"):
            runtime.native()
    monkeypatch.delenv(name)
    runtime.native()  # checked again, and fine
    assert runtime._env_checked


def test_native_byte_settings_read_suffixes():
    """The native library reads STRATA_STREAM_BYTES and STRATA_TWO_SHOT_BYTES with K/M/G
    suffixes, as strata_jax checks them: ``1G`` used to be read as 1 byte (``atoll``), which
    turned every copy into a streaming one where a measurement meant the opposite."""
    code = (
        "import strata_jax; from strata_jax._src.runtime import native; "
        "print(native().get_stream_bytes(), native().get_two_shot_bytes())"
    )
    env = dict(os.environ, STRATA_STREAM_BYTES="3M", STRATA_TWO_SHOT_BYTES="2K")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(3 << 20), str(2 << 10)]


@pytest.mark.parametrize(
    "name,bad,message",
    [
        ("STRATA_ALLOC_THRESHOLD", "abc", "give a number of bytes"),
        ("STRATA_ALLOC_CACHE_BYTES", "1.5G", "give a number of bytes"),
        ("STRATA_ALLOC_RESERVE_BYTES", "-1", "give a number of bytes"),
        ("STRATA_TIMEOUT_S", "abc", "a number > 0"),
        ("STRATA_TIMEOUT_S", "0", "a number > 0"),
        ("STRATA_TIMEOUT_S", "inf", "a number > 0"),
    ],
)
def test_allocator_and_timeout_settings_are_checked(monkeypatch, name, bad, message):
    """The allocator falls back to its default on a size it cannot read, and the timeout to 300 s
    (a new user's ``STRATA_ALLOC_THRESHOLD=abc`` ran silently with 64K): both are an error at
    the first strata call naming the variable; the values they take pass."""
    from strata_jax._src import runtime

    monkeypatch.setenv(name, bad)
    monkeypatch.setattr(runtime, "_env_checked", False)
    with pytest.raises(ValueError, match=f"{name}='{re.escape(bad)}': .*{message}"):
        runtime.native()
    good = "12.5" if name == "STRATA_TIMEOUT_S" else "64KB"
    monkeypatch.setenv(name, good)
    monkeypatch.setattr(runtime, "_env_checked", False)
    runtime.native()
    assert runtime._env_checked


def test_program_order_setting_is_checked(monkeypatch):
    """A STRATA_PROGRAM_ORDER other than 1, 0 or unset is an error that says what to use."""
    monkeypatch.setenv("STRATA_PROGRAM_ORDER", "true")
    f = jax.jit(
        jax.shard_map(lambda a: sj.psum(a, "x"), mesh=mesh1d(2), in_specs=P("x"), out_specs=P("x"))
    )
    with pytest.raises(ValueError, match="STRATA_PROGRAM_ORDER='true': use 1"):
        f.lower(np.ones(4, np.float32))
