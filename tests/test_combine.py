"""The all-reduce combiner of use_for_jax_lax() (combiner.py): JAX binds one all-reduce
per pytree leaf (and autodiff one per parameter); under use_for_jax_lax() a run of them over the
same axes is one strata call (strata_all_reduce_list), as XLA's combiner makes one all-reduce.

Oracle: the same jitted function without the context (XLA's collectives), bitwise, on fresh
random inputs. The number of strata calls is counted in the lowered HLO text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj

X, REPLICATED = P("x"), P()


def _smap(body, n=4, in_specs=X, out_specs=REPLICATED, **kw):
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


def _calls(text: str) -> int:
    """strata's all-reduce calls (strata_order, which orders calls around loops, not counted)."""
    return text.count("stablehlo.custom_call @strata_all_reduce")


def _both(f, *args):
    """(jax.lax's result, strata's result, strata calls in the lowered program, coverage)."""
    want = f(*args)
    with sj.use_for_jax_lax():
        got, text = f(*args), f.lower(*args).as_text()
    rec = sj.coverage()[-1]
    return want, got, _calls(text), rec


def _bitwise(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def _tree(rng, n=4):
    """Leaves of mixed dtypes (bool, bfloat16, int32, int4, float64, uint8)."""
    return {
        "w": jnp.asarray(rng.standard_normal((n * 3, 5)), jnp.bfloat16),
        "i": jnp.asarray(rng.integers(-1000, 1000, (n * 2,)), jnp.int32),
        "m": jnp.asarray(rng.integers(0, 2, (n, 3)).astype(bool)),
        "u": jnp.asarray(rng.integers(0, 255, (n, 2, 2)), jnp.uint8),
        "q": jnp.asarray(rng.integers(-3, 4, (n * 2,))).astype(jnp.int4),
        "s": jnp.asarray(rng.standard_normal((n,)), jnp.float64),
    }


@pytest.mark.parametrize("check_vma", [True, False])
def test_pytree_psum_of_mixed_dtypes_is_one_call(rng, check_vma):
    tree = _tree(rng)
    f = _smap(lambda t: jax.lax.psum(t, "x"), check_vma=check_vma)
    want, got, calls, rec = _both(f, tree)
    _bitwise(got, want)
    assert calls == 1
    assert rec.on_strata == 6 and rec.calls == 1 and rec.on_xla == 0, str(rec)
    assert "6 of 6 collectives on strata in 1 call" in str(rec)


def test_float16_combined_equals_one_call_per_leaf(rng, monkeypatch):
    """float16 sums accumulate in float32 and round once in strata's kernels, which XLA CPU
    does not (a difference of strata_jax.psum, combined or not): combined, each leaf is
    bitwise what its own strata call gives."""
    tree = [jnp.asarray(rng.standard_normal((4 * 8,)) * 4, jnp.float16) for _ in range(3)]
    f = _smap(lambda t: jax.lax.psum(t, "x"))
    got = {}
    for setting in ("0", ""):
        monkeypatch.setenv("STRATA_COMBINE_BYTES", setting)
        jax.clear_caches()
        with sj.use_for_jax_lax():
            got[setting], text = f(tree), f.lower(tree).as_text()
        assert _calls(text) == (3 if setting == "0" else 1)
    _bitwise(got[""], got["0"])


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_pytree_pmax_pmin_is_one_call(rng, op):
    tree = _tree(rng)
    f = _smap(lambda t: getattr(jax.lax, op)(t, "x"), check_vma=False)
    want, got, calls, _ = _both(f, tree)
    _bitwise(got, want)
    assert calls == 1


def test_pmean_of_gradients_and_the_implicit_pvary_transposes(rng):
    """A data-parallel step with check_vma: JAX's psum_invariant per parameter (transposes of
    the implicit pvary) and the pmean of the gradients: far fewer calls than all-reduces."""
    params = [jnp.asarray(rng.standard_normal((3, 3)), jnp.float32) for _ in range(6)]
    x = jnp.asarray(rng.standard_normal((4 * 2, 3)), jnp.float32)

    def step(ps, v):
        def loss(ps):
            h = v
            for p in ps:
                h = jnp.tanh(h @ p)
            return jnp.mean(h**2)

        grads = jax.lax.pmean(jax.grad(loss)(ps), "x")
        return [p - 0.1 * g for p, g in zip(ps, grads, strict=True)]

    f = _smap(step, in_specs=(P(), P("x")))
    want, got, calls, rec = _both(f, params, x)
    _bitwise(got, want)
    assert rec.on_strata == 12 and rec.on_xla == 0, str(rec)
    # The pmean reads the psum_invariants' results: two calls, not twelve.
    assert calls == rec.calls == 2, str(rec)


def test_dependent_all_reduces_are_not_merged(rng):
    """psum(a), then psum(f(psum(a))): the second needs the first's result, so two calls; an
    independent psum(b) whose operand is computed after a use of psum(a) still joins the
    first (the use moves after the combined call)."""
    a = jnp.asarray(rng.standard_normal((4 * 3,)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((4 * 3,)), jnp.float32)

    def body(a, b):
        s = jax.lax.psum(a, "x")
        t = jnp.sin(s) * 2  # uses the first result before the next psum
        u = jax.lax.psum(jnp.cos(b), "x")  # independent: joins the first call
        v = jax.lax.psum(t + a, "x")  # dependent: a call of its own
        return s, u, v

    f = _smap(body, in_specs=(P("x"), P("x")), out_specs=(P(), P(), P()), check_vma=False)
    want, got, calls, rec = _both(f, a, b)
    _bitwise(got, want)
    assert calls == rec.calls == 2 and rec.on_strata == 3, str(rec)
    # Against numpy too: the dependent value is right.
    s = np.asarray(a).reshape(4, 3).sum(0)
    np.testing.assert_allclose(got[2], np.sin(s) * 2 * 4 + s, rtol=1e-5, atol=1e-5)


def test_other_collectives_and_kinds_split_runs(rng):
    """A run ends at another collective (all_gather), at another kind (pmax) or other axes:
    psum, psum | all_gather | psum, psum | pmax | psum over ('x', 'y')."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    xs = [jnp.asarray(rng.standard_normal((4, 4)), jnp.float32) for _ in range(7)]

    def body(*v):
        a, b = jax.lax.psum((v[0], v[1]), "x")
        g = jax.lax.all_gather(v[2], "x")
        c, d = jax.lax.psum((v[2], v[3]), "x")
        m = jax.lax.pmax(v[4], "x")
        e = jax.lax.psum(v[5], "x")
        f = jax.lax.psum(v[6], ("x", "y"))
        return a, b, g, c, d, m, e, f

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("x", "y"), out_specs=P(None, "y"), check_vma=False
        )
    )
    want, got, calls, rec = _both(f, *xs)
    _bitwise(got, want)
    # [psum a, b] [all_gather] [psum c, d] [pmax] [psum e] [psum f over x, y]
    assert calls == 5 and rec.on_strata == 8 and rec.calls == 6, str(rec)


def test_size_cap_and_off(rng, monkeypatch):
    """STRATA_COMBINE_BYTES caps a call's operands (bytes per rank); 0 turns combining off."""
    leaves = [jnp.asarray(rng.standard_normal((4 * 256,)), jnp.float32) for _ in range(4)]
    f = _smap(lambda t: jax.lax.psum(t, "x"))
    want = f(leaves)
    for setting, expected in (("2K", 2), ("0", 4), ("1K", 4), ("", 1)):
        monkeypatch.setenv("STRATA_COMBINE_BYTES", setting)
        with sj.use_for_jax_lax():
            got, text = f(leaves), f.lower(leaves).as_text()
        _bitwise(got, want)
        assert _calls(text) == expected, setting
        jax.clear_caches()  # the setting is read at lowering, not part of jit's key
    monkeypatch.setenv("STRATA_COMBINE_BYTES", "lots")
    with sj.use_for_jax_lax(), pytest.raises(ValueError, match="STRATA_COMBINE_BYTES"):
        f.lower(leaves)


def test_nested_jit_and_scan_bodies_are_combined(rng):
    """The all-reduces inside a nested jax.jit and a scan body are combined in their own
    body."""
    tree = [jnp.asarray(rng.standard_normal((4 * 2, 3)), jnp.float32) for _ in range(3)]

    def body(t):
        inner = jax.jit(lambda u: jax.lax.psum(u, "x"))(t)

        def step(c, _):
            return jax.lax.psum([c[0] * 0.5, c[1], c[2]], "x"), None

        looped, _ = jax.lax.scan(step, t, None, length=2)
        return inner, looped

    f = _smap(body, out_specs=P(), check_vma=False)
    want, got, calls, rec = _both(f, tree)
    _bitwise(got, want)
    assert calls == 2 and rec.calls == 2, str(rec)


def test_nothing_is_rewritten_outside_the_context(rng):
    """Without use_for_jax_lax() nothing is rewritten: XLA's all-reduces, no strata call."""
    tree = _tree(rng)
    f = _smap(lambda t: jax.lax.psum(t, "x"))
    text = f.lower(tree).as_text()
    assert _calls(text) == 0 and "all_reduce" in text


def test_checkpoint_cond_and_pmap(rng):
    """Inside jax.checkpoint and each branch of a cond the all-reduces are combined too; under
    jax.pmap (which JAX runs as a shard_map) as well."""
    t = [jnp.asarray(rng.standard_normal((4 * 2, 3)), jnp.float32) for _ in range(3)]

    def body(t):
        a = jax.checkpoint(lambda u: jax.lax.psum(u, "x"))(t)
        uniform = jnp.sum(jax.lax.pmin(t[0], "x")) > 0  # the same branch on every device
        b = jax.lax.cond(uniform, lambda u: jax.lax.psum(u, "x"), lambda u: jax.lax.pmax(u, "x"), t)
        return a, b

    f = _smap(body, check_vma=False)
    want, got, calls, rec = _both(f, t)
    _bitwise(got, want)
    # checkpoint: 1; the pmin: 1; each branch: 1
    assert calls == 4 and rec.on_strata == 10 and rec.calls == 4, str(rec)

    pm = jax.pmap(lambda u: jax.lax.psum(u, "i"), axis_name="i", devices=jax.devices()[:4])
    x = [t[0].reshape(4, 2, 3), jnp.asarray(rng.integers(-9, 9, (4, 5)), jnp.int32)]
    want = pm(x)
    with sj.use_for_jax_lax():
        got = pm(x)
    _bitwise(got, want)
    rec = sj.coverage()[-1]
    assert rec.on_strata == 2 and rec.calls == 1, str(rec)
