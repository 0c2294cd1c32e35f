"""comm_stats() per operator, reset_stats(), profiler names, and the cost of keeping the stats."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax._src import runtime


def _f(body, out_specs=None):
    out_specs = P() if out_specs is None else out_specs
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs))


def test_comm_stats_per_operator(rng):
    x = jnp.asarray(rng.standard_normal((8, 256)).astype(np.float32))  # 1 KiB per rank
    ps = _f(lambda a: sj.psum(a, "x"))
    ag = _f(lambda a: sj.all_gather(a, "x"), P("x"))
    jax.block_until_ready((ps(x), ag(x)))
    sj.reset_stats()
    for _ in range(3):
        jax.block_until_ready(ps(x))
    jax.block_until_ready(ag(x))
    ops = sj.comm_stats()["ops"]
    assert set(ops) == {"psum", "all_gather"}, ops
    p = ops["psum"]
    assert p["calls"] == 3 * 8 and p["bytes"] == 3 * 8 * 1024
    assert sum(p["algorithm"].values()) == p["calls"]
    want = "two_shot" if 1024 >= sj.get_two_shot_threshold() else "one_shot"
    assert p["algorithm"][want] == p["calls"]
    assert 0 < p["p50_s"] <= p["p99_s"]
    assert p["wait_s"] + p["move_s"] == pytest.approx(p["total_s"])
    assert ops["all_gather"]["calls"] == 8 and ops["all_gather"]["algorithm"] == {"direct": 8}
    sj.reset_stats()
    assert sj.comm_stats()["ops"] == {}


def test_peer_bytes_follow_the_algorithm(rng):
    """intra_fabric_bytes per all-reduce as docs/scaling.md models them, per rank: one-shot reads
    every peer's whole input, (n-1) B; two-shot reads its 1/n chunk of every peer's input and
    writes the reduced chunk into every peer's output, 2 (n-1) B / n (it counted (n-1) B too)."""
    n = len(jax.devices())
    x = rng.standard_normal((n, 128 * 1024)).astype(np.float32)  # 512 KiB per rank
    b = x[0].nbytes
    ps = _f(lambda a: sj.psum(a, "x"), P("x"))
    xs = jnp.asarray(x)
    keep = sj.get_two_shot_threshold()
    try:
        for threshold, algo, per_rank in ((1 << 40, "one_shot", (n - 1) * b), (0, "two_shot", 0)):
            per_rank = per_rank or 2 * (n - 1) * b // n
            sj.set_two_shot_threshold(threshold)
            jax.block_until_ready(ps(xs))
            sj.reset_stats()
            before = sj.memory_stats()["intra_fabric_bytes"]
            out = np.asarray(ps(xs))
            moved = sj.memory_stats()["intra_fabric_bytes"] - before
            np.testing.assert_allclose(
                out, np.broadcast_to(x.sum(0), x.shape), rtol=1e-5, atol=1e-4
            )
            assert sj.comm_stats()["ops"]["psum"]["algorithm"][algo] == n
            assert moved == n * per_rank, (algo, moved, n * per_rank)
    finally:
        sj.set_two_shot_threshold(keep)


