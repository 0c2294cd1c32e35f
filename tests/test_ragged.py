"""strata_jax.ragged_all_to_all against a numpy oracle of jax.lax's documented semantics.

Fresh random plans (gaps, empty slices, several slices per peer) in several dtypes and sizes,
gradients (the transpose is the reverse ragged exchange), vmap, axis_index_groups, the cases
of JAX's own tests/ragged_collective_test.py (v0.10.2; inputs and expected values restated
here), run-time errors, and one case across processes under the launcher.
"""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from ragged_reference import ragged_grad_reference, ragged_reference, random_plan

import strata_jax as sj


def _mesh(n: int, name: str = "x") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


@cache
def _exchange_fn(mesh, groups, axis, check_vma):
    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(axis),) * 6,
        out_specs=P(axis),
        check_vma=check_vma,
    )
    def f(a, b, c, d, e, g):
        return sj.ragged_all_to_all(
            a[0], b[0], c[0], d[0], e[0], g[0], axis_name=axis, axis_index_groups=groups
        )[None]

    return f


def _ragged(mesh, *stacked, groups=None, axis="x", check_vma=True):
    """Runs strata's ragged_all_to_all with rank j's arguments = stacked[...][j] (one jitted
    function per mesh and groups: repeated shapes reuse the compiled program)."""
    return _exchange_fn(mesh, groups, axis, check_vma)(*stacked)


def _random_case(rng, n, per, max_rows, trailing, dtype, groups=None):
    n_rows, m_rows, io, ss, oo, rs = random_plan(rng, n, per, max_rows, groups=groups)
    dt = jnp.dtype(dtype)
    shape_in, shape_out = (n, n_rows, *trailing), (n, m_rows, *trailing)
    if jnp.issubdtype(dt, jnp.floating):
        operand = rng.standard_normal(shape_in).astype(dt)
        output = rng.standard_normal(shape_out).astype(dt)
    else:
        operand = rng.integers(-100, 100, shape_in).astype(dt)
        output = rng.integers(-100, 100, shape_out).astype(dt)
    return operand, output, io, ss, oo, rs


@pytest.mark.parametrize(
    "n,per,max_rows,trailing,dtype,idx_dtype",
    [
        (8, 1, 5, (3,), "float32", "int32"),
        (8, 2, 4, (), "int32", "int64"),
        (4, 3, 3, (2, 5), "bfloat16", "int32"),
        (2, 1, 70, (33,), "float64", "int32"),
        (8, 1, 300, (64,), "float32", "int32"),  # 76 KiB rows per slice: chunked copies
        (3, 2, 2, (4,), "int8", "uint32"),
    ],
)
def test_matches_numpy(rng, n, per, max_rows, trailing, dtype, idx_dtype):
    operand, output, io, ss, oo, rs = _random_case(rng, n, per, max_rows, trailing, dtype)
    want = ragged_reference(operand, output, io, ss, oo, rs)
    plan = [a.astype(idx_dtype) for a in (io, ss, oo, rs)]
    got = _ragged(_mesh(n), operand, output, *plan)
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_back_to_back_fresh_inputs(rng):
    """Reuse: one jitted exchange, many calls with fresh data and plans of one shape."""
    n, mesh = 8, _mesh(8)
    for _ in range(30):
        # fixed N, M by padding every case to the same bound
        operand, output, io, ss, oo, rs = _random_case(rng, n, 1, 6, (5,), "float32")
        pad = (
            lambda a, rows: np.concatenate(  # noqa: E731
                [a, np.zeros((n, rows - a.shape[1], *a.shape[2:]), a.dtype)], axis=1
            )
        )
        operand, output = pad(operand, 60), pad(output, 60)
        want = ragged_reference(operand, output, io, ss, oo, rs)
        got = _ragged(mesh, operand, output, *(a.astype(np.int32) for a in (io, ss, oo, rs)))
        np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_grad_against_numpy(rng):
    """loss = sum(W * result): d operand = W at the rows each slice landed; d output = W on
    the rows not received, zero on the received ones."""
    n, mesh = 4, _mesh(4)
    operand, output, io, ss, oo, rs = _random_case(rng, n, 2, 4, (3,), "float64")
    w = rng.standard_normal(output.shape)
    plan = [a.astype(np.int32) for a in (io, ss, oo, rs)]

    def loss(a, b):
        return jnp.sum(_ragged(mesh, a, b, *plan) * w)

    ga, gb = jax.grad(loss, argnums=(0, 1))(operand, output)
    want_a, want_b = ragged_grad_reference(operand, w, io, ss, oo, n)
    np.testing.assert_allclose(np.asarray(ga), want_a)
    np.testing.assert_allclose(np.asarray(gb), want_b)


