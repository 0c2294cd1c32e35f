"""Registration ablation (StrataCL's on_alloc vs on_use vs staging) in a training-like loop.

Every step XLA computes fresh "gradient" buffers from the parameters, all-reduces them with
strata_jax.pmean across P processes (one device each), and updates the parameters (donated, so
XLA reuses their memory): the allocation pattern of a data-parallel training step. Each mode runs
as its own launcher run (the mode is fixed at strata_jax.init()):

- on_alloc: the allocator registers each new segment from its background thread, and keeps a
            reserve of memory made, faulted in and registered ahead of demand;
- on_use:   a collective registers the segments it meets the first time (on the critical path);
- staging:  no registration of XLA memory; every collective copies through bounce buffers.

Reported per run (times are the max over processes): the first step after compilation (fresh
memory: allocation, first touch and registration all land in it), the second, the steady-state
median step; for the first step also the time in collectives moving data (against the second
step's), the page faults of the application's threads and of the allocator's own threads
(max over processes), and the segments created inside malloc vs made ahead by the reserve
(summed over processes); and the counters of strata_jax.memory_stats(): registrations on / off
the critical path (total, and after warm-up), pool segments (before the first step / at the
end), zero-copy and staged bytes, registered and pool bytes. With --repeats N the mode sequence
runs N times (order rotated) and a summary gives each mode's medians and [min, max].

    python benchmarks/registration.py                      # 4 processes, 64 MiB of gradients
    python benchmarks/registration.py --procs 2 --mbytes 16 --steps 20
    python benchmarks/registration.py --repeats 5          # modes alternated 5 times: medians
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info  # noqa: E402
from _report import write_json  # noqa: E402

MODES = ("on_alloc", "on_use", "staging")
RESULT_TAG = "REGBENCH-RESULT "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=4, help="processes, one device each (4)")
    p.add_argument("--mbytes", type=float, default=64, help="gradient MiB per process (64)")
    p.add_argument("--tensors", type=int, default=4, help="gradient tensors per step (4)")
    p.add_argument("--steps", type=int, default=30, help="steps per mode (30)")
    p.add_argument("--warmup", type=int, default=5, help="steps before steady state (5)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the mode sequence this many times (rotated order), report medians and spread",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for the JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# One launcher run (every process)
# ---------------------------------------------------------------------------------------------


def thread_faults() -> tuple[int, int]:
    """Minor page faults so far of (the allocator's own threads, every other thread)."""
    mine = other = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread exited
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        minflt = int(stat[stat.rindex(")") + 2 :].split()[7])
        if name in ("strata_alloc", "strata_reserve"):
            mine += minflt
        else:
            other += minflt
    return mine, other


def coll_seconds(cs: dict) -> tuple[float, float]:
    """Seconds in strata collectives so far: (waiting for peers, moving data)."""
    ops = cs["ops"].values()
    return sum(o["wait_s"] for o in ops), sum(o["move_s"] for o in ops)


def child(a: argparse.Namespace) -> None:
    import numpy as np

    import strata_jax as sj

    info = sj.init()
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from strata_jax._src.jax_compat import distributed

    client = distributed.global_state.client
    n = jax.process_count()
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
    elems = int(a.mbytes * 2**20 / 4 / a.tensors)
    cols = 1024
    rows = max(1, elems // cols)
    spec = P("x")
    sh = NamedSharding(mesh, spec)

    def body(params, x):
        # Fresh gradient buffers every step (elementwise "backward"), all-reduced, applied.
        grads = [jnp.tanh(p * x[0, 0] + 0.5) for p in params]
        grads = [sj.pmean(g, "x") for g in grads]
        return [p - 1e-3 * g for p, g in zip(params, grads, strict=True)]

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec),
        donate_argnums=0,
    )
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((n * rows, cols), np.float32) for _ in range(a.tensors)]
    params = [jax.make_array_from_callback(h.shape, sh, lambda i, h=h: h[i]) for h in host]
    x = jax.make_array_from_callback((n, 1), sh, lambda i: np.full((n, 1), 0.5, np.float32)[i])
    compiled = step.lower(params, x).compile()

    def barrier(name: str) -> None:
        client.wait_at_barrier(f"regbench/{name}", 120_000)

    times = []
    snap = None
    first_faults = first_bg_faults = first_on_demand = first_made_ahead = 0
    coll = [[0.0, 0.0], [0.0, 0.0]]  # steps 0 and 1: seconds in collectives (wait, move)
    segs_before = sj.memory_stats()["pool_segments"]
    for s in range(a.steps):
        if s == a.warmup:
            snap = sj.memory_stats()
        barrier(f"step{s}")
        if s in (0, 1):
            c0 = coll_seconds(sj.comm_stats())
        if s == 0:
            f0 = thread_faults()
            m0 = sj.memory_stats()
        t0 = time.perf_counter()
        params = compiled(params, x)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
        if s in (0, 1):
            c1 = coll_seconds(sj.comm_stats())
            coll[s] = [c1[0] - c0[0], c1[1] - c0[1]]
        if s == 0:
            f1 = thread_faults()
            m1 = sj.memory_stats()
            first_faults = f1[1] - f0[1]
            first_bg_faults = f1[0] - f0[0]
            first_on_demand = m1["pool_segments_on_demand"] - m0["pool_segments_on_demand"]
            first_made_ahead = m1["pool_segments_made_ahead"] - m0["pool_segments_made_ahead"]
    end = sj.memory_stats()
    # Check the all-reduce against numpy on the known global input (after the timed loop).
    chk = jax.jit(
        jax.shard_map(
            lambda p: sj.pmean(jnp.tanh(p * 0.5 + 0.5), "x"),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    got = np.asarray(
        chk(jax.make_array_from_callback(host[0].shape, sh, lambda i: host[0][i])).addressable_data(
            0
        )
    )
    want = np.tanh(host[0].reshape(n, rows, cols) * 0.5 + 0.5).mean(0)
    ok = bool(np.allclose(got, want, rtol=1e-5, atol=1e-6))
    first = multihost_utils.process_allgather(np.float64(times[0]))
    faults = multihost_utils.process_allgather(np.int64(first_faults))
    extra = multihost_utils.process_allgather(
        np.array([first_bg_faults, first_on_demand, first_made_ahead], np.int64)
    ).reshape(-1, 3)
    colls = multihost_utils.process_allgather(np.array(coll, np.float64)).reshape(-1, 2, 2)
    steady = multihost_utils.process_allgather(np.float64(np.median(times[a.warmup :])))
    if jax.process_index() == 0:
        res = {
            "mode": info["registration"],
            "procs": n,
            "mbytes": a.mbytes,
            "tensors": a.tensors,
            "first_step_ms": float(np.max(first)) * 1e3,
            "steady_ms": float(np.max(steady)) * 1e3,
            "min_ms": min(times[a.warmup :]) * 1e3,
            "second_step_ms": times[1] * 1e3 if len(times) > 1 else float("nan"),
            "first_step_faults_max": int(np.max(faults)),
            "first_step_coll_wait_ms": float(np.max(colls[:, 0, 0])) * 1e3,
            "first_step_coll_move_ms": float(np.max(colls[:, 0, 1])) * 1e3,
            "second_step_coll_move_ms": float(np.max(colls[:, 1, 1])) * 1e3,
            "first_step_bg_faults_max": int(np.max(extra[:, 0])),
            "first_step_on_demand_segs": int(np.sum(extra[:, 1])),
            "first_step_made_ahead_segs": int(np.sum(extra[:, 2])),
            "segments_made_ahead": end["pool_segments_made_ahead"],
            "reserve_mib": end["pool_reserve_bytes"] / 2**20,
            "pool_segments": end["pool_segments"],
            "pool_segments_before": segs_before,
            "peer_segments_mapped": end["peer_segments_mapped"],
            "correct": ok,
            "crit_regs": end["registrations_critical"],
            "crit_regs_after_warmup": end["registrations_critical"]
            - snap["registrations_critical"],
            "crit_s": end["registrations_critical_s"],
            "offpath_regs": end["registrations_offpath"],
            "offpath_s": end["registrations_offpath_s"],
            "zero_copy_mib": end["zero_copy_bytes"] / 2**20,
            "staged_mib": end["staged_bytes"] / 2**20,
            "registered_mib": end["registered_bytes"] / 2**20,
            "pool_in_use_mib": end["pool_bytes_in_use"] / 2**20,
            "pool_cached_mib": end["pool_bytes_cached"] / 2**20,
        }
        print(RESULT_TAG + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver: one launcher run per mode, then the table
# ---------------------------------------------------------------------------------------------


def run_mode(a: argparse.Namespace, mode: str, argv: list[str]) -> dict | None:
    env = dict(os.environ, STRATA_REGISTRATION=mode)
    cmd = [
        sys.executable,
        "-m",
        "strata_jax.launch",
        "-n",
        str(a.procs),
        "--grace",
        "1",
        str(Path(__file__).resolve()),
        "--child",
        *argv,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in r.stdout.splitlines():
        if RESULT_TAG in line:
            return json.loads(line.split(RESULT_TAG, 1)[1])
    print(f"# {mode}: failed (exit {r.returncode})\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.child:
        child(a)
        return 0
    import platform

    print(
        f"# strata_jax registration ablation: {a.procs} processes x 1 CPU device, "
        f"{a.mbytes:g} MiB of gradients per process in {a.tensors} tensors, pmean per step, "
        f"{a.steps} steps ({a.warmup} warm-up)"
    )
    print(
        f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    modes = [m for m in a.modes.split(",") if m]
    rows: list[dict] = []
    head = (
        f"{'rep':>3} {'mode':>9} {'first ms':>9} {'2nd ms':>7} {'steady ms':>10} "
        f"{'move1/2 ms':>11} {'faults1':>8} {'bgflt1':>7} {'new1 od/bg':>10} "
        f"{'crit regs':>9} {'after wu':>8} {'crit s':>8} {'bg regs':>7} "
        f"{'segs':>5} {'zero-copy MiB':>13} {'staged MiB':>10} {'reg MiB':>8} {'pool MiB':>8}"
    )
    print(head, flush=True)
    failed = 0
    for rep in range(a.repeats):
        # Rotate the order every repeat so that no mode always runs first (or after another).
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for mode in order:
            res = run_mode(a, mode, argv)
            if not res:
                failed += 1
                continue
            res["repeat"] = rep
            rows.append(res)
            r = res
            mv = f"{r['first_step_coll_move_ms']:.0f}/{r['second_step_coll_move_ms']:.0f}"
            od_bg = f"{r['first_step_on_demand_segs']}/{r['first_step_made_ahead_segs']}"
            print(
                f"{rep:3d} {r['mode']:>9} {r['first_step_ms']:9.1f} {r['second_step_ms']:7.1f} "
                f"{r['steady_ms']:10.2f} {mv:>11} {r['first_step_faults_max']:8d} "
                f"{r['first_step_bg_faults_max']:7d} {od_bg:>10} {r['crit_regs']:9d} "
                f"{r['crit_regs_after_warmup']:8d} {r['crit_s']:8.4f} {r['offpath_regs']:7d} "
                f"{str(r['pool_segments_before']) + '/' + str(r['pool_segments']):>5} "
                f"{r['zero_copy_mib']:13.0f} {r['staged_mib']:10.0f} "
                f"{r['registered_mib']:8.0f} {r['pool_in_use_mib']:8.0f}",
                flush=True,
            )
    summary = summarize(rows, modes)
    print(
        f"# medians over {a.repeats} run(s) per mode, spread = [min, max]; "
        "times are the max over processes"
    )
    print(
        f"{'mode':>9} {'runs':>4} {'first ms (median)':>17} {'[min, max]':>17} "
        f"{'steady ms (median)':>18} {'[min, max]':>15} {'crit regs after wu':>18}"
    )
    for mode in modes:
        m = summary.get(mode)
        if not m:
            continue
        first_rng = f"[{m['first_min']:.1f}, {m['first_max']:.1f}]"
        steady_rng = f"[{m['steady_min']:.1f}, {m['steady_max']:.1f}]"
        print(
            f"{mode:>9} {m['runs']:4d} {m['first_ms']:17.1f} {first_rng:>17} "
            f"{m['steady_ms']:18.2f} {steady_rng:>15} "
            f"{m['crit_after_wu_max']:18d}"
        )
    if {"on_alloc", "on_use", "staging"} <= summary.keys():
        oa, ou, st = summary["on_alloc"], summary["on_use"], summary["staging"]
        print(
            f"# on_alloc vs on_use (medians): first step {oa['first_ms']:.1f} vs "
            f"{ou['first_ms']:.1f} ms ({ou['first_ms'] / oa['first_ms']:.2f}x), steady "
            f"{oa['steady_ms']:.2f} vs {ou['steady_ms']:.2f} ms; staging steady "
            f"{st['steady_ms']:.2f} ms ({st['steady_ms'] / oa['steady_ms']:.2f}x on_alloc); "
            f"on_alloc critical-path registrations after warm-up: {oa['crit_after_wu_max']} "
            "(goal 0)"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(
        a.out / "registration.json",
        {"machine": machine_info(), "args": vars(a), "runs": rows, "summary": summary},
    )
    return 0 if failed == 0 else 1


def summarize(rows: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode: medians and [min, max] of the first-step and steady-state times."""
    import statistics

    out: dict[str, dict] = {}
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        first = [r["first_step_ms"] for r in rs]
        steady = [r["steady_ms"] for r in rs]
        out[mode] = {
            "runs": len(rs),
            "first_ms": statistics.median(first),
            "first_min": min(first),
            "first_max": max(first),
            "steady_ms": statistics.median(steady),
            "steady_min": min(steady),
            "steady_max": max(steady),
            "crit_after_wu_max": max(r["crit_regs_after_warmup"] for r in rs),
            "all_correct": all(r["correct"] for r in rs),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
