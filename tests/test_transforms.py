"""Transforms: jit, shard_map with check_vma on and off, grad, vmap, cond/scan/while_loop,
and 1000 chained calls dispatched ahead without blocking (the training-loop shape)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import IMPLS, assert_close, mesh1d, mesh2d, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import strata_jax as sj


def smap(f, mesh, in_specs, out_specs, check_vma=True):
    return jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    )


LOSSES = {
    "psum": lambda impl, w, d: impl.psum(jnp.sum(jnp.sin(w) * d), "x"),
    "pmean": lambda impl, w, d: impl.pmean(jnp.sum(jnp.sin(w) * d), "x"),
    "all_gather": lambda impl, w, d: jnp.sum(impl.all_gather(jnp.sin(w) * d, "x", tiled=True) ** 2),
    "psum_scatter": lambda impl, w, d: jnp.sum(
        impl.psum_scatter(jnp.sin(w) * d, "x", tiled=True) ** 3
    ),
    "all_to_all": lambda impl, w, d: jnp.sum(
        impl.all_to_all(jnp.sin(w) * d, "x", 0, 0, tiled=True) * jnp.arange(16.0)
    ),
    "ppermute": lambda impl, w, d: jnp.sum(
        impl.ppermute(jnp.sin(w) * d, "x", [(i, (i + 3) % 8) for i in range(8)]) * jnp.arange(16.0)
    ),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", list(LOSSES))
def test_grad_matches_jax_lax(rng, op, check_vma):
    w = rng.standard_normal(16).astype(np.float32)  # replicated parameter
    d = rng.standard_normal((8 * 16,)).astype(np.float32)  # sharded data
    mesh = mesh1d()
    grads = {}
    for name, impl in IMPLS.items():

        def local(w, d, impl=impl):
            g = jax.grad(lambda w: LOSSES[op](impl, w, d))(w)
            return g[None]

        f = smap(local, mesh, (P(), P("x")), P("x"), check_vma=check_vma)
        grads[name] = np.asarray(f(w, d))
    np.testing.assert_allclose(grads["strata"], grads["xla"], rtol=1e-5, atol=1e-5)


def test_pbroadcast_grad(rng):
    """d/dx of sum(c * pbroadcast(x)) is sum(c) on the source rank and 0 elsewhere."""
    x = rng.standard_normal((8, 5)).astype(np.float32)
    c = rng.standard_normal((8, 5)).astype(np.float32)

    def local(x, c):
        return jax.grad(lambda x: sj.psum(jnp.sum(c * sj.pbroadcast(x, "x", 2)), "x"))(x)

    g = np.asarray(smap(local, mesh1d(), (P("x"), P("x")), P("x"))(x.reshape(-1), c.reshape(-1)))
    g = g.reshape(8, 5)
    np.testing.assert_allclose(g[2], c.sum(0), rtol=1e-5, atol=1e-5)
    assert np.all(g[np.arange(8) != 2] == 0)


@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"])
def test_jvp_matches_jax_lax(rng, op):
    w = rng.standard_normal(16).astype(np.float32)
    t = rng.standard_normal(16).astype(np.float32)
    d = rng.standard_normal((8 * 16,)).astype(np.float32)
    outs = {}
    for name, impl in IMPLS.items():

        def local(w, t, d, impl=impl):
            _, tan = jax.jvp(lambda w: LOSSES[op](impl, w, d), (w,), (t,))
            return jnp.reshape(tan, (1,))

        outs[name] = np.asarray(smap(local, mesh1d(), (P(), P(), P("x")), P("x"))(w, t, d))
    np.testing.assert_allclose(outs["strata"], outs["xla"], rtol=1e-5, atol=1e-5)


def test_vmap_of_shard_map_psum_over_tuple(rng):
    """vmap of a shard_map whose body psums over a tuple of axis names."""
    mesh = mesh2d()
    x = rng.standard_normal((3, 8, 5)).astype(np.float32)
    res = {}
    for name, impl in IMPLS.items():
        f = jax.shard_map(
            lambda v, impl=impl: impl.psum(v, ("a", "b")),
            mesh=mesh,
            in_specs=P(("a", "b")),
            out_specs=P(),
        )
        res[name] = np.asarray(jax.jit(jax.vmap(f))(x))
    np.testing.assert_allclose(res["strata"], res["xla"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "op", ["all_gather", "psum_scatter", "all_to_all", "ppermute", "psum", "pmax"]
)
@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_inside_shard_map(rng, op, in_axes):
    bodies = {
        "all_gather": lambda impl, v: impl.all_gather(v, "x", axis=0, tiled=True),
        "psum_scatter": lambda impl, v: impl.psum_scatter(v, "x", tiled=True),
        "all_to_all": lambda impl, v: impl.all_to_all(v, "x", 0, 0, tiled=True),
        "ppermute": lambda impl, v: impl.ppermute(v, "x", [(0, 1), (1, 0), (5, 6)]),
        "psum": lambda impl, v: impl.psum(v, "x"),
        "pmax": lambda impl, v: impl.pmax(v, "x"),
    }
    x = rng.standard_normal((8 * 8, 16) if in_axes == 0 else (16, 8 * 8)).astype(np.float32)
    res = {}
    for name, impl in IMPLS.items():

        def local(v, impl=impl):
            return jax.vmap(lambda u: bodies[op](impl, u), in_axes=in_axes)(v)

        spec = P("x") if in_axes == 0 else P(None, "x")
        res[name] = np.asarray(smap(local, mesh1d(), spec, P("x"), check_vma=False)(x))
    np.testing.assert_allclose(res["strata"], res["xla"], rtol=1e-5, atol=1e-5)


def test_grad_of_vmap_of_all_gather(rng):
    x = rng.standard_normal((8 * 2, 3)).astype(np.float32)
    res = {}
    for name, impl in IMPLS.items():

        def local(v, impl=impl):
            def loss(v):
                g = jax.vmap(lambda u: impl.all_gather(u, "x", tiled=True), in_axes=1, out_axes=1)(
                    v
                )
                return jnp.sum(jnp.sin(g) * jnp.arange(g.size).reshape(g.shape))

            return jax.grad(loss)(v)

        res[name] = np.asarray(smap(local, mesh1d(), P("x"), P("x"))(x))
    np.testing.assert_allclose(res["strata"], res["xla"], rtol=1e-5, atol=1e-5)


def test_vmap_with_named_axis_psum(rng):
    """psum over a vmapped axis name (no mesh involved) reduces the batch dimension."""
    x = rng.standard_normal((4, 3)).astype(np.float32)
    got = jax.vmap(lambda v: sj.psum(v, "i"), axis_name="i")(x)
    want = jax.vmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = jax.vmap(lambda v: sj.pmax(v, "i"), axis_name="i")(x)
    np.testing.assert_array_equal(got, jax.vmap(lambda v: jax.lax.pmax(v, "i"), axis_name="i")(x))


def test_scan_cond_while_program_order(rng):
    """Collectives inside scan, cond and while_loop keep program order on every rank."""
    x = rng.standard_normal((8 * 4,)).astype(np.float32)
    res = {}
    for name, impl in IMPLS.items():

        def local(v, impl=impl):
            def step(c, i):
                c = jax.lax.cond(
                    i % 2 == 0,
                    lambda c: impl.psum(c, "x") / 8.0,
                    lambda c: impl.all_gather(c, "x", tiled=True)[:4] + 1.0,
                    c,
                )
                return c, impl.pmax(jnp.sum(c), "x")

            c, ys = jax.lax.scan(step, v, jnp.arange(5))

            def cond(s):
                return s[0] < 3

            def body(s):
                k, c = s
                return k + 1, impl.ppermute(c, "x", [(j, (j + 1) % 8) for j in range(8)]) * 0.5

            _, c = jax.lax.while_loop(cond, body, (0, c))
            return jnp.concatenate([c, jnp.broadcast_to(ys[:4], (4,))])

        res[name] = np.asarray(smap(local, mesh1d(), P("x"), P("x"), check_vma=False)(x))
    np.testing.assert_allclose(res["strata"], res["xla"], rtol=1e-5, atol=1e-5)


def test_rank_dependent_trip_count(rng):
    """A while loop whose trip count depends on data that differs per rank, with
    the collective's participation kept uniform (the count is agreed with pmax first)."""
    x = rng.integers(1, 6, size=(8,)).astype(np.int32)
    res = {}
    for name, impl in IMPLS.items():

        def local(v, impl=impl):
            n = impl.pmax(v[0], "x")  # agree on the trip count

            def body(s):
                k, acc = s
                acc = acc + impl.psum(jnp.where(k < v[0], 1, 0).astype(jnp.int32), "x")
                return k + 1, acc

            _, acc = jax.lax.while_loop(lambda s: s[0] < n, body, (0, jnp.int32(0)))
            return jnp.reshape(acc, (1,))

        res[name] = np.asarray(smap(local, mesh1d(), P("x"), P("x"), check_vma=False)(x))
    np.testing.assert_array_equal(res["strata"], res["xla"])
    assert res["strata"][0] == x.sum()