@pytest.mark.parametrize("groups", [None, ((0, 1), (2, 3))])
def test_vmap_against_loop(rng, groups):
    """vmap inside shard_map (batched data and plans) equals one exchange per batch entry;
    also with axis_index_groups (jax.lax raises NotImplementedError there; the merged plan
    keeps every slice within its group, so strata supports it)."""
    n, b, mesh = 4, 3, _mesh(4)
    g = [list(x) for x in groups] if groups else None
    cases = [_random_case(rng, n, 1, 4, (2,), "float32", groups=g) for _ in range(b)]
    n_rows = max(c[0].shape[1] for c in cases)
    m_rows = max(c[1].shape[1] for c in cases)

    def pad(a, rows):
        return np.concatenate([a, np.zeros((n, rows - a.shape[1], *a.shape[2:]), a.dtype)], 1)

    ops = np.stack([pad(c[0], n_rows) for c in cases], 1)  # [n, B, N, 2]
    outs = np.stack([pad(c[1], m_rows) for c in cases], 1)
    plans = [np.stack([c[k] for c in cases], 1).astype(np.int32) for k in range(2, 6)]

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))
    def f(a, o, io, ss, oo, rs):
        fn = partial(sj.ragged_all_to_all, axis_name="x", axis_index_groups=groups)
        return jax.vmap(fn)(a[0], o[0], io[0], ss[0], oo[0], rs[0])[None]

    got = np.asarray(f(ops, outs, *plans))
    for k in range(b):
        want = ragged_reference(ops[:, k], outs[:, k], *(p[:, k] for p in plans), groups=g)
        np.testing.assert_array_equal(got[:, k], np.stack(want))


@pytest.mark.parametrize(
    "groups",
    [((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 5), (2, 7), (1, 4), (3, 6)), tuple((i,) for i in range(8))],
)
def test_axis_index_groups(rng, groups):
    n = 8
    g = [list(x) for x in groups]
    operand, output, io, ss, oo, rs = _random_case(rng, n, 2, 4, (3,), "float32", groups=g)
    want = ragged_reference(operand, output, io, ss, oo, rs, groups=g)
    got = _ragged(
        _mesh(n), operand, output, *(a.astype(np.int32) for a in (io, ss, oo, rs)), groups=groups
    )
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_axis_index_groups_grad(rng):
    groups = ((0, 2), (1, 3))
    g = [list(x) for x in groups]
    operand, output, io, ss, oo, rs = _random_case(rng, 4, 1, 3, (2,), "float64", groups=g)
    plan = [a.astype(np.int32) for a in (io, ss, oo, rs)]
    w = rng.standard_normal(output.shape)
    mesh = _mesh(4)

    def loss(a):
        return jnp.sum(_ragged(mesh, a, output, *plan, groups=groups) * w)

    ga = np.asarray(jax.grad(loss)(operand))
    # finite differences are exact for a linear map: one unit vector per operand entry
    flat = operand.reshape(-1)
    for idx in rng.choice(flat.size, size=min(12, flat.size), replace=False):
        e = np.zeros_like(flat)
        e[idx] = 1.0
        d = float(loss(operand + e.reshape(operand.shape)) - loss(operand))
        assert abs(d - ga.reshape(-1)[idx]) < 1e-9


