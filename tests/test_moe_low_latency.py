"""strata_jax.moe low-latency dispatch/combine against the dense numpy reference.

The reference plan is tests/moe_reference.py's ``ref_plan`` with capacity R * M (nothing is
ever dropped in this mode): rows of each expert in (source rank, source token) order, a token
naming an expert twice sent once, -1 sent nowhere, rows past the counts zero. In-process on 4
devices here; the same checks run
over ``strata_jax.launch -n 2`` through mp_scripts/check_moe_low_latency.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import mesh1d, rotation
from jax.sharding import PartitionSpec as P
from moe_reference import ref_plan
from test_multiprocess import _launch, _require_allocator

import strata_jax as sj
from strata_jax.moe import _layer

R = 4
E_LOCAL = 2
H = 8
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def ll_fn(n: int, num_experts: int, m: int | None, algo: str):
    def body(x, idx, w, ey):
        recv, counts, handle = sj.moe.low_latency_dispatch(
            x, idx, num_experts=num_experts, axis_name="x", max_tokens_per_rank=m, algo=algo
        )
        y = sj.moe.low_latency_combine(ey, handle, w)
        return recv, counts, handle.src_slots, y

    spec = P("x")
    return jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=(spec,) * 4, out_specs=(spec,) * 4))


def check(rng, t: int, k: int, *, algo="pull", m=None, dtype="float32", idx=None):
    n, e = R, R * E_LOCAL
    mm = t if m is None else m
    cap = n * mm  # rows per expert
    dt = jnp.dtype(dtype)
    if idx is None:
        idx = rng.integers(-1, e, (n * t, k)).astype(np.int32)
        if k >= 2:
            idx[0, :2] = 1  # a repeated expert
    x = rng.standard_normal((n * t, H)).astype(np.float32)
    w = rng.random((n * t, k)).astype(np.float32)
    ey = rng.standard_normal((e, cap, H)).astype(np.float32)
    # ref_plan numbers tokens globally; with M > T, a source's tokens sit in its own block of
    # the global order, which is the same order, so only the capacity changes.
    src, cidx, counts, _ = ref_plan(idx, e, cap)

    f = ll_fn(n, e, m, algo)
    recv, got_counts, slots, y = f(jnp.asarray(x, dt), idx, jnp.asarray(w, dt), jnp.asarray(ey, dt))
    assert recv.shape == (e, cap, H) and recv.dtype == dt and y.dtype == dt
    np.testing.assert_array_equal(np.asarray(got_counts), counts)
    xr = np.asarray(jnp.asarray(x, dt).astype(jnp.float32))
    got = np.asarray(recv.astype(jnp.float32))
    for ex in range(e):
        c = counts[ex]
        np.testing.assert_array_equal(got[ex, :c], xr[src[ex, :c]], err_msg=f"expert {ex}")
        assert not got[ex, c:].any(), f"expert {ex}: rows past the count are not zero"
    # src_slots: the row of each choice in its owner's [E_local * R * M] rows
    owner_base = np.where(idx >= 0, (idx // E_LOCAL) * E_LOCAL * cap, 0)
    want_slots = np.where(cidx >= 0, cidx - owner_base, -1)
    np.testing.assert_array_equal(np.asarray(slots), want_slots)
    eyr = np.asarray(jnp.asarray(ey, dt).astype(jnp.float32)).reshape(-1, H).astype(np.float64)
    wr = np.asarray(jnp.asarray(w, dt).astype(jnp.float32)).astype(np.float64)
    kept = cidx >= 0
    rows = np.where(kept[..., None], eyr[np.maximum(cidx, 0)], 0.0)
    want_y = np.einsum("nk,nkh->nh", np.where(kept, wr, 0.0), rows)
    tol = TOL[dtype] * k
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want_y, rtol=tol, atol=tol)


@pytest.mark.parametrize("t,k", rotation([1, 3, 8, 64, 128], [[1, 2, 4]]))
def test_low_latency_matches_reference(rng, t, k):
    check(rng, t, k)


@pytest.mark.parametrize("t,k", [(1, 4), (64, 2)])
def test_push_matches_reference(rng, t, k):
    check(rng, t, k, algo="push")


def test_max_tokens_larger_than_t_and_bfloat16(rng):
    check(rng, 3, 2, m=8, dtype="bfloat16")


def test_all_minus_one_and_all_to_one_expert(rng):
    check(rng, 5, 2, idx=np.full((R * 5, 2), -1, np.int32))
    check(rng, 5, 3, idx=np.full((R * 5, 3), 7, np.int32), algo="push")


@pytest.mark.parametrize("t,chunk", [(8, 3), (16, 64)])
def test_expert_chunks_over_low_latency_counts(rng, t, chunk):
    """The serving path (benchmarks/serve_moe.py): the expert MLP over the low-latency receive
    buffer in chunks, skipping those past recv_counts, equals it over every row, with one
    rank routing everything to one expert (its chunks full, the others' empty)."""
    n, e, f = R, R * E_LOCAL, 12
    idx = rng.integers(0, e, (n * t, 2)).astype(np.int32)
    idx[:t] = [0, 1]
    x = jnp.asarray(rng.standard_normal((n * t, H)).astype(np.float32))
    w = jnp.asarray(rng.random((n * t, 2)).astype(np.float32))
    w1 = jnp.asarray(rng.standard_normal((e, H, f)).astype(np.float32))
    w2 = jnp.asarray(rng.standard_normal((e, f, H)).astype(np.float32))

    def body(x, idx, w, w1, w2, chunked):
        recv, counts, handle = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        ey = sj.moe.expert_mlp(recv, w1, w2, recv_counts=counts, chunk=chunk if chunked else None)
        return sj.moe.low_latency_combine(ey, handle, w)

    spec = P("x")
    ys = [
        jax.jit(
            jax.shard_map(
                lambda *a, c=c: body(*a, c), mesh=mesh1d(n), in_specs=(spec,) * 5, out_specs=spec
            )
        )(x, idx, w, w1, w2)
        for c in (False, True)
    ]
    np.testing.assert_allclose(np.asarray(ys[1]), np.asarray(ys[0]), rtol=1e-5, atol=1e-5)
    h = np.asarray(jax.nn.gelu(jnp.einsum("th,tkhf->tkf", x, w1[idx])))
    want = np.einsum("tk,tkh->th", np.asarray(w), np.einsum("tkf,tkfh->tkh", h, w2[idx]))
    np.testing.assert_allclose(np.asarray(ys[1]), want, rtol=1e-4, atol=1e-4)


def test_errors():
    mesh = mesh1d(R)
    x = jnp.zeros((R * 4, H), jnp.float32)
    idx = jnp.zeros((R * 4, 2), jnp.int32)

    def run(body):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x"))(x, idx)

    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        run(
            lambda a, b: sj.moe.low_latency_dispatch(
                a, b, num_experts=8, axis_name="x", max_tokens_per_rank=2
            )[0]
        )
    with pytest.raises(ValueError, match="algo"):
        run(
            lambda a, b: sj.moe.low_latency_dispatch(a, b, num_experts=8, axis_name="x", algo="x")[
                0
            ]
        )
    with pytest.raises(ValueError, match="divisible"):
        run(lambda a, b: sj.moe.low_latency_dispatch(a, b, num_experts=6, axis_name="x")[0])

    def bad_combine(a, b):
        recv, _, h = sj.moe.low_latency_dispatch(a, b, num_experts=8, axis_name="x")
        return sj.moe.low_latency_combine(recv[:, :3], h, jnp.ones((4, 2)))

    with pytest.raises(ValueError, match="expert_y must have shape"):
        run(bad_combine)


# on_alloc on 2 x 2 runs in test_multiprocess.py's shared job
# (test_moe_low_latency_across_processes).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["on_alloc", "staging"])
def test_low_latency_across_processes(mode):
    """The same checks over `strata_jax.launch -n 2` (shared-memory fabric)."""
    _require_allocator()
    r = _launch(2, "check_moe_low_latency.py", mode=mode)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK moe low-latency") == 2, r.stdout[-2000:]


@pytest.mark.parametrize("dtype,k", rotation(["float32", "bfloat16", "float16"], [[3, 4]]))
def test_combine_order_same_as_normal_mode(rng, dtype, k):
    """low_latency_combine sums a token's rows in combine's order (expert ranks ascending, a
    rank's choices in k order), so the two modes give bitwise the same y. The first token's
    choices are in falling rank order and its expert outputs cancel (1e4, -1e4, then small):
    summed in k order instead, its y differs in float32."""
    n, e, t = R, R * E_LOCAL, 5
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n * t)]).astype(np.int32)
    idx[0] = [7, 0, 2, 5][:k]  # ranks 3, 0, 1, 2
    idx[1, 1] = -1
    x = rng.standard_normal((n * t, H)).astype(np.float32)
    x[0] = 1.0
    w = rng.random((n * t, k)).astype(np.float32)
    w[0] = 1.0
    scale = rng.standard_normal(e).astype(np.float32)
    scale[[7, 0]] = [1e4, -1e4]
    dt = jnp.dtype(dtype)

    def body(x, idx, w):
        s = jax.lax.dynamic_slice_in_dim(
            jnp.asarray(scale), jax.lax.axis_index("x") * E_LOCAL, E_LOCAL
        )
        s = s.astype(dt)[:, None, None]
        recv, lay = sj.moe.dispatch(x, idx, num_experts=e, axis_name="x")
        y = sj.moe.combine(recv * s, lay, w)
        rl, _, h = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        return y, sj.moe.low_latency_combine(rl * s, h, w)

    spec = P("x")
    f = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=(spec,) * 3, out_specs=(spec,) * 2))
    y, yl = f(jnp.asarray(x, dt), idx, jnp.asarray(w, dt))
    assert y.dtype == dt and yl.dtype == dt
    np.testing.assert_array_equal(
        np.asarray(yl).view(np.uint16 if dt.itemsize == 2 else np.uint32),
        np.asarray(y).view(np.uint16 if dt.itemsize == 2 else np.uint32),
    )
    want = (w[0, :] * scale[idx[0]]).sum() * 1.0
    np.testing.assert_allclose(np.asarray(y[0].astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)


def test_not_differentiable_says_what_to_do():
    """grad through the low-latency pair names the public function and the normal mode (not
    JAX's stock "Differentiation rule for 'strata_moe_low_latency_dispatch' not implemented");
    inputs passed through stop_gradient need no rule."""
    n, e, t = 2, 4, 3
    idx = jnp.zeros((n * t, 2), jnp.int32).at[:, 1].set(3)
    w = jnp.ones((n * t, 2), jnp.float32)
    x = jnp.ones((n * t, H), jnp.float32)

    def body(x, idx, w):
        recv, _, handle = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        return sj.moe.low_latency_combine(recv, handle, w)

    spec = P("x")
    f = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=(spec,) * 3, out_specs=spec))
    with pytest.raises(NotImplementedError, match=r"low_latency_dispatch is not differentiable"):
        jax.grad(lambda x: f(x, idx, w).sum())(x)
    with pytest.raises(NotImplementedError, match=r"low_latency_combine is not.*dispatch/combine"):
        jax.grad(lambda w: f(x, idx, w).sum())(w)
    g = jax.grad(lambda x: f(jax.lax.stop_gradient(x), idx, w).sum() + x.sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones((n * t, H), np.float32))