CHAINED = {
    "psum": lambda v: sj.psum(v, "x") / 8.0,
    "pmean": lambda v: sj.pmean(v, "x"),
    "pmax": lambda v: sj.pmax(v, "x") + 0.0,
    "pmin": lambda v: sj.pmin(v, "x") + 0.0,
    "all_gather": lambda v: sj.all_gather(v, "x", tiled=True)[: v.shape[0]] + 1.0,
    "psum_scatter": lambda v: jnp.tile(sj.psum_scatter(v, "x", tiled=True), 8) / 8.0,
    "all_to_all": lambda v: sj.all_to_all(v, "x", 0, 0, tiled=True) + 1.0,
    "ppermute": lambda v: sj.ppermute(v, "x", [(i, (i + 1) % 8) for i in range(8)]) + 1.0,
    "pbroadcast": lambda v: sj.pbroadcast(v, "x", 3) + 1.0,
}


@pytest.mark.parametrize(
    "op,calls",
    [(op, 1000 if op == "psum" else 300) for op in CHAINED]
    + [pytest.param(op, 1000, marks=pytest.mark.slow) for op in CHAINED if op != "psum"],
)
def test_1000_chained_calls_dispatched_ahead(op, calls):
    """The shape of every training loop under async dispatch: no block until the end. 1000
    calls of psum, 300 of the others by default (1000 of each behind -m slow)."""
    mesh = mesh1d()
    f = smap(CHAINED[op], mesh, P("x"), P("x"), check_vma=False)
    y = jax.device_put(jnp.ones((8 * 64,), jnp.float32), NamedSharding(mesh, P("x")))
    for _ in range(calls):
        y = f(y)
    y = np.asarray(y)
    want = {"psum": 1.0, "pmean": 1.0, "pmax": 1.0, "pmin": 1.0, "psum_scatter": 1.0}.get(
        op, calls + 1.0
    )
    np.testing.assert_array_equal(y, np.full_like(y, want))