# ---- the cases of JAX's tests/ragged_collective_test.py (v0.10.2), restated ---------------

_JAX_PLAN = dict(
    operand=[[1, 2, 2], [3, 4, 0]],
    input_offsets=[[0, 1], [0, 1]],
    send_sizes=[[1, 2], [1, 1]],
    output_offsets=[[0, 0], [1, 2]],
    recv_sizes=[[1, 1], [2, 1]],
)


def _jax_case(dtype=jnp.int32):
    p = _JAX_PLAN
    return (
        jnp.array(p["operand"], dtype),
        jnp.zeros((2, 4), dtype),
        *(jnp.array(p[k], jnp.int32) for k in list(p)[1:]),
    )


def test_jax_case_single_axis():
    got = _ragged(_mesh(2), *_jax_case(), check_vma=False)
    np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_jax_case_grad():
    """JAX checks this one with jtu.check_grads (order 1): compare with finite differences."""
    args = _jax_case(jnp.float32)
    mesh = _mesh(2)
    w = jnp.arange(8.0).reshape(2, 4)

    def loss(a, b):
        return jnp.sum(_ragged(mesh, a, b, *args[2:]) * w)

    ga, gb = jax.grad(loss, argnums=(0, 1))(args[0], args[1])
    np.testing.assert_array_equal(np.asarray(ga), [[0, 4, 5], [1, 6, 0]])
    np.testing.assert_array_equal(np.asarray(gb), [[0, 0, 2, 3], [0, 0, 0, 7]])


def test_jax_case_axis_index_groups():
    p = _JAX_PLAN
    twice = lambda k, scale=1: jnp.array(  # noqa: E731
        [*p[k], *(np.array(p[k]) * scale).tolist()], jnp.int32
    )
    got = _ragged(
        _mesh(4),
        twice("operand", 10),
        jnp.zeros((4, 4), jnp.int32),
        *(twice(k) for k in list(p)[1:]),
        groups=((0, 1), (2, 3)),
        check_vma=False,
    )
    np.testing.assert_array_equal(
        np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0], [10, 30, 0, 0], [20, 20, 40, 0]]
    )


def test_jax_case_degenerate_groups():
    got = _ragged(
        _mesh(2),
        jnp.array([[1, 0, 0, 0], [2, 3, 4, 0]], jnp.int32),
        jnp.zeros((2, 4), jnp.int32),
        jnp.array([[0], [0]], jnp.int32),
        jnp.array([[1], [3]], jnp.int32),
        jnp.array([[2], [1]], jnp.int32),
        jnp.array([[1], [3]], jnp.int32),
        groups=((0,), (1,)),
        check_vma=False,
    )
    np.testing.assert_array_equal(np.asarray(got), [[0, 0, 1, 0], [0, 2, 3, 4]])


