"""A pytree is one collective call, and psum_scatter/all_gather work in place over any dimension.

- psum/pmean/pmax/pmin of a pytree (leaves of mixed shapes and dtypes, 0-d and zero-size leaves
  included) is one ``strata_all_reduce_list`` custom call with one operand per leaf (one
  rendezvous), bitwise equal to jax.lax, through grad, jvp, vmap, cond and scan, with check_vma on
  and off, one-shot and two-shot.
- psum_scatter / all_gather over a non-leading dimension (tiled and untiled) write their blocks in
  place: the compiled program has no transpose or copy, and an FSDP+TP step (dot, then
  psum_scatter over a non-leading dimension, with gradients) is bitwise equal to jax.lax.

The cross-process check of the pytree call is in test_multiprocess.py (check_pytree.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import mesh1d, mesh2d, random_array
from jax.sharding import PartitionSpec as P

import strata_jax as sj

N = 4  # devices: enough for two-shot (more than 2 ranks), few for a fast test

# Per-device leaf shapes and dtypes: 0-d, zero-size, odd sizes, several dtypes.
LEAVES = [
    ((), "float32"),
    ((3, 5), "bfloat16"),
    ((0, 4), "float32"),
    ((7,), "int32"),
    ((2, 3, 4), "float64"),
    ((33,), "float16"),
    ((1000,), "float32"),
    ((5,), "bool"),
    ((4, 1), "complex64"),
    ((129,), "uint8"),
    ((0,), "int64"),
    ((2, 2), "int8"),
]


def _tree(rng, n_leaves: int, dtypes_ok=None):
    picked = [
        (s, d) for s, d in LEAVES if dtypes_ok is None or jnp.issubdtype(jnp.dtype(d), dtypes_ok)
    ][:n_leaves]
    return {f"l{i:02d}": random_array(rng, (N, *s), d) for i, (s, d) in enumerate(picked)}


def _run(op, tree, check_vma=True, mesh=None):
    """op(tree) per device, each leaf's leading axis split over the devices (kept as size 1)."""
    mesh = mesh or mesh1d(N)
    f = jax.jit(
        jax.shard_map(
            lambda t: op(t), mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma
        )
    )
    return f(tree), f


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for k, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        if x.dtype == np.float16:
            # strata sums float16 in float32 and rounds once (as bfloat16); XLA CPU rounds each
            # partial sum of float16 to float16 (documented in psum's docstring).
            np.testing.assert_allclose(
                x.astype(np.float32), y.astype(np.float32), rtol=4e-3 * N, atol=1e-2
            )
            continue
        assert x.tobytes() == y.tobytes(), f"leaf {k} ({x.dtype}{x.shape}) differs"


@pytest.mark.parametrize("n_leaves", [1, 2, 12])
@pytest.mark.parametrize("check_vma", [True, False])
def test_psum_of_a_pytree_is_one_call_bitwise_equal_to_jax_lax(rng, n_leaves, check_vma):
    tree = _tree(rng, n_leaves)
    # Leading axis of size 1 per device: the leaves keep their own shapes (0-d stays 0-d).
    strip = lambda t: jax.tree.map(lambda v: v[0], t)  # noqa: E731
    wrap = lambda t: jax.tree.map(lambda v: v[None], t)  # noqa: E731
    got, f = _run(lambda t: wrap(sj.psum(strip(t), "x")), tree, check_vma)
    want, _ = _run(lambda t: wrap(jax.lax.psum(strip(t), "x")), tree, check_vma)
    _assert_bitwise(got, want)
    hlo = f.lower(tree).as_text()
    # One call for the whole pytree (bool leaves are summed as int32 in the same call).
    assert hlo.count("stablehlo.custom_call @strata_all_reduce") == 1, hlo
    assert ("strata_all_reduce_list" in hlo) == (n_leaves > 1), hlo


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("op", ["pmean", "pmax", "pmin"])
def test_other_reductions_of_a_pytree(rng, op, two_shot):
    tree = _tree(rng, 8, dtypes_ok=jnp.floating if op == "pmean" else jnp.number)
    if op != "pmean":
        tree = {k: v for k, v in tree.items() if not jnp.issubdtype(v.dtype, jnp.complexfloating)}
    old = sj.get_two_shot_threshold()
    sj.set_two_shot_threshold(0 if two_shot else 1 << 40)
    try:
        before = sj.comm_stats()
        got, _ = _run(lambda t: getattr(sj, op)(t, "x"), tree)
        jax.block_until_ready(got)  # the counters move when the devices run the call
        after = sj.comm_stats()
        want, _ = _run(lambda t: getattr(jax.lax, op)(t, "x"), tree)
    finally:
        sj.set_two_shot_threshold(old)
    _assert_bitwise(got, want)
    # The list call took the algorithm asked for (it was one-shot whatever the threshold: the
    # list's outputs are published per operand, which the two-shot test did not look at).
    algo = "two_shot_all_reduce" if two_shot else "one_shot_all_reduce"
    assert after.get(algo, 0) > before.get(algo, 0), (before, after)


