"""Strata calls in program order (strata_jax/_src/program_order.py): every device starts its strata
calls in the same order, whatever XLA's thunk executor would do. Checked on the lowered program
(each call takes the previous call's Done, each op id is a call's own) and on values equal to
jax.lax's, through nested jits, conds, loops, shard_map regions, custom_jvp/vjp and the other
higher-order primitives."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    mesh1d,
    mesh2d,
    random_array,
    unordered_strata_calls,
)
from jax import custom_batching
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import strata_jax as sj


def per_rank(body):
    """Body over the per-rank block [1, *shape] -> strips and restores the rank axis."""
    return lambda v: jax.tree_util.tree_map(lambda o: o[None], body(v[0]))


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


def test_program_order_setting_is_checked(monkeypatch):
    """A STRATA_PROGRAM_ORDER other than 1, 0 or unset is an error that says what to use."""
    monkeypatch.setenv("STRATA_PROGRAM_ORDER", "true")
    f = jax.jit(
        jax.shard_map(lambda a: sj.psum(a, "x"), mesh=mesh1d(2), in_specs=P("x"), out_specs=P("x"))
    )
    with pytest.raises(ValueError, match="STRATA_PROGRAM_ORDER='true': use 1"):
        f.lower(np.ones(4, np.float32))