def test_jax_case_vmap_basic():
    """EP=2 x PP=4 mesh, exchange over 'expert', then vmapped over a leading pipeline dim."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("expert", "pipeline"))
    spec = P("expert", None)

    @partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)
    def ra2a(x, out, io, ss, oo, rs):
        return sj.ragged_all_to_all(x, out, io[0], ss[0], oo[0], rs[0], axis_name="expert")

    x = jnp.tile(jnp.arange(8.0)[:, None], (1, 3))
    plan = [
        jnp.array(v, jnp.int32)
        for v in ([[0, 2], [0, 2]], [[2, 2], [2, 2]], [[0, 0], [2, 2]], [[2, 2], [2, 2]])
    ]
    want = np.repeat(np.array([0, 1, 4, 5, 2, 3, 6, 7.0])[:, None], 3, axis=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(ra2a)(x, x, *plan)), want)
    tile = lambda a: jnp.tile(a[None], (4,) + (1,) * a.ndim)  # noqa: E731
    got = jax.jit(jax.vmap(ra2a))(tile(x), tile(x), *(tile(p) for p in plan))
    assert got.shape == (4, 8, 3)
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(got[i]), want)


def test_jax_case_errors():
    """JAX's literal messages, raised while tracing (outside any mesh, as in JAX's test)."""
    operand = jnp.arange(1.0, 7.0)
    output = jnp.zeros(7)
    good = jnp.array([0, 1, 3], jnp.int32)
    f = jax.jit(sj.ragged_all_to_all, static_argnames="axis_name")
    names = ["input_offsets", "send_sizes", "output_offsets", "recv_sizes"]
    for k, name in enumerate(names):
        for bad, msg in (
            (jnp.array([0.0, 1.0, 3.0]), f"ragged_all_to_all {name} must be integer type."),
            (
                jnp.array([[0, 1, 3]], jnp.int32),
                f"ragged_all_to_all {name} must be rank 1 with positive dimension size, "
                "but got shape (1, 3)",
            ),
            (
                jnp.array([], jnp.int32),
                f"ragged_all_to_all {name} must be rank 1 with positive dimension size, "
                "but got shape (0,)",
            ),
        ):
            args = [good] * 4
            args[k] = bad
            with pytest.raises(ValueError) as e:
                f.lower(operand, output, *args, axis_name="x")
            assert str(e.value) == msg


# ---- errors at run time and at trace time ---------------------------------------------------


def test_send_recv_mismatch_raises():
    args = list(_jax_case())
    args[5] = jnp.array([[1, 1], [1, 1]], jnp.int32)  # rank 1 expects 1 row from rank 0
    with pytest.raises(Exception, match="recv_sizes"):
        np.asarray(_ragged(_mesh(2), *args, check_vma=False))


def test_out_of_bounds_raises():
    args = list(_jax_case())
    args[4] = jnp.array([[0, 3], [1, 2]], jnp.int32)  # rank 0 writes 2 rows at 3 of 4
    with pytest.raises(Exception, match="outside the output"):
        np.asarray(_ragged(_mesh(2), *args, check_vma=False))


def test_bad_shapes_raise_at_trace_time():
    mesh = _mesh(2)
    ops = jnp.zeros((2, 3, 2))
    out = jnp.zeros((2, 4, 3))  # trailing shape differs
    plan = [jnp.zeros((2, 2), jnp.int32)] * 4
    with pytest.raises(ValueError, match="trailing shape"):
        _ragged(mesh, ops, out, *plan)
    plan3 = [jnp.zeros((2, 3), jnp.int32)] * 4  # 3 slices over 2 ranks
    with pytest.raises(ValueError, match="multiple of the group size"):
        _ragged(mesh, ops, jnp.zeros((2, 4, 2)), *plan3)
    with pytest.raises(ValueError, match="cover every index"):
        _ragged(mesh, ops, jnp.zeros((2, 4, 2)), *plan, groups=((0,), (0,)))


# on_alloc runs in test_multiprocess.py's shared 2 x 2 job
# (test_ragged_all_to_all_across_processes).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["on_alloc", "staging"])
def test_across_processes(mode):
    """`launch -n 2`: random plans in three dtypes, forward and gradient, against numpy; with
    the operands shared in place (on_alloc) and through bounce buffers (staging)."""
    from test_multiprocess import _launch, _require_allocator

    _require_allocator()
    r = _launch(2, "check_ragged.py", mode=mode)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK ragged") == 2, r.stdout[-2000:]


# ---- empty slices: moved nothing, wherever their offsets point ----------------------------


def _case33(idx_dtype=jnp.int32):
    """Exact values: rank 0 sends 2 rows to rank 1; every other slice is empty,
    with offsets past the operand's or output's end (as size truncation leaves them)."""
    operand = jnp.array([[1, 2, 3, 4], [11, 12, 13, 14]], jnp.float32)[..., None]
    output = jnp.full((2, 4, 1), -1, jnp.float32)
    plan = (
        [[7, 1], [4, 6]],  # input_offsets
        [[0, 2], [0, 0]],  # send_sizes
        [[9, 1], [4, 5]],  # output_offsets
        [[0, 0], [2, 0]],  # recv_sizes
    )
    return operand, output, *(jnp.array(v, idx_dtype) for v in plan)


@pytest.mark.parametrize("idx_dtype", ["int32", "int64", "uint32"])
def test_33_empty_slice_offsets_past_the_end_move_nothing(idx_dtype):
    args = _case33(jnp.dtype(idx_dtype))
    got = np.asarray(_ragged(_mesh(2), *args, check_vma=False))
    np.testing.assert_array_equal(got[..., 0], [[-1, -1, -1, -1], [-1, 2, 3, -1]])
    want = ragged_reference(*(np.asarray(a) for a in args))
    np.testing.assert_array_equal(got, np.stack(want))


def test_33_empty_slice_far_and_negative_offsets_int64():
    """int64 offsets under x64 (conftest enables it): an empty slice at 2**40, or at -5, is
    skipped; a non-empty slice at 2**40 is still an error naming it."""
    operand, output, io, ss, oo, rs = _case33(jnp.int64)
    io = jnp.array([[2**40, 1], [-5, 2**62]], jnp.int64)
    oo = jnp.array([[-(2**40), 1], [2**41, -1]], jnp.int64)
    got = np.asarray(_ragged(_mesh(2), operand, output, io, ss, oo, rs, check_vma=False))
    np.testing.assert_array_equal(got[..., 0], [[-1, -1, -1, -1], [-1, 2, 3, -1]])
    bad = io.at[0, 1].set(2**40)
    with pytest.raises(Exception, match=r"slice 1 of rank 0 \(to rank 1\): rows \[1099511627776"):
        np.asarray(_ragged(_mesh(2), operand, output, bad, ss, oo, rs, check_vma=False))


def test_33_empty_slices_grad_and_vmap():
    """The transpose (reverse exchange) and the batching rule carry the same empty slices."""
    operand, output, *plan = _case33()
    mesh = _mesh(2)
    w = jnp.arange(8.0).reshape(2, 4, 1)
    ga, gb = jax.grad(lambda a, b: jnp.sum(_ragged(mesh, a, b, *plan) * w), argnums=(0, 1))(
        operand, output
    )
    np.testing.assert_array_equal(np.asarray(ga)[..., 0], [[0, 5, 6, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(gb)[..., 0], [[0, 1, 2, 3], [4, 0, 0, 7]])

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))
    def per_rank(a, b, c, d, e, g):
        f = partial(sj.ragged_all_to_all, axis_name="x")
        return jax.vmap(f, in_axes=(0, 0, None, None, None, None))(a, b, c[0], d[0], e[0], g[0])

    tile = lambda a: jnp.stack([a, a + 100]).swapaxes(0, 1).reshape(4, *a.shape[1:])  # noqa: E731
    got = np.asarray(jax.jit(per_rank)(tile(operand), tile(output), *plan))[..., 0]
    np.testing.assert_array_equal(got, [[-1] * 4, [99] * 4, [-1, 2, 3, -1], [99, 102, 103, 99]])


@pytest.mark.parametrize("rows", [(0, 4), (4, 0), (0, 0)])
def test_33_zero_row_operand_or_output(rows):
    """A zero-row operand leaves the output unchanged; a zero-row output receives nothing:
    every slice is empty, whatever its offsets."""
    n_rows, m_rows = rows
    operand = jnp.arange(2 * n_rows * 3, dtype=jnp.float32).reshape(2, n_rows, 3)
    output = -jnp.arange(2 * m_rows * 3, dtype=jnp.float32).reshape(2, m_rows, 3) - 1
    zeros = jnp.zeros((2, 2), jnp.int32)
    offs = jnp.array([[3, 0], [9, 1]], jnp.int32)
    got = _ragged(_mesh(2), operand, output, offs, zeros, offs[::-1], zeros, check_vma=False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(output))


def test_vmap_slice_stays_inside_its_batch_element():
    """Under vmap the batch is merged into the rows: a slice past its own element's rows must
    be an error, not rows of the next element (before: rows [3, 5) of a 4-row operand read
    element 1's row 0 and returned it). In bounds, nested vmap still matches the loop."""
    mesh = _mesh(2)

    def per_rank(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))

    one = partial(sj.ragged_all_to_all, axis_name="x")
    op = jnp.arange(16.0).reshape(4, 4, 1)  # per device: 2 elements of 4 rows
    out = jnp.zeros((4, 4, 1))
    io = jnp.array([[3, 0], [0, 0], [0, 0], [0, 0]], jnp.int32)  # element 0: rows [3, 5)
    ss = jnp.array([[2, 0], [0, 0], [0, 0], [0, 0]], jnp.int32)
    rs = ss
    oo = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(Exception, match=r"rows \[3, 5\) are outside the operand's 4 rows"):
        np.asarray(per_rank(jax.vmap(one))(op, out, io, ss, oo, rs))
    # The error names the user's slice and batch element, not the merged plan's index: rank
    # 1's element 1 sends slice 1 (to itself) from rows [3, 5) (merged: slice 3).
    io1 = jnp.array([[0, 0], [0, 0], [0, 0], [0, 3]], jnp.int32)
    ss1 = jnp.array([[0, 0], [0, 0], [0, 0], [0, 2]], jnp.int32)
    with pytest.raises(
        Exception,
        match=r"slice 1 of batch element 1 \(under vmap\) of rank 1 \(to rank 1\): "
        r"rows \[3, 5\) are outside the operand's 4 rows",
    ):
        np.asarray(per_rank(jax.vmap(one))(op, out, io1, ss1, oo, ss1))
    # A size mismatch names the user's recv_sizes index: rank 1's element 1 expects 1 row
    # from rank 1 (recv_sizes[1]), and 2 are sent.
    with pytest.raises(
        Exception,
        match=r"slice 1 of batch element 1 \(under vmap\) of rank 1 \(to rank 1\): rank 1 "
        r"sends 2 rows but rank 1's recv_sizes\[1\] is 1",
    ):
        np.asarray(per_rank(jax.vmap(one))(op, out, oo, ss1, oo, ss1.at[3, 1].set(1)))
    bad_out = jnp.array([[3, 0], [0, 0], [0, 0], [0, 0]], jnp.int32)
    with pytest.raises(Exception, match=r"rows \[3, 5\) are outside the output's 4 rows"):
        np.asarray(per_rank(jax.vmap(one))(op, out, jnp.zeros_like(io), ss, bad_out, rs))
    # Nested vmap, in bounds: [2 devices x 2 x 2] elements of 2 rows, each sends its 2 rows to
    # the own rank's output rows [0, 2).
    a = jnp.arange(16.0).reshape(2, 2, 2, 2, 1).reshape(4, 2, 2, 1)
    b = -jnp.ones_like(a)
    plan = [jnp.zeros((4, 2, 2), jnp.int32)] * 4
    sizes = jnp.repeat(jnp.array([[2, 0], [0, 2]], jnp.int32), 2, axis=0)[:, None, :]
    sizes = jnp.broadcast_to(sizes, (4, 2, 2))
    got = per_rank(jax.vmap(jax.vmap(one)))(a, b, plan[0], sizes, plan[2], sizes)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(a))