def test_wide_ids_do_not_wrap():
    """int64 ids past int32 (jax_enable_x64 is on in conftest) are "no expert" in both modes,
    not the expert they would wrap to (2**32 + 1 -> 1); uint8 ids with E above 255 stay ids."""
    assert jax.config.jax_enable_x64
    n, e, t = 2, 4, 2
    idx = np.full((n * t, 1), -1, np.int64)
    idx[0, 0] = 2**32 + 1
    idx[1, 0] = -(2**32) + 3
    idx[2, 0] = 2**40
    idx[3, 0] = 2  # the one real choice
    x = jnp.ones((n * t, H), jnp.float32)

    def body(x, idx):
        _, ll_counts, _ = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        _, lay = sj.moe.dispatch(x, idx, num_experts=e, axis_name="x")
        return ll_counts, lay.recv_counts

    spec = P("x")
    f = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=(spec,) * 2, out_specs=(spec,) * 2))
    ll_counts, counts = f(x, jnp.asarray(idx))
    np.testing.assert_array_equal(np.asarray(ll_counts), [0, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(counts), [0, 0, 1, 0])
    from strata_jax.moe._reference import sanitize_ids

    got = sanitize_ids(jnp.asarray([[5, 255]], jnp.uint8), 300)
    np.testing.assert_array_equal(np.asarray(got), [[5, 255]])


@pytest.mark.parametrize("algo", ["pull", "push"])
def test_one_bad_row_poisons_nothing_else(rng, algo):
    """A bad row on serving's decode path (route, low_latency_dispatch, chunked
    expert MLP, low_latency_combine): a NaN or infinite row leaves every other row's output
    bitwise unchanged, and NaN written into the receive rows no token uses (past the counts)
    is never read by the combine."""
    n, e, k, t, f = 2, 4, 2, 4, 16
    el = e // n

    def body(x, rw, w1, w2, junk):
        idx, w = _layer.route(x, rw, k)
        recv, cnt, handle = sj.moe.low_latency_dispatch(
            x, idx, num_experts=e, axis_name="x", algo=algo
        )
        ey = sj.moe.expert_mlp(recv, w1, w2, recv_counts=cnt, chunk=2)
        rows = jnp.arange(ey.shape[1])[None, :, None]
        ey = jnp.where(rows < cnt[:, None, None], ey, junk[0])  # NaN past the counts
        return sj.moe.low_latency_combine(ey, handle, w)

    spec = (P("x"), P(), P("x"), P("x"), P())
    f_ = jax.jit(jax.shard_map(body, mesh=mesh1d(n), in_specs=spec, out_specs=P("x")))
    x = jnp.asarray(rng.standard_normal((n * t, H)), jnp.float32)
    rw = jnp.asarray(rng.standard_normal((H, e)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, H, f)) / 3, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, f, H)) / 4, jnp.float32)
    assert el * n == e
    zero, nan = jnp.zeros(1, jnp.float32), jnp.full(1, jnp.nan, jnp.float32)
    y_a = np.asarray(f_(x, rw, w1, w2, zero))
    np.testing.assert_array_equal(np.asarray(f_(x, rw, w1, w2, nan)), y_a)
    bad = t + 3
    others = np.arange(n * t) != bad
    for v in (np.nan, np.inf):
        y_b = np.asarray(f_(x.at[bad].set(v), rw, w1, w2, nan))
        np.testing.assert_array_equal(y_b[others], y_a[others], err_msg=f"bad row = {v}")


def test_serve_benchmark_across_hosts_uses_dispatch_combine(tmp_path):
    """benchmarks/serve_moe.py under ``launch --hosts 2``: low_latency_dispatch/combine do not
    cross fabrics, so strata serves with dispatch/combine there and says so (the script used to
    fail at lowering: 'moe.low_latency_dispatch over a group that spans fabric domains'); its
    greedy bytes equal xla_sort's."""
    import json

    from _mp_util import run_benchmark

    args = ["--d-model", "32", "--experts", "8", "--d-ff", "32", "--batch", "2", "--gen", "2"]
    args += ["--prompt", "4", "--requests", "1", "--train-steps", "2", "--impl", "strata,xla_sort"]
    out = run_benchmark("serve_moe.py", tmp_path, *args, hosts=2)
    assert "the 2 fabrics (hosts) of this job: prefill and decode on" in out, out[-3000:]
    assert json.loads((tmp_path / "serve_moe.json").read_text())["differing_bytes"] == {
        "xla_sort": 0
    }