def _loss(ops, params, x, check_vma=True):
    """Data-parallel loss of a tiny two-layer model: the gradient all-reduce is a pytree psum."""

    def body(p, xb):
        h = jnp.tanh(xb @ p["w1"] + p["b1"])
        out = h @ p["w2"] + p["b2"]
        loss = jnp.mean(out**2) + jnp.sum(p["scale"] ** 2)
        return ops.pmean(loss, "x")

    return jax.shard_map(
        body, mesh=mesh1d(N), in_specs=(P(), P("x")), out_specs=P(), check_vma=check_vma
    )(params, x)


def _params(rng):
    return {
        "w1": rng.standard_normal((6, 5)).astype(np.float32),
        "b1": rng.standard_normal((5,)).astype(np.float32),
        "w2": rng.standard_normal((5, 3)).astype(np.float32),
        "b2": np.zeros((3,), np.float32),
        "scale": np.float32(0.5),
    }


@pytest.mark.parametrize("check_vma", [True, False])
def test_grads_of_a_data_parallel_step(rng, check_vma):
    params, x = _params(rng), rng.standard_normal((N * 4, 6)).astype(np.float32)

    def grads(ops):
        def step(p, xb):
            def body(p, xb):
                g = jax.grad(
                    lambda p: (
                        jnp.mean((jnp.tanh(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) ** 2)
                        + jnp.sum(p["scale"] ** 2)
                    )
                )(p)
                return ops.pmean(g, "x")  # the gradient all-reduce: one call for 5 leaves

            return jax.shard_map(
                body, mesh=mesh1d(N), in_specs=(P(), P("x")), out_specs=P(), check_vma=check_vma
            )(p, xb)

        return jax.jit(step)

    _assert_bitwise(grads(sj)(params, x), grads(jax.lax)(params, x))
    hlo = grads(sj).lower(params, x).as_text()
    assert hlo.count("stablehlo.custom_call @strata_all_reduce_list") == 1, hlo
    # Through the transposes: grad of the loss whose pmean is of a pytree (psum in the forward).
    g_s = jax.jit(jax.grad(lambda p: _loss(sj, p, x, check_vma)))(params)
    g_x = jax.jit(jax.grad(lambda p: _loss(jax.lax, p, x, check_vma)))(params)
    _assert_bitwise(g_s, g_x)


def test_grad_jvp_and_vmap_through_a_pytree_psum(rng):
    a = rng.standard_normal((N, 3)).astype(np.float32)
    b = rng.standard_normal((N * 2, 5)).astype(np.float32)

    def f(ops, a, b):
        def body(a, b):
            out = ops.psum({"a": a * a, "b": jnp.sin(b), "c": a[:, :1] * b[:1]}, "x")
            return jnp.sum(out["a"]) + jnp.sum(out["b"] ** 2) + jnp.sum(out["c"])

        return jax.shard_map(body, mesh=mesh1d(N), in_specs=P("x"), out_specs=P())(a, b)

    for trans in (
        lambda g: jax.grad(g, argnums=(0, 1)),
        lambda g: lambda a, b: jax.jvp(g, (a, b), (jnp.ones_like(a), jnp.cos(b))),
    ):
        got = jax.jit(trans(lambda a, b: f(sj, a, b)))(a, b)
        want = jax.jit(trans(lambda a, b: f(jax.lax, a, b)))(a, b)
        _assert_bitwise(got, want)

    # vmap inside shard_map over a batch axis of the leaves (one call for the whole batch).
    c = rng.standard_normal((N, 7, 3)).astype(np.float32)

    def g(ops, c):
        def body(c):
            inner = jax.vmap(lambda r: ops.psum((r, r * 2, r[0]), "x"), in_axes=1, out_axes=1)(c)
            return inner[0] + inner[1] + inner[2][:, :, None]

        return jax.jit(jax.shard_map(body, mesh=mesh1d(N), in_specs=P("x"), out_specs=P("x")))(c)

    _assert_bitwise(g(sj, c), g(jax.lax, c))
    # vmap over a named axis that the psum reduces (no mesh): the batch dimension is summed.
    t = {"a": c, "b": c[:, 0, 0]}
    _assert_bitwise(
        jax.vmap(lambda t: sj.psum(t, "i"), axis_name="i")(t),
        jax.vmap(lambda t: jax.lax.psum(t, "i"), axis_name="i")(t),
    )


def test_pytree_psum_in_cond_and_scan(rng):
    x = rng.standard_normal((N * 3, 4)).astype(np.float32)

    def f(ops, x):
        def body(x):
            def step(carry, _):
                t = ops.psum({"c": carry, "s": carry[0, 0], "h": carry.astype(jnp.bfloat16)}, "x")
                return carry + t["c"] * 0.25 + t["s"] + t["h"].astype(jnp.float32), t["s"]

            y, ys = jax.lax.scan(step, x, None, length=3)
            z = jax.lax.cond(
                ys[0] > 0,
                lambda v: ops.psum((v, -v), "x")[0],
                lambda v: ops.psum((v * 2, v), "x")[1],
                y,
            )
            return z

        return jax.jit(jax.shard_map(body, mesh=mesh1d(N), in_specs=P("x"), out_specs=P("x")))(x)

    _assert_bitwise(f(sj, x), f(jax.lax, x))


def _no_layout_change(compiled: str) -> None:
    for op in (" transpose(", " copy(", "copy-start", "transpose_fusion"):
        assert op not in compiled, f"found {op.strip()} in the compiled program:\n{compiled}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float64"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("tiled", [True, False])
def test_psum_scatter_and_all_gather_in_place_over_a_non_leading_dim(rng, dtype, dim, tiled):
    shape = [2, 3 * N, 2 * N]
    if not tiled:
        shape[dim] = N
    x = random_array(rng, (N * 2, *shape[1:]), dtype)
    mesh = mesh1d(N)

    def run(op, **kw):
        f = jax.jit(
            jax.shard_map(lambda v: op(v, "x", **kw), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        )
        return np.asarray(f(x)), f.lower(x).compile().as_text()

    got, hlo = run(sj.psum_scatter, scatter_dimension=dim, tiled=tiled)
    want, _ = run(jax.lax.psum_scatter, scatter_dimension=dim, tiled=tiled)
    _assert_bitwise(got, want)
    assert "strata_psum_scatter_rows" in hlo
    _no_layout_change(hlo)
    got, hlo = run(sj.all_gather, axis=dim, tiled=tiled)
    want, _ = run(jax.lax.all_gather, axis=dim, tiled=tiled)
    _assert_bitwise(got, want)
    _no_layout_change(hlo)
    if dtype == "float32":  # JAX's own primitives under use_for_jax_lax take the same calls
        for op, kw, target in (
            (jax.lax.psum_scatter, {"scatter_dimension": dim}, "strata_psum_scatter_rows"),
            (jax.lax.all_gather, {"axis": dim}, "strata_all_gather_rows"),
        ):
            want, _ = run(op, tiled=tiled, **kw)
            with sj.use_for_jax_lax():
                got, hlo = run(op, tiled=tiled, **kw)
            assert target in hlo
            _no_layout_change(hlo)
            _assert_bitwise(got, want)


def test_fsdp_tp_step_is_bitwise_equal_to_jax_lax(rng):
    """The FSDP+TP pattern of JAX's shard_map tutorial: weights sharded over 'a' (FSDP,
    all_gather before use) and 'b' (tensor parallel); the activations' partial sums are
    psum_scatter'ed over the feature dimension (not the leading one); loss and gradients."""
    mesh = mesh2d(2, 2)
    B, D, H = 8, 8, 16
    x = rng.standard_normal((B, D)).astype(np.float32)
    w1 = (rng.standard_normal((D, H)) / 3).astype(np.float32)
    w2 = (rng.standard_normal((H, D)) / 3).astype(np.float32)

    def loss(ops, w1, w2, x):
        def body(w1, w2, x):
            w1 = ops.all_gather(w1, "a", axis=0, tiled=True)  # FSDP: [D, H/b]
            h = jnp.tanh(x @ w1)  # [B/a, H/b]
            w2 = ops.all_gather(w2, "a", axis=1, tiled=True)  # [H/b, D]
            y = ops.psum_scatter(h @ w2, "b", scatter_dimension=1, tiled=True)  # [B/a, D/b]
            return ops.pmean(jnp.sum(y**2), ("a", "b"))

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("a", "b"), P("b", "a"), P("a", None)),
            out_specs=P(),
        )(w1, w2, x)

    f_s = jax.jit(jax.value_and_grad(lambda *a: loss(sj, *a), argnums=(0, 1)))
    f_x = jax.jit(jax.value_and_grad(lambda *a: loss(jax.lax, *a), argnums=(0, 1)))
    _assert_bitwise(f_s(w1, w2, x), f_x(w1, w2, x))
    compiled = f_s.lower(w1, w2, x).compile().as_text()
    assert "strata_psum_scatter_rows" in compiled and "strata_all_gather_rows" in compiled
    assert " all-reduce(" not in compiled and " reduce-scatter(" not in compiled