# ---- large calls in one process: the pairs path ---------------------------------------------


def _large_case(rng, n, dtype):
    """A random plan whose operand and output exceed 256 KiB per rank (lead_in_process's
    bound), so that the call takes InProcTeam::arrive_pairs."""
    operand, output, io, ss, oo, rs = _random_case(rng, n, 2, 160, (256,), dtype)
    big = 256 * 1024 // (256 * operand.dtype.itemsize) + 8  # rows above 256 KiB
    pad = max(0, big - operand.shape[1]), max(0, big - output.shape[1])
    operand = np.pad(operand, ((0, 0), (0, pad[0]), (0, 0)))
    output = np.pad(output, ((0, 0), (0, pad[1]), (0, 0)))
    return operand, output, io, ss, oo, rs


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_large_exchange_takes_the_pairs_path(rng, dtype):
    """Above 256 KiB per rank, in one process, every pair of ranks' slices is copied by the
    second of the two to arrive (no departure barrier): ``comm_stats()["pair_calls"]`` counts
    one per rank (the old build pulled after an arrival barrier: 0), and the result is
    the oracle's."""
    n = 4
    operand, output, io, ss, oo, rs = _large_case(rng, n, dtype)
    want = ragged_reference(operand, output, io, ss, oo, rs)
    plan = [a.astype(np.int32) for a in (io, ss, oo, rs)]
    before = sj.comm_stats()["pair_calls"]
    got = _ragged(_mesh(n), operand, output, *plan)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
    assert sj.comm_stats()["pair_calls"] - before == n


