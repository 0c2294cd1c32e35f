"""Speed-up against the baseline's communication share: each workload over a few model sizes.

Runs ``train_moe.py``, ``serve_moe.py`` and ``train_recsys.py`` (short runs, each with strata,
its baseline and ``nocomm`` stepped in turns) at a few model sizes per workload (``POINTS``:
d_model, tokens per device and experts for the MoE jobs, embedding width and bag size for
DLRM), in one process or under ``strata_jax.launch -n N`` (``--procs N``), and collects the
JSON each run writes. For every point it takes the baseline's communication share
(``(baseline - nocomm) / baseline``, medians of the same turns:
``_report.communication_share``) and the speed-ups of strata and of nocomm over the baseline
(baseline time / this time), and writes one PNG per workload (matplotlib): speed-up (y)
against the share (x), one marker per point labelled by its configuration. nocomm's speed-up
is ``1 / (1 - share)`` by construction: the most any exchange can give at that share; strata's
marker below it says how much of the exchange time it
removes. Serving has two panels: the decode step (p50) and TTFT (p50).

Run::

    python benchmarks/regime_sweep.py                        # all workloads, one process
    python benchmarks/regime_sweep.py --workload train_recsys --procs 4
    python benchmarks/regime_sweep.py --plot-only --out docs/perf/regime_sweep

Output (``--out``): ``regime_sweep.json`` (every point: its flags, the three times, share,
speed-ups, the part of the exchange strata removes, the load at its start; the machine) and
``regime_<workload>.png``; each run's own output and JSON under ``--runs``. A sweep of some
workloads keeps the other workloads' points of an earlier ``regime_sweep.json`` at the same
``--procs`` (run them one by one). A sweep of the
default points takes about 10 minutes in one process on the 2-core machine of
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _args import parse_list  # noqa: E402
from _machine import machine_info, print_machine  # noqa: E402
from _report import NO_MATPLOTLIB, pyplot, write_json  # noqa: E402

WORKLOADS = ("train_moe", "serve_moe", "train_recsys")
BASELINE = {"train_moe": "xla_sort", "serve_moe": "xla_sort", "train_recsys": "xla"}
# Flags of every run of a workload: short runs, strata, the baseline and nocomm in turns.
SHORT = {
    "train_moe": ["--steps", "14", "--warmup", "4"],
    "serve_moe": ["--requests", "2", "--train-steps", "10", "--impl", "strata,xla_sort,nocomm"],
    "train_recsys": ["--steps", "14", "--warmup", "4", "--eval-every", "7"],
}
# The model sizes, per workload: label -> flags (no flags: the script's defaults); T: tokens per
# device (MoE training: --batch x --seq; serving: --batch, one decode step), E: experts.
POINTS: dict[str, dict[str, list[str]]] = {
    "train_moe": {
        "d128 T256": [],
        "d128 T64": ["--batch", "1", "--seq", "64"],
        "d512 T64": ["--d-model", "512", "--heads", "8", "--batch", "1", "--seq", "64"],
    },
    "serve_moe": {
        "d128 T8 E8": [],
        "d256 T32 E32": ["--d-model", "256", "--batch", "32", "--experts", "32"],
        "d256 T32 E64": ["--d-model", "256", "--batch", "32", "--experts", "64"],
    },
    "train_recsys": {
        "dim64 bag20": [],
        "dim128 bag10": ["--dim", "128", "--max-bag", "10"],
        "dim256 bag5": ["--dim", "256", "--max-bag", "5"],
    },
}
# Where a workload's JSON keeps the times the share is computed from: (label, JSON key).
PANELS = {
    "train_moe": [("training step (median)", None)],
    "serve_moe": [("decode step (p50)", "step_p50"), ("TTFT (p50)", "ttft_p50")],
    "train_recsys": [("training step (median)", None)],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--workload",
        default="all",
        help=f"comma list of {WORKLOADS} (or 'all')",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="1: in-process devices (8, as the scripts default to); N > 1: every run under "
        "python -m strata_jax.launch -n N (one device per process)",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out/regime_sweep"))
    p.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="folder for each run's output and JSON (default: <out>/runs, or "
        "bench_out/regime_sweep_runs when --out is under docs/)",
    )
    p.add_argument(
        "--plot-only",
        action="store_true",
        help="run nothing: redraw the PNGs from <out>/regime_sweep.json",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds one run may take before it is stopped and recorded as failed",
    )
    args = p.parse_args(argv)
    try:
        args.workloads = parse_list(args.workload, WORKLOADS)
    except ValueError as e:
        p.error(f"--workload: {e}")
    if args.procs < 1:
        p.error(f"--procs must be >= 1, got {args.procs}")
    if args.runs is None:
        under_docs = "docs" in args.out.resolve().parts
        args.runs = Path("bench_out/regime_sweep_runs") if under_docs else args.out / "runs"
    return args


def command(workload: str, flags: list[str], procs: int, out: Path) -> list[str]:
    """The command line of one run (``--no-progress``, its JSON under ``out``)."""
    script = str(HERE / f"{workload}.py")
    cmd = [sys.executable]
    if procs > 1:
        cmd += ["-m", "strata_jax.launch", "-n", str(procs)]
    return [*cmd, script, *SHORT[workload], *flags, "--out", str(out), "--no-progress"]


def point_record(workload: str, label: str, flags: list[str], data: dict[str, Any]) -> dict:
    """One point of the sweep from a run's JSON: per panel the baseline's share and the
    speed-ups of strata and nocomm over the baseline."""
    comm = data.get("communication") or {}
    panels = {}
    for name, key in PANELS[workload]:
        c = comm.get(key) if key else comm
        if not c:
            continue
        panels[name] = {
            "comm_share": c["comm_share"],
            "strata_removes": c["strata_removes"],
            "baseline_s": c["baseline_s"],
            "strata_s": c["strata_s"],
            "nocomm_s": c["nocomm_s"],
            "strata_speedup": c["baseline_s"] / c["strata_s"],
            "nocomm_speedup": c["baseline_s"] / c["nocomm_s"],
        }
    return {
        "workload": workload,
        "label": label,
        "flags": flags,
        "baseline": BASELINE[workload],
        "panels": panels,
        "load_avg": data.get("machine", {}).get("load_avg"),
        "command": data.get("machine", {}).get("command"),
        "commit": data.get("machine", {}).get("commit"),
    }


def run_point(workload: str, label: str, flags: list[str], args: argparse.Namespace) -> dict:
    """Run one point (its output to ``<runs>/<workload>/<label>/log.txt``) and read its JSON."""
    out = args.runs / f"p{args.procs}" / workload / label.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    cmd = command(workload, flags, args.procs, out)
    if workload == "serve_moe":  # one checkpoint per model size, reused by later sweeps
        cmd += ["--ckpt-dir", str(args.runs / "serve_moe_checkpoints")]
    t0 = time.perf_counter()
    log = out / "log.txt"
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.perf_counter() - t0
    js = out / f"{workload}.json"
    if rc != 0 or not js.exists():
        tail = log.read_text()[-1500:]
        print(f"# {workload} {label}: FAILED (exit {rc}, {took:.0f} s); log {log}:\n{tail}")
        return {"workload": workload, "label": label, "flags": flags, "failed": str(rc)}
    rec = point_record(workload, label, flags, json.loads(js.read_text()))
    rec["wall_s"] = took
    for name, pnl in rec["panels"].items():
        removes = pnl["strata_removes"]
        print(
            f"  {workload:<12} {label:<14} {name:<24} share {100 * pnl['comm_share']:5.1f}%  "
            f"strata {pnl['strata_speedup']:.2f}x  nocomm {pnl['nocomm_speedup']:.2f}x  removes "
            + (f"{100 * removes:.0f}%" if removes is not None else "-")
            + f"  (load {rec['load_avg'][0]:.1f}, {took:.0f} s)",
            flush=True,
        )
    return rec


def draw_panel(ax: Any, workload: str, name: str, points: list[dict[str, Any]]) -> None:
    """One panel on a matplotlib Axes: for the timed quantity ``name`` of ``workload``, the
    speed-up over the baseline (y) of strata and of nocomm against the baseline's communication
    share in % (x), each point labelled by its configuration; the paper's regime shaded. Also
    used by the docs (docs/_ext/strata_perf.py) to draw a sweep's JSON."""
    pts = [p for p in points if p["workload"] == workload and name in p.get("panels", {})]
    for series, marker in (("strata", "o"), ("nocomm", "s")):
        xs = [100 * p["panels"][name]["comm_share"] for p in pts]
        ys = [p["panels"][name][f"{series}_speedup"] for p in pts]
        ax.scatter(xs, ys, marker=marker, label=series, zorder=3)
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvspan(30, 45, color="tab:green", alpha=0.08, label="paper's regime (30-45%)")
    ax.set_xlabel(f"{BASELINE[workload]}'s communication share (% of its time, vs nocomm)")
    ax.set_ylabel(f"speed-up over {BASELINE[workload]} (x)")
    ax.set_title(f"{workload}: {name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot(path: Path, workload: str, points: list[dict[str, Any]], title: str) -> bool:
    """One PNG for one workload: a panel per timed quantity (:func:`draw_panel`)."""
    plt = pyplot()
    if plt is None:
        return False
    names = [n for n, _ in PANELS[workload]]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        draw_panel(ax, workload, name, points)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_plots(
    summary: dict[str, Any], out: Path, workloads: Sequence[str] = WORKLOADS
) -> list[Path]:
    """The PNGs of a ``regime_sweep.json`` summary, one per workload it holds (of
    ``workloads``)."""
    where = "one process" if summary["procs"] == 1 else f"launch -n {summary['procs']}"
    written = []
    for workload in workloads:
        pts = [p for p in summary["points"] if p["workload"] == workload and "panels" in p]
        if not pts:
            continue
        png = out / f"regime_{workload}.png"
        title = (
            f"{where}, {summary['machine'].get('date', '?')}, commit "
            f"{str(summary['machine'].get('commit'))[:12]}; short runs, medians of the same turns"
        )
        if plot(png, workload, pts, title):
            written.append(png)
    return written


def _read_summary(js: Path) -> dict[str, Any]:
    """The ``regime_sweep.json`` at ``js``; SystemExit naming the file if it is not one this
    script wrote (not JSON, or without ``procs``, ``machine`` and a list of ``points``)."""
    try:
        summary = json.loads(js.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--plot-only: {js} is not readable JSON ({e}); rerun the sweep") from e
    ok = (
        isinstance(summary, dict)
        and isinstance(summary.get("points"), list)
        and all(isinstance(p, dict) and "workload" in p for p in summary["points"])
        and "procs" in summary
        and isinstance(summary.get("machine"), dict)
    )
    if not ok:
        raise SystemExit(
            f"--plot-only: {js} is not a regime_sweep.json written by this script (it needs "
            "'procs', 'machine' and a list of 'points'); rerun the sweep"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    js = args.out / "regime_sweep.json"
    if args.plot_only:
        if not js.exists():
            raise SystemExit(f"--plot-only: {js} does not exist (run the sweep first)")
        summary = _read_summary(js)
        if pyplot() is None:
            raise SystemExit(f"--plot-only: {NO_MATPLOTLIB}")
    else:
        info = machine_info()
        print_machine(info)
        points = []
        if js.exists():  # a sweep of other workloads at the same placement: keep its points
            old = json.loads(js.read_text())
            if old.get("procs") == args.procs:
                points = [p for p in old["points"] if p["workload"] not in args.workloads]
        for workload in args.workloads:
            for label, flags in POINTS[workload].items():
                points.append(run_point(workload, label, flags, args))
        summary = {"machine": info, "procs": args.procs, "short": SHORT, "points": points}
        write_json(js, summary)
        print(f"# wrote {js}")
    for png in write_plots(summary, args.out, args.workloads):
        print(f"# wrote {png}")
    if pyplot() is None:
        print(f"# {NO_MATPLOTLIB}")
    failed = [p for p in summary["points"] if "failed" in p]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