def test_equal_collectives_in_one_program_get_distinct_op_ids():
    """psum(v), psum(sin v), psum(v*v): the same primitive, params and avals. JAX caches equal
    lowerings unless told not to; a shared lowering gave all three one op id, and across
    processes XLA's start order then paired psum(v) on one process with psum(sin v) on another."""
    import re

    mesh = mesh1d()
    f = smap(
        lambda v: jnp.stack(
            [sj.psum(v, "x"), sj.psum(jnp.sin(v), "x"), sj.pmax(2 * v, "x"), sj.psum(v * v, "x")]
        ),
        mesh,
        P("x"),
        P(),
    )
    x = jnp.linspace(-1.0, 1.0, 8 * 4, dtype=jnp.float32)
    ids = re.findall(r"op_id = (\d+)", f.lower(x).as_text())
    assert len(ids) == 4 and len(set(ids)) == 4, ids
    xs = np.asarray(x).reshape(8, 4)
    want = np.stack([xs.sum(0), np.sin(xs).sum(0), (2 * xs).max(0), (xs * xs).sum(0)])
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-6)


def test_many_programs_with_loops_interleaved():
    """Thousands of executions of several looping programs: the per-run bookkeeping of the
    in-process fabric is dropped by recency. XLA's run ids look like hashes (often negative,
    different per program), so dropping runs whose id is "far below the largest" once 4096
    were tracked erased live runs of some programs and their loops hung (found by
    serve_moe.py after ~640 interleaved executions)."""
    mesh = mesh1d()
    old = sj.get_timeout()
    sj.set_timeout(20.0)
    try:
        progs = []
        for k in range(3):

            def body(v, k=k):
                def step(c, _):
                    return sj.psum(c, "x") * (1.0 / 8) + float(k), None

                return jax.lax.scan(step, v, None, length=3)[0]

            progs.append(smap(body, mesh, P("x"), P("x"), check_vma=False))
        ys = [jax.device_put(jnp.zeros((8 * 4,), jnp.float32), NamedSharding(mesh, P("x")))] * 3
        for i in range(700):
            for k, f in enumerate(progs):
                ys[k] = f(ys[k])
            if i % 8 == 7:
                ys[0].block_until_ready()
        for k, y in enumerate(ys):
            np.testing.assert_allclose(np.asarray(y), np.full(8 * 4, 700 * 3.0 * k), rtol=1e-6)
    finally:
        sj.set_timeout(old)