def test_large_exchange_errors_then_recovers(rng):
    """On the pairs path a send/recv mismatch and a slice outside the output fail the call on
    every rank with the slice named (never a hang, never a value), and the next call works."""
    n = 4
    mesh = _mesh(n)
    operand, output, io, ss, oo, rs = _large_case(rng, n, "float32")
    plan = [a.astype(np.int32) for a in (io, ss, oo, rs)]
    bad_recv = [p.copy() for p in plan]
    bad_recv[3][1, 0] += 1  # rank 1 expects one row more from rank 0
    with pytest.raises(Exception, match=r"slice \d+ of rank 0 \(to rank 1\).*recv_sizes"):
        np.asarray(_ragged(mesh, operand, output, *bad_recv))
    bad_off = [p.copy() for p in plan]
    j = int(np.argmax(ss[:, 0]))  # a non-empty slice (the plan draws some) to rank 0
    if ss[j, 0] > 0:
        bad_off[2][j, 0] = output.shape[1]  # lands past the receiver's output
        with pytest.raises(Exception, match="outside the output"):
            np.asarray(_ragged(mesh, operand, output, *bad_off))
    want = ragged_reference(operand, output, io, ss, oo, rs)
    np.testing.assert_array_equal(np.asarray(_ragged(mesh, operand, output, *plan)), np.stack(want))