@pytest.mark.parametrize(
    "op,nbytes,steps",
    [
        ("psum", 4096, 1),  # one rendezvous: the last to arrive runs every rank's part
        ("psum", 1 << 20, 2),  # the general path: arrive, depart
        ("all_to_all", 4096, 1),
        ("all_to_all", 1 << 20, 1),  # pairs copied as ranks arrive: no departure barrier
    ],
)
def test_rendezvous_steps_per_rank_follow_the_path(rng, op, nbytes, steps):
    """comm_stats()["rendezvous_steps"] adds, per rank and call, the barriers docs/scaling.md
    gives the path the call took (across processes: tests/mp_scripts/check_low_latency.py and
    benchmarks/scale.py)."""
    n = len(jax.devices())
    x = jnp.asarray(rng.standard_normal((n, nbytes // 4)).astype(np.float32))
    body = {
        "psum": lambda a: sj.psum(a, "x"),
        "all_to_all": lambda a: sj.all_to_all(a, "x", 1, 1, tiled=True),
    }[op]
    f = _f(body, P("x"))
    jax.block_until_ready(f(x))
    before = sj.comm_stats()
    jax.block_until_ready(f(x))
    after = sj.comm_stats()
    assert after["calls"] - before["calls"] == n
    assert after["rendezvous_steps"] - before["rendezvous_steps"] == steps * n


def test_low_latency_counters_are_listed():
    # The low-latency path's counters (counted across processes only; tests/mp_scripts/
    # check_low_latency.py checks their values): present, whole numbers, never negative.
    st = sj.comm_stats()
    for key in ("low_latency_calls", "direct_calls", "channel_waits", "channel_sleeps"):
        assert isinstance(st[key], int) and st[key] >= 0, (key, st.get(key))


def test_comm_stats_count_moe_and_ragged_calls(rng):
    """MoE dispatch/combine (normal and low-latency) and ragged_all_to_all have slots of their
    own in comm_stats()["ops"], with wait and move times."""
    from strata_jax import moe

    n, t, h, e = 8, 8, 16, 8
    x = jnp.asarray(rng.standard_normal((n * t, h)).astype(np.float32))
    idx = jnp.asarray(rng.integers(0, e, (n * t, 2)).astype(np.int32))
    w = jnp.asarray(rng.random((n * t, 2)).astype(np.float32))
    mesh = Mesh(np.array(jax.devices()), ("x",))

    def body(x, idx, w):
        recv, layout = moe.dispatch(x, idx, num_experts=e, axis_name="x")
        y = moe.combine(recv * 2, layout, w)
        rl, _, handle = moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x")
        yl = moe.low_latency_combine(rl * 2, handle, w)
        sizes = jnp.full((n,), 1, jnp.int32)
        offs = jnp.arange(n, dtype=jnp.int32)
        r = sj.ragged_all_to_all(
            x[:n],
            jnp.zeros((n, h), x.dtype),
            offs,
            sizes,
            jnp.full((n,), 0, jnp.int32) + jax.lax.axis_index("x").astype(jnp.int32),
            sizes,
            axis_name="x",
        )
        return y, yl, r

    spec = P("x")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    jax.block_until_ready(f(x, idx, w))
    sj.reset_stats()
    y, yl, r = jax.block_until_ready(f(x, idx, w))
    np.testing.assert_allclose(np.asarray(y), np.asarray(yl), rtol=1e-6)
    # Rank j's row i went to rank i's row j: the transpose of the [n, n] blocks of rows.
    want = np.asarray(x).reshape(n, t, h).transpose(1, 0, 2).reshape(n * n, h)
    np.testing.assert_array_equal(np.asarray(r), want)
    ops = sj.comm_stats()["ops"]
    for name in (
        "moe.dispatch",
        "moe.combine",
        "moe.low_latency_dispatch",
        "moe.low_latency_combine",
        "ragged_all_to_all",
    ):
        assert ops[name]["calls"] == n, (name, ops.get(name))
        assert 0 < ops[name]["p50_s"] <= ops[name]["p99_s"], name
        assert ops[name]["wait_s"] + ops[name]["move_s"] == pytest.approx(ops[name]["total_s"])
    assert ops["moe.dispatch"]["bytes"] == n * t * h * 4
    assert "other" not in ops, ops.keys()


def test_profiler_name_in_hlo_metadata():
    f = _f(lambda a: sj.psum(a, "x") + sj.all_gather(a, "x").sum(0), P("x"))
    text = f.lower(jnp.ones((8, 4))).compile().as_text()
    assert "strata.psum" in text and "strata.all_gather" in text


def _median_call_s(f, x, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


@pytest.mark.slow
def test_stats_overhead_at_4kib_below_2_percent():
    """Stats on vs off, interleaved in rounds on the same jitted psum of 4 KiB per rank."""
    x = jnp.ones((8, 1024), jnp.float32)
    f = _f(lambda a: sj.psum(a, "x"))
    jax.block_until_ready(f(x))
    ratios, on, off = [], [], []
    nat = runtime.native()
    try:
        for i in range(30):
            # Paired rounds, order alternating, so that drift of a shared machine cancels.
            first = bool(i % 2)
            nat.set_op_stats_enabled(first)
            a = _median_call_s(f, x, 40)
            nat.set_op_stats_enabled(not first)
            b = _median_call_s(f, x, 40)
            t_on, t_off = (a, b) if first else (b, a)
            on.append(t_on)
            off.append(t_off)
            ratios.append(t_on / t_off)
    finally:
        nat.set_op_stats_enabled(True)
    overhead = float(np.median(ratios)) - 1
    print(
        f"4 KiB psum x8: stats on {np.median(on) * 1e6:.1f} us, off {np.median(off) * 1e6:.1f}"
        f" us, median paired ratio overhead {overhead * 100:+.2f}%"
    )
    assert overhead < 0.02


DEBUG_SCRIPT = """
import strata_jax as sj
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
for n in (16, 4096, 4096):
    f = jax.jit(jax.shard_map(lambda a: sj.psum(a, "b"), mesh=mesh, in_specs=P(("a", "b")),
                              out_specs=P("a")))
    f(jnp.ones(8 * n, jnp.float32))
"""


def test_strata_debug_info_logs_communicators_and_switches(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "XLA_FLAGS"))}
    env.update(STRATA_DEBUG="INFO", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run(
        [sys.executable, "-c", DEBUG_SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("strata_jax INFO [rank 0]")]
    assert len(lines) == 3, r.stderr  # one communicator, one-shot, switch to two-shot
    assert "new communicator: axes ('b',) (4 ranks)" in lines[0]
    assert "one-shot" in lines[1] and "two-shot" in lines[2] and "was one-shot" in lines[2]


def test_debug_log_names_the_native_algorithm(monkeypatch, capsys):
    """STRATA_DEBUG=INFO names the all-reduce algorithm the native library runs: two ranks stay
    one-shot below 16 MiB per rank and go two-shot from there (the log used to say one-shot for
    both, deciding on its own), four ranks go two-shot from the threshold; pmean likewise."""
    from strata_jax._src import debug

    monkeypatch.setenv("STRATA_DEBUG", "INFO")
    monkeypatch.setattr(debug, "_last_algo", {})
    monkeypatch.setattr(debug, "_seen_groups", set())

    def logged(n, nbytes, op=sj.psum):
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        f = jax.jit(
            jax.shard_map(lambda a: op(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        )
        debug._last_algo.clear()
        f.lower(jax.ShapeDtypeStruct((n * nbytes // 4,), jnp.float32))
        lines = [ln for ln in capsys.readouterr().err.splitlines() if "all-reduce for" in ln]
        assert len(lines) == 1, lines
        return lines[0]

    threshold = sj.get_two_shot_threshold()
    assert f"one-shot all-reduce for {8 << 20} B per rank over 2 ranks" in logged(2, 8 << 20)
    assert f"two-shot all-reduce for {16 << 20} B per rank over 2 ranks" in logged(2, 16 << 20)
    assert f"two-shot all-reduce for {threshold} B per rank over 4 ranks" in logged(4, threshold)
    assert "one-shot all-reduce for 256 B" in logged(4, 256)
    assert "pmean: two-shot" in logged(2, 16 << 20, sj.pmean)
    # The same choice the native library reports for a call of that size
    assert runtime.native().all_reduce_algorithm(2, 16 << 20) == "two_shot"
    assert runtime.native().all_reduce_algorithm(2, (16 << 20) - 4) == "one_shot"