@pytest.fixture
def short_timeout():
    """Strata's timeout at 1.5 s for a test that provokes one; restored afterwards."""
    old = sj.get_timeout()
    sj.set_timeout(1.5)
    yield
    sj.set_timeout(old)


def test_timeout_names_missing_ranks(short_timeout):
    """A peer that never arrives: the waiting rank fails with the op and the missing ranks."""

    def local(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(idx == 0, lambda u: sj.psum(u, "x"), lambda u: u, v)

    f = smap(local, mesh1d(), P("x"), P("x"), check_vma=False)
    pattern = (
        r"psum.*timed out.*rank\(s\) \[1, 2, 3, 4, 5, 6, 7\].*"
        r"ranks 1, 2, 3, 4, 5, 6, 7: in no strata call\."
    )
    with pytest.raises(Exception, match=pattern):
        np.asarray(f(jnp.ones(8, jnp.float32)))
    # the fabric is still usable afterwards
    g = smap(lambda v: sj.psum(v, "x"), mesh1d(), P("x"), P("x"), check_vma=False)
    np.testing.assert_array_equal(np.asarray(g(jnp.ones(8, jnp.float32))), np.full(8, 8.0))


def test_timeout_says_where_the_missing_rank_waits(short_timeout):
    """Rank 0 waits in a psum the others skip, while they wait for it in the pmax after: the
    timeout error says that the missing rank waits (or, timed out first, gave up waiting) in
    another call of the same program (the fault of two independent calls started in different
    orders on different devices)."""

    def local(v):
        idx = jax.lax.axis_index("x")
        v = jax.lax.cond(idx == 0, lambda u: sj.psum(u, "x"), lambda u: u, v)
        return sj.pmax(v, "x")

    f = smap(local, mesh1d(2), P("x"), P("x"), check_vma=False)
    pattern = (
        r"timed out.*rank\(s\) \[\d\].*rank \d: (waiting|gave up waiting) in "
        r"(psum|pmax) \(op \d+, run \d+\), another call of this same program"
    )
    with pytest.raises(Exception, match=pattern):
        np.asarray(f(jnp.ones(2, jnp.float32)))


def test_mismatched_collectives_fail_cleanly(short_timeout):
    """Ranks calling different collectives at the same point fail with a clear error."""

    def local(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(idx < 4, lambda u: sj.psum(u, "x"), lambda u: sj.pmax(u, "x"), v)

    f = smap(local, mesh1d(), P("x"), P("x"), check_vma=False)
    with pytest.raises(Exception, match="strata_jax"):
        np.asarray(f(jnp.ones(8, jnp.float32)))


def test_mismatched_dtypes_are_named(short_timeout):
    """Ranks calling the same collective on different dtypes: the error names both dtypes
    (it printed XLA's enum numbers, "dtype 11", before)."""

    def local(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(
            idx < 1,
            lambda u: sj.pmin(u, "x"),
            lambda u: sj.pmin(u.astype(jnp.int32), "x").astype(jnp.float32),
            v,
        )

    f = smap(local, mesh1d(2), P("x"), P("x"), check_vma=False)
    with pytest.raises(
        Exception, match=r"disagree.*dtype (float32|int32),.*dtype (int32|float32),"
    ):
        np.asarray(f(jnp.ones(2, jnp.float32)))


def test_mismatched_permutations_fail(short_timeout):
    """Ranks reaching a ppermute with different permutations (a rank-dependent branch) fail
    naming the differing parameters; before, each rank followed its own permutation and the
    call returned a value no single permutation gives."""
    right = [(i, (i + 1) % 4) for i in range(4)]
    left = [(i, (i - 1) % 4) for i in range(4)]

    def local(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(
            idx < 2, lambda u: sj.ppermute(u, "x", right), lambda u: sj.ppermute(u, "x", left), v
        )

    f = smap(local, mesh1d(4), P("x"), P("x"), check_vma=False)
    with pytest.raises(Exception, match=r"ppermute.*disagree.*parameters differ"):
        np.asarray(f(jnp.arange(4, dtype=jnp.float32)))


# A per-rank all_to_all above 256 KiB takes the pairs path in one process
# (InProcTeam::arrive_pairs: pairs of blocks copied as ranks arrive, no departure barrier).
_BIG = 128 * 1024  # float32 elements per rank: 512 KiB


def test_pairs_path_mismatch_fails_fast(short_timeout):
    """Ranks calling a large all_to_all on different dtypes (both on the pairs path), or one rank
    a large one and the others a small one (the pairs path against the one-rendezvous path of
    small calls): every rank fails at once saying the ranks disagree, not at the timeout."""
    import time

    def dtypes(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(
            idx < 1,
            lambda u: sj.all_to_all(u, "x", 0, 0, tiled=True),
            lambda u: sj.all_to_all(u.astype(jnp.int32), "x", 0, 0, tiled=True).astype(u.dtype),
            v,
        )

    def sizes(v):
        idx = jax.lax.axis_index("x")
        small = (
            lambda u: jnp.pad(  # noqa: E731
                sj.all_to_all(u[:64], "x", 0, 0, tiled=True), (0, u.shape[0] - 64)
            )
        )
        return jax.lax.cond(idx < 1, lambda u: sj.all_to_all(u, "x", 0, 0, tiled=True), small, v)

    for local, pattern in ((dtypes, r"disagree.*dtype (float32|int32)"), (sizes, r"disagree")):
        x = jnp.ones(4 * _BIG, jnp.float32)
        f = smap(local, mesh1d(4), P("x"), P("x"), check_vma=False).lower(x).compile()
        t0 = time.perf_counter()
        with pytest.raises(Exception, match=pattern):
            np.asarray(f(x))
        # the timeout is 1.5 s: a failure before it came from the ranks' own check
        assert time.perf_counter() - t0 < 1.4, "failed at the timeout, not at once"


def test_pairs_path_timeout_then_recovers(short_timeout):
    """A rank that never reaches a large all_to_all: the others time out naming it (none copies
    into or out of a rank that has left), and the next call of the same shape is right."""

    def skip(v):
        idx = jax.lax.axis_index("x")
        return jax.lax.cond(
            idx == 0, lambda u: u, lambda u: sj.all_to_all(u, "x", 0, 0, tiled=True), v
        )

    f = smap(skip, mesh1d(4), P("x"), P("x"), check_vma=False)
    with pytest.raises(Exception, match=r"all_to_all: timed out.*rank\(s\) \[0\]"):
        np.asarray(f(jnp.ones(4 * _BIG, jnp.float32)))
    g = smap(lambda v: sj.all_to_all(v, "x", 0, 0, tiled=True), mesh1d(4), P("x"), P("x"))
    x = np.arange(4 * _BIG, dtype=np.float32)
    want = smap(lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), mesh1d(4), P("x"), P("x"))
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(want(x)))


@functools.lru_cache
def _unused():  # pragma: no cover - keeps random_array/assert_close imports meaningful
    return random_array, assert_close