def test_empty_as_the_output_of_an_exchange(rng):
    """strata_jax.empty: shape and dtype as asked, no zero fill in the program, and as the
    ``output`` of a ragged_all_to_all whose plan writes every row, the result is the oracle's
    (here from a large call: the pairs path)."""
    n = 4
    mesh = _mesh(n)
    e = sj.empty((3, 5), jnp.int16)
    assert e.shape == (3, 5) and e.dtype == jnp.int16
    assert sj.empty(7).shape == (7,) and sj.empty(7).dtype == jnp.float32
    with pytest.raises(ValueError, match="negative"):
        sj.empty((2, -1))
    for bad in ((2.5,), "3", (2, 1.0)):  # as jnp.zeros: no silent truncation or parsing
        with pytest.raises(TypeError, match="integer type"):
            sj.empty(bad)
    # Every rank receives `rows` rows from every rank, back to back: the output is covered.
    rows, width = int(rng.integers(300, 400)), 64
    operand = rng.standard_normal((n, n * rows, width)).astype(np.float32)
    starts = np.tile(np.arange(n) * rows, (n, 1))
    sizes = np.full((n, n), rows)
    out_off = np.tile((np.arange(n) * rows)[:, None], (1, n))  # rank j lands at j * rows
    want = ragged_reference(operand, np.zeros_like(operand), starts, sizes, out_off, sizes)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))
    def f(a, io, ss, oo, rs):
        out = sj.empty(a.shape[1:], a.dtype)
        return sj.ragged_all_to_all(a[0], out, io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    assert "strata_empty" in f.lower(operand, starts, sizes, out_off, sizes).as_text()
    got = f(operand, *(a.astype(np.int32) for a in (starts, sizes, out_off, sizes)))
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
