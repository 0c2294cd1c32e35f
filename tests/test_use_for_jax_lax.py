"""strata_jax.use_for_jax_lax() / enable() / disable(): unmodified JAX code runs on strata.

Oracle: the same function lowered without the context (XLA's collectives) on the same fresh
random input. The lowered HLO shows strata's custom calls inside the context and none outside.
The hook is the CPU lowering of JAX's collective primitives (lax_hooks.py), so the jaxpr is
JAX's own and collectives JAX emits itself, or that were bound to other names, are caught too.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax._src import lax_hooks


def _mesh1d():
    return Mesh(np.array(jax.devices()), ("x",))


X = P("x")


def _smap(body, mesh=None, in_specs=X, out_specs=X, **kw):
    return jax.jit(
        jax.shard_map(body, mesh=mesh or _mesh1d(), in_specs=in_specs, out_specs=out_specs, **kw)
    )


def _hlo(f, *args) -> str:
    return f.lower(*args).as_text()


def _both(f, *args):
    """(result with jax.lax, result on strata, HLO outside, HLO inside): one jitted function."""
    want, hlo_out = f(*args), _hlo(f, *args)
    with sj.use_for_jax_lax():
        got, hlo_in = f(*args), _hlo(f, *args)
    return want, got, hlo_out, hlo_in


def _mean_grad(g):
    return jax.lax.pmean(g, "x")  # library code written against jax.lax, unchanged


def test_unmodified_pmean_runs_on_strata(rng):
    x = jnp.asarray(rng.standard_normal((8, 32)).astype(np.float32))
    f = _smap(_mean_grad, out_specs=P())
    want, got, hlo_out, hlo_in = _both(f, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "strata_all_reduce" in hlo_in
    assert "strata_" not in hlo_out and "all-reduce" in hlo_out or "all_reduce" in hlo_out
    # Outside again: the jit cache key includes the setting, so jax.lax is back.
    assert "strata_" not in _hlo(f, x)


def test_optax_style_gradient_mean(rng):
    """An optax-like update: grads of a loss, tree-mapped jax.lax.pmean, an SGD step."""
    params = {
        "w": jnp.asarray(rng.standard_normal((4, 3)).astype(np.float32)),
        "b": jnp.asarray(rng.standard_normal((3,)).astype(np.float32)),
    }
    xs = jnp.asarray(rng.standard_normal((8 * 5, 4)).astype(np.float32))
    ys = jnp.asarray(rng.standard_normal((8 * 5, 3)).astype(np.float32))

    def step(p, x, y):
        loss = lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
        grads = jax.grad(loss)(p)
        grads = jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, axis_name="x"), grads)
        return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, grads)

    f = _smap(step, in_specs=(P(), P("x"), P("x")), out_specs=P())
    want, got, hlo_out, hlo_in = _both(f, params, xs, ys)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, want)
    assert hlo_in.count("strata_all_reduce") >= 2 and "strata_" not in hlo_out


PERM = [(i, (i + 3) % 8) for i in range(8)]
CASES = {
    "psum": (lambda a: jax.lax.psum(a, "x"), P()),
    "pmax": (lambda a: jax.lax.pmax(a, "x"), P()),
    "pmin": (lambda a: jax.lax.pmin(a, "x"), P()),
    "all_gather": (lambda a: jax.lax.all_gather(a, "x", axis=1), P("x")),
    "all_gather_tiled": (lambda a: jax.lax.all_gather(a, "x", tiled=True), P("x")),
    "all_gather_to_invarying": (
        lambda a: jax.lax.all_gather(a, "x", axis=0, tiled=True, to="invarying"),
        P(),
    ),
    "psum_scatter": (lambda a: jax.lax.psum_scatter(a, "x", tiled=True), P("x")),
    "all_to_all": (lambda a: jax.lax.all_to_all(a, "x", 0, 1, tiled=True), P("x")),
    "ppermute": (lambda a: jax.lax.ppermute(a, "x", PERM), P("x")),
}
TARGET = {"psum": "strata_all_reduce", "pmax": "strata_all_reduce", "pmin": "strata_all_reduce"}


@pytest.mark.parametrize("name", list(CASES))
def test_each_collective_matches_jax_lax(rng, name):
    body, out_specs = CASES[name]
    x = jnp.asarray(rng.standard_normal((8 * 8, 6)).astype(np.float32))
    want, got, hlo_out, hlo_in = _both(_smap(body, out_specs=out_specs), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "strata_" in hlo_in and "strata_" not in hlo_out
    if name in TARGET:
        assert TARGET[name] in hlo_in


def test_all_gather_to_invarying_gradient_is_a_slice(rng):
    """all_gather(to='invarying') transposes to a slice (jax.lax's all_gather_invariant)."""
    x = jnp.asarray(rng.standard_normal((8 * 2, 3)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((8 * 2, 3)).astype(np.float32))

    def loss(a):
        full = jax.lax.all_gather(a, "x", tiled=True, to="invarying")
        return jnp.sum(full * w)

    f = _smap(jax.grad(loss))
    want, got, _, _ = _both(f, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # no communication in either: a slice


def test_strata_all_gather_takes_to_keyword(rng):
    x = jnp.asarray(rng.standard_normal((8 * 2, 3)).astype(np.float32))
    for to in ("varying", "invarying"):
        spec = P("x") if to == "varying" else P()
        got = _smap(lambda a, to=to: sj.all_gather(a, "x", tiled=True, to=to), out_specs=spec)(x)
        lax_ag = lambda a, to=to: jax.lax.all_gather(a, "x", tiled=True, to=to)
        want = _smap(lax_ag, out_specs=spec)(x)
        np.testing.assert_array_equal(got, want)
    types = []

    def body(a):
        mine = sj.all_gather(a, "x", tiled=True, to="reduced")
        theirs = jax.lax.all_gather(a, "x", tiled=True, to="reduced")
        types.append((jax.typeof(mine), jax.typeof(theirs)))
        return a

    _smap(body)(x)
    assert types[0][0] == types[0][1] and "x" in types[0][0].mat.reduced
    with pytest.raises(ValueError, match="to="):
        _smap(lambda a: sj.all_gather(a, "x", to="sideways"))(x)


def _fallback(f, *args, cause: str):
    lax_hooks._warned.discard(next((c for c in lax_hooks._warned if cause in c), ""))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        want, got, _, hlo_in = _both(f, *args)
    msgs = [str(m.message) for m in w if "use_for_jax_lax" in str(m.message)]
    assert any(cause in m for m in msgs), msgs
    assert "strata_" not in hlo_in
    np.testing.assert_allclose(got, want, rtol=1e-6)
    return msgs


def test_axis_index_groups_falls_back_with_one_warning(rng):
    x = jnp.asarray(rng.standard_normal((8, 4)).astype(np.float32))
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    f = jax.pmap(lambda a: jax.lax.psum(a, "i", axis_index_groups=groups), axis_name="i")
    msgs = _fallback(f, x, cause="axis_index_groups")
    assert len(msgs) == 1  # once per cause, though traced twice (function and lowering)


def test_partly_automatic_shard_map_falls_back(rng):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jnp.asarray(rng.standard_normal((8, 4)).astype(np.float32))
    f = _smap(
        lambda a: jax.lax.psum(a, "a"), mesh=mesh, in_specs=P("a"), out_specs=P(), axis_names={"a"}
    )
    _fallback(f, x, cause="partly automatic")


def test_vmap_axis_name_is_a_local_reduction_neither_warned_nor_recorded(rng):
    """A psum over a vmap axis name is batched into a reduce over a positional axis: no
    communication, so nothing is warned and no collective is recorded."""
    x = jnp.asarray(rng.standard_normal((8, 3)).astype(np.float32))
    f = jax.jit(jax.vmap(lambda a: jax.lax.psum(a, "v"), axis_name="v"))
    before = len(sj.coverage())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want, got, _, hlo_in = _both(f, x)
    np.testing.assert_array_equal(got, want)
    assert "strata_" not in hlo_in and len(sj.coverage()) == before


def test_psum_over_a_mesh_axis_and_a_vmapped_axis(rng):
    """vmap inside shard_map, psum over both names: the vmapped axis is reduced on the device
    (JAX binds psum with a positional axis), the mesh axis on strata."""
    x = jnp.asarray(rng.standard_normal((8 * 3, 5)).astype(np.float32))
    body = jax.vmap(lambda a: jax.lax.psum(a, ("x", "v")), axis_name="v")
    f = _smap(lambda a: body(a.reshape(3, -1, 5)), out_specs=P(), check_vma=False)
    want, got, hlo_out, hlo_in = _both(f, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "strata_all_reduce" in hlo_in and "strata_" not in hlo_out


def test_pmap_runs_on_strata(rng):
    x = jnp.asarray(rng.standard_normal((8, 3)).astype(np.float32))
    f = jax.pmap(lambda a: jax.lax.pmean(a, "i"), axis_name="i")
    want, got, hlo_out, hlo_in = _both(f, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "strata_" in hlo_in and "strata_" not in hlo_out


def test_enable_disable_and_nesting(rng):
    x = jnp.asarray(rng.standard_normal((8, 3)).astype(np.float32))
    f = _smap(_mean_grad, out_specs=P())
    try:
        sj.enable()
        assert lax_hooks.is_enabled() and "strata_" in _hlo(f, x)
        with sj.use_for_jax_lax(False):
            assert "strata_" not in _hlo(f, x)
        assert "strata_" in _hlo(f, x)
    finally:
        sj.disable()
    assert not lax_hooks.is_enabled() and "strata_" not in _hlo(f, x)


def test_constants_and_names_bound_before():
    """A collective bound to another name before strata_jax was imported (``from jax.lax
    import psum`` in a module imported earlier) runs on strata too: the hook is JAX's
    primitive, not the jax.lax namespace. psum of a constant is the axis size (no call)."""
    from jax._src.lax.parallel import psum as bound_before

    f = _smap(lambda a: a * jax.lax.psum(1, "x") + bound_before(a, "x"))
    x = jnp.ones((8, 2), jnp.float32)
    with sj.use_for_jax_lax():
        np.testing.assert_allclose(f(x), np.full((8, 2), 16.0))
        hlo = _hlo(f, x)
    assert hlo.count("@strata_all_reduce(") == 1 and 'all_reduce"' not in hlo


def test_all_gather_to_invarying_over_axis_tuples(rng):
    """to='invarying' over one axis of a 3-axis mesh and over a pair of axes (axis=-1)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("x", "y", "z"))
    a = jnp.asarray(rng.standard_normal((4, 8)).astype(np.float32))

    def body(v):
        c = jax.lax.all_gather(v, "z", axis=0, tiled=True, to="invarying")
        d = jax.lax.all_gather(v, ("x", "y"), axis=-1, tiled=True, to="invarying")
        assert jax.typeof(c).mat.varying == {"x", "y"}
        assert jax.typeof(d).mat.varying == {"z"}
        return c, d

    f = _smap(
        body, mesh=mesh, in_specs=(P("z", ("x", "y")),), out_specs=(P(None, ("x", "y")), P("z"))
    )
    (want_c, want_d), (got_c, got_d), _, hlo_in = _both(f, a)
    np.testing.assert_array_equal(got_c, want_c)
    np.testing.assert_array_equal(got_d, want_d)
    assert "strata_all_gather" in hlo_in and 'all_gather"' not in hlo_in


def test_psum_of_unreduced_input_runs_on_jax_lax(rng):
    """A matmul left unreduced over 'x' by the partitioner, summed in a shard_map: jax.lax's
    unreduced psum (strata has no such type), with or without use_for_jax_lax."""
    from jax.sharding import AxisType, NamedSharding

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    x = rng.standard_normal((2, 4)).astype(np.float32)
    y = rng.standard_normal((4, 6)).astype(np.float32)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
        ys = jax.device_put(y, NamedSharding(mesh, P("x", None)))

        def total(a, b, psum):
            z = jnp.einsum("ab,bc->ac", a, b, out_sharding=P(unreduced={"x"}))
            ar = jax.shard_map(lambda v: psum(v, "x"), in_specs=P(unreduced={"x"}), out_specs=P())
            return ar(z).sum()

        want = jax.jit(lambda a, b: total(a, b, jax.lax.psum))(xs, ys)
        direct = jax.jit(lambda a, b: total(a, b, sj.psum))(xs, ys)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with sj.use_for_jax_lax():
                patched = jax.jit(lambda a, b: total(a, b, jax.lax.psum))(xs, ys)
    # The total of a random product cancels (it can lie near 0), so the tolerance is scaled by
    # the sum of magnitudes, float32's rounding of a 2x4x6 contraction, not by the result itself.
    scale = float(np.abs(x.astype(np.float64) @ y.astype(np.float64)).sum())
    np.testing.assert_allclose(want, np.sum(x.astype(np.float64) @ y), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(direct, want, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(patched, want, rtol=0, atol=1e-6 * scale)


def test_psum_in_scan_jaxpr_is_jax_own(rng):
    """Inside lax.scan: same values, strata's call in the HLO, and the jaxpr is JAX's own
    (psum_invariant both ways): only the lowering changes."""

    def body(x):
        def g(c, _):
            return jax.lax.pcast(jax.lax.psum(c, "x"), "x", to="varying") * 0.5, None

        return jax.lax.scan(g, x, None, length=2)[0]

    x = jnp.asarray(rng.standard_normal((8, 4)).astype(np.float32))
    f = _smap(body)
    want, got, _, hlo_in = _both(f, x)
    np.testing.assert_array_equal(got, want)
    assert "strata_all_reduce" in hlo_in
    with sj.use_for_jax_lax():
        inside = str(jax.make_jaxpr(f)(x))
    assert inside == str(jax.make_jaxpr(f)(x)) and "psum_invariant" in inside


def test_unbound_axis_name_raises_as_in_jax_without_fallback_warning():
    """A typo in an axis name inside the context: the error JAX raises without strata (the
    jaxpr is JAX's, traced by JAX), and no fallback warning."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    f = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "y"), mesh=mesh, in_specs=P("x"), out_specs=P())
    )
    with pytest.raises(Exception) as outside:
        f(jnp.ones(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sj.use_for_jax_lax(), pytest.raises(type(outside.value)):
            f(jnp.ones(4))


def _mesh2x4():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def _many_collectives(v):
    """Every collective primitive of JAX that a shard_map body can emit, over one or two axes
    of a 2x4 mesh, dimensions other than the first included."""
    ag_untiled = jax.lax.all_gather(v, "b", axis=1)
    ag_pair = jax.lax.all_gather(v, ("a", "b"), axis=2, tiled=True)
    rs_tiled = jax.lax.psum_scatter(v, "b", scatter_dimension=1, tiled=True)
    rs_untiled = jax.lax.psum_scatter(v[:, :4], "b", scatter_dimension=1)
    a2a = jax.lax.all_to_all(v, "b", 1, 0, tiled=True)
    a2a_untiled = jax.lax.all_to_all(v[:, :4], ("b",), 1, 2)
    perm = jax.lax.ppermute(v, ("a", "b"), [(i, (i + 5) % 8) for i in range(8)])
    inv = jax.lax.all_gather(v, "a", axis=2, tiled=True, to="invarying")
    mx = jax.lax.pmax(v, ("a", "b"))
    mn = jax.lax.pmin(v, "a")
    total = jax.lax.psum(v, ("b", "a"))
    return ag_untiled, ag_pair, rs_tiled, rs_untiled, a2a, a2a_untiled, perm, inv, mx, mn, total


def test_every_collective_primitive_bitwise_and_recorded(rng):
    """One program with every collective primitive over a 2x4 mesh: bitwise what XLA gives,
    each one a strata call, and the coverage record says so (nothing left on XLA)."""
    mesh = _mesh2x4()
    f = jax.jit(
        jax.shard_map(
            _many_collectives, mesh=mesh, in_specs=P("a", "b"), out_specs=P(), check_vma=False
        )
    )
    x = jnp.asarray(rng.standard_normal((2 * 4, 4 * 8, 3)).astype(np.float32))
    want, got, hlo_out, hlo_in = _both(f, x)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    assert "strata_" not in hlo_out
    rec = [r for r in sj.coverage() if r.program == "jit__many_collectives"][-1]
    assert rec.on_xla == 0 and rec.on_strata == 11, str(rec)
    assert hlo_in.count("stablehlo.custom_call @strata_") == 11
    for op in ("all_gather", "reduce_scatter", "all_to_all", "collective_permute", "all_reduce"):
        assert f"stablehlo.{op}" not in hlo_in


def _grad_program(loss, check_vma=True):
    return jax.jit(
        jax.shard_map(
            jax.grad(loss),
            mesh=_mesh2x4(),
            in_specs=(P(), P("a", "b")),
            out_specs=P(),
            check_vma=check_vma,
        )
    )


def test_gradients_of_collectives_bitwise_with_check_vma(rng):
    """jax.grad through all_gather, psum_scatter, all_to_all, ppermute and psum with
    check_vma on: the transposes JAX emits run on strata and match XLA bitwise."""
    w = jnp.asarray(rng.standard_normal((12, 8)).astype(np.float32))

    def loss(p, v):
        h = jax.lax.all_gather(v * p[0, 0], "b", axis=0, tiled=True).reshape(4, 12) @ p
        h = jax.lax.psum_scatter(h, "b", scatter_dimension=0, tiled=True)
        h = jax.lax.ppermute(h, "a", [(0, 1), (1, 0)]) + jax.lax.all_to_all(
            h, "b", 1, 1, tiled=True
        )
        return jax.lax.psum(jnp.sum(h**2), ("a", "b"))

    x = jnp.asarray(rng.standard_normal((2 * 4, 4 * 3)).astype(np.float32))
    want, got, _, hlo_in = _both(_grad_program(loss), w, x)
    np.testing.assert_array_equal(got, want)
    assert "stablehlo.all_reduce" not in hlo_in and "stablehlo.reduce_scatter" not in hlo_in


def test_gradient_through_all_gather_of_a_non_leading_dimension_bitwise(rng):
    """all_gather(axis=1) before a dot: its transpose is psum_scatter(scatter_dimension=1),
    which strata runs in place (no transpose for XLA to fold into the dot)."""
    w = jnp.asarray(rng.standard_normal((12, 8)).astype(np.float32))

    def loss(p, v):
        h = jax.lax.all_gather(v, "b", axis=1, tiled=True) @ p
        return jax.lax.psum(jnp.sum(h**2), ("a", "b"))

    x = jnp.asarray(rng.standard_normal((2 * 4, 4 * 3)).astype(np.float32))
    want, got, _, _ = _both(_grad_program(loss), w, x)
    np.testing.assert_array_equal(got, want)


def test_pbroadcast_runs_on_cpu_only_through_strata(rng):
    """jax.lax.pbroadcast has no CPU lowering in JAX; under use_for_jax_lax it is strata's
    broadcast, equal to the documented equivalent (psum of x masked to the source)."""
    x = jnp.asarray(rng.standard_normal((8 * 2, 3)).astype(np.float32))
    f = _smap(lambda a: jax.lax.pbroadcast(a, "x", 5))
    with pytest.raises(NotImplementedError, match="pbroadcast"):
        f(x)
    with sj.use_for_jax_lax():
        got = f(x)
    np.testing.assert_array_equal(got, np.tile(np.asarray(x)[10:12], (8, 1)))


@pytest.mark.parametrize("dtype", ["int4", "float8_e4m3fn"])
def test_narrow_dtypes_travel_widened(rng, dtype):
    """int4/float8 gathers and permutes are exact; psum is strata_jax.psum's (widened, one
    rounding)."""
    vals = rng.integers(-3, 4, size=(8 * 2, 4))
    x = jnp.asarray(vals).astype(dtype)
    body = lambda a: (  # noqa: E731
        jax.lax.all_gather(a, "x", tiled=True),
        jax.lax.ppermute(a, "x", PERM),
        jax.lax.psum(a, "x"),
    )
    f = _smap(body, out_specs=(P(), P("x"), P()), check_vma=False)
    want, got, _, hlo_in = _both(f, x)
    direct = _smap(lambda a: sj.psum(a, "x"), out_specs=P(), check_vma=False)(x)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(direct, np.float32))
    assert hlo_in.count("@strata_") == 3


def test_coverage_names_what_stayed_on_xla_and_why(rng, capfd, monkeypatch):
    """A pmap with an axis_index_groups psum and a plain psum: coverage() has one on strata and
    one on XLA with the reason, its line says so, and STRATA_DEBUG=INFO logs the one that
    stayed."""
    monkeypatch.setenv("STRATA_DEBUG", "INFO")
    x = jnp.asarray(rng.standard_normal((8, 3)).astype(np.float32))

    def both_kinds(a):
        return jax.lax.psum(a, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]) + jax.lax.psum(
            a, "i"
        )

    f = jax.pmap(both_kinds, axis_name="i")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want, got, _, _ = _both(f, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    rec = sj.coverage()[-1]  # a pmap's program is named jit__fun by JAX
    assert rec.strata == {"psum": 1}, str(rec)
    assert rec.xla == {"psum": {"axis_index_groups is given (strata groups are mesh axes)": 1}}
    line = str(rec)
    assert "1 of 2 collectives on strata" in line and "axis_index_groups" in line
    err = capfd.readouterr().err
    assert "jit__fun: psum stays on XLA: axis_index_groups" in err


def test_jax_lax_ragged_all_to_all_runs_on_strata(rng):
    """jax.lax.ragged_all_to_all (which XLA's CPU backend cannot run) under the context: the
    same result as strata_jax.ragged_all_to_all."""
    x = jnp.asarray(rng.standard_normal((4 * 4, 2)).astype(np.float32))

    def body(ragged):
        def f(v):
            me = jax.lax.axis_index("x").astype(jnp.int32)
            k = jnp.arange(4, dtype=jnp.int32)
            ones = jnp.ones(4, jnp.int32)
            return ragged(v, jnp.zeros_like(v), k, ones, jnp.full(4, me), ones, axis_name="x")

        return _smap(f, mesh=Mesh(np.array(jax.devices()[:4]), ("x",)))

    want = body(sj.ragged_all_to_all)(x)
    with sj.use_for_jax_lax():
        got = body(jax.lax.ragged_all_to_all)(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.asarray(got).reshape(4, 4, 2).transpose(1, 0, 2), x.reshape(4, 4, 2)
    )


def test_ppermute_named_out_of_mesh_order_follows_the_running_jax(rng):
    """jax.lax.ppermute over ("b", "a") of an ("a", "b") mesh under use_for_jax_lax() does what
    the running release's jax.lax does: JAX 0.10 indexes the group in mesh order, 0.11.1+
    raises unless jax_raise_on_ppermute_sort_diff is off, then indexes it in the order named
    (as strata_jax.ppermute always does)."""
    from _util import ppermute_reference

    from strata_jax._src import jax_compat

    mesh = _mesh2x4()
    perm = [(i, (i + 3) % 8) for i in range(7)]
    x = jnp.asarray(rng.standard_normal((8, 5)).astype(np.float32))
    spec = P(("a", "b"))
    f = _smap(lambda v: jax.lax.ppermute(v, ("b", "a"), perm), mesh, spec, spec)
    order = jax_compat.jax_ppermute_order()
    if order == "mesh":
        want, got, _, hlo_in = _both(f, x)
        np.testing.assert_array_equal(got, want)
        assert "strata_ppermute" in hlo_in
        return
    assert order == "raise"
    with sj.use_for_jax_lax(), pytest.raises(RuntimeError, match="same order"):
        f(x)
    with jax_compat.config.raise_on_ppermute_sort_diff(False):
        want, got, _, hlo_in = _both(f, x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ppermute_reference(np.asarray(x), ("b", "a"), perm))
    assert "strata_ppermute" in hlo_in