def test_pytree_psum_across_fake_fabrics_falls_back_per_leaf(monkeypatch, rng):
    """A group that spans fabric domains takes the hierarchical all-reduce (hierarchy/), one
    leaf at a time: values as jax.lax, with gradients."""
    from jax.sharding import Mesh

    from strata_jax._src import topology

    monkeypatch.setattr(topology, "_map", topology.FabricMap(("a", "b"), 0))
    monkeypatch.setattr(topology, "fabric_of_device", lambda d: d.id // 2)
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[:4]), ("x",))
    tree = {"a": rng.standard_normal((8, 5)).astype(np.float32), "b": np.arange(4, dtype=np.int32)}

    def f(ops, t):
        def body(t):
            out = ops.psum({"a": t["a"] ** 2, "b": t["b"]}, "x")
            return jnp.sum(out["a"]) + jnp.sum(out["b"]).astype(jnp.float32)

        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(t)

    got = jax.jit(jax.value_and_grad(lambda a: f(sj, {"a": a, "b": tree["b"]})))(tree["a"])
    want = jax.jit(jax.value_and_grad(lambda a: f(jax.lax, {"a": a, "b": tree["b"]})))(tree["a"])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    hlo = jax.jit(lambda a: f(sj, {"a": a, "b": tree["b"]})).lower(tree["a"]).as_text()
    assert "strata_all_reduce_list" not in hlo
