"""Check that strata is at least as fast as jax.lax over XLA's MPI collectives at every point.

Runs ``benchmarks/collectives.py --impl strata,mpi`` (strata and jax.lax over XLA's MPI
collectives interleaved call by call in each run) several times for every process count and
way of starting the ranks, alternating them run by run, and judges each point (operator, size)
by the median over the runs of XLA over MPI's time over strata's (above 1: strata faster):

* ``launcher``: ``collectives.py --procs P``, which starts its ranks through
  ``python -m strata_jax.launch -n P --engine mpi`` (mpirun underneath, the allocator preloaded);
* ``mpirun``: ``mpirun -n P python collectives.py --procs P`` (the allocator hooked into jaxlib
  by ``import strata_jax``), as docs/guide/hosts.md runs it.

A point fails when its median ratio is below ``--goal`` (default 1.0) by more than the noise:
half the spread of its ratios over the runs (max - min) / 2, at least ``--noise-floor`` (0.02).
Each run's load average is printed at its start. Exit status 0 when no point fails, 1 when one
does, 2 on a run that did not complete; without MPI (no ``mpirun`` on PATH, or
``MPITRAMPOLINE_LIB`` naming no file: MPIwrapper is not built here) it prints why and exits 0
(``--require``: 2).

Usage::

    export MPITRAMPOLINE_LIB=/path/to/libmpiwrapper.so
    python benchmarks/vs_mpi.py       # 2 and 4 processes, both ways, 3 runs, 4 KiB - 4 MiB by 4
    python benchmarks/vs_mpi.py --procs 2 --mode mpirun -b 64K -e 1M -f 2 --runs 5 --goal 1.3

The JSON of every run and a summary (``vs_mpi.json``) go to ``--out``. tests/test_vs_mpi.py
runs the default check (``-m slow``: 5-10 minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COLLECTIVES = HERE / "collectives.py"
OPS = "psum,all_gather,psum_scatter,all_to_all,ppermute"
MODES = ("launcher", "mpirun")


def unavailable() -> str | None:
    """Why XLA over MPI cannot run here (no ``mpirun``, or ``MPITRAMPOLINE_LIB`` naming no
    file), or None when it can."""
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH (Open MPI: package openmpi-bin)"
    lib = os.environ.get("MPITRAMPOLINE_LIB", "")
    if not lib:
        return (
            "MPITRAMPOLINE_LIB is not set (it must name MPIwrapper's libmpiwrapper.so, built "
            "against this machine's MPI: docs/guide/hosts.md, XLA over MPI)"
        )
    if not os.path.isfile(lib):
        return f"MPITRAMPOLINE_LIB={lib!r} names no file (MPIwrapper is not built here)"
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--procs", default="2,4", help="process counts, a comma list (2,4)")
    p.add_argument(
        "--mode", default=",".join(MODES), help="launcher, mpirun or both, a comma list (both)"
    )
    p.add_argument("--runs", type=int, default=3, help="runs of each (procs, mode), alternated (3)")
    p.add_argument("--op", default=OPS, help=f"operators, a comma list ({OPS})")
    p.add_argument("-b", "--min-bytes", default="4K", help="smallest size per rank (4K)")
    p.add_argument("-e", "--max-bytes", default="4M", help="largest size per rank (4M)")
    p.add_argument("-f", "--factor", default="4", help="size multiplier between points (4)")
    p.add_argument("--goal", type=float, default=1.0, help="least median ratio per point (1.0)")
    p.add_argument(
        "--noise-floor", type=float, default=0.02, help="least noise allowed a point (0.02)"
    )
    p.add_argument("--out", type=Path, default=Path("bench_out/vs_mpi"), help="output folder")
    p.add_argument(
        "--require", action="store_true", help="exit 2 instead of 0 when MPI is unavailable"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (600)")
    a = p.parse_args(argv)
    a.procs_list = [int(v) for v in a.procs.split(",") if v.strip()]
    a.modes = [m.strip() for m in a.mode.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--mode takes {', '.join(MODES)}; got {a.mode!r}")
    if not a.procs_list or min(a.procs_list) < 2:
        p.error("--procs takes process counts of 2 or more")
    if a.runs < 1:
        p.error("--runs must be at least 1")
    return a


def command(procs: int, mode: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The command line of one run of collectives.py."""
    bench = [
        str(COLLECTIVES),
        "--procs",
        str(procs),
        "--impl",
        "strata,mpi",
        "--op",
        args.op,
        "-b",
        str(args.min_bytes),
        "-e",
        str(args.max_bytes),
        "-f",
        str(args.factor),
        "--no-progress",
        "--out",
        str(out),
    ]
    if mode == "launcher":
        return [sys.executable, *bench]
    head = ["mpirun", "-n", str(procs), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        head.append("--allow-run-as-root")
    head += ["-x", "MPITRAMPOLINE_LIB", "-x", "PATH"]
    return [*head, sys.executable, *bench]


def run_once(
    procs: int, mode: str, args: argparse.Namespace, out: Path
) -> tuple[list[dict[str, Any]] | None, str]:
    """One run; (its rows, or None when it did not complete, and its load at the start)."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    out.mkdir(parents=True, exist_ok=True)
    cmd = command(procs, mode, args, out)
    log = out / "run.log"
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = -1
    found = sorted(out.glob(f"collectives_*_p{procs}_mpi.json"))
    if not found:
        return None, load
    rows = json.loads(found[-1].read_text())["rows"]
    if rc != 0:  # a point's #wrong or an error: the rows say which
        bad = [r for r in rows if r.get("wrong") or r.get("error")]
        if bad:
            return None, load
    return rows, load


def ratios(runs: list[list[dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (op, size): strata's and XLA over MPI's times and their ratio in every run."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for rows in runs:
        by: dict[tuple[str, int], dict[str, float]] = {}
        for r in rows:
            if r.get("time_us"):
                by.setdefault((r["op"], r["size_bytes"]), {})[r["impl"]] = r["time_us"]
        for key, t in by.items():
            if "strata" in t and "mpi" in t:
                d = out.setdefault(key, {"strata": [], "mpi": [], "ratio": []})
                d["strata"].append(t["strata"])
                d["mpi"].append(t["mpi"])
                d["ratio"].append(t["mpi"] / t["strata"])
    return out


def judge(rs: list[float], goal: float, floor: float) -> tuple[float, float, bool]:
    """(median, noise, failed) of one point's ratios over the runs."""
    med = statistics.median(rs)
    noise = max(floor, (max(rs) - min(rs)) / 2)
    return med, noise, med + noise < goal


def size_str(n: int) -> str:
    for unit, s in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{s}"
    return str(n)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"skipped: XLA over MPI is not available here: {reason}", flush=True)
        return 2 if args.require else 0
    combos = [(p, m) for p in args.procs_list for m in args.modes]
    runs: dict[tuple[int, str], list[list[dict[str, Any]]]] = {c: [] for c in combos}
    loads: dict[tuple[int, str], list[str]] = {c: [] for c in combos}
    failed_runs = 0
    t0 = time.time()
    for k in range(args.runs):
        for procs, mode in combos:
            out = args.out / f"p{procs}-{mode}-run{k + 1}"
            rows, load = run_once(procs, mode, args, out)
            loads[(procs, mode)].append(load)
            status = "ok" if rows is not None else f"did not complete (see {out / 'run.log'})"
            print(f"# run {k + 1}, {procs} processes, {mode}: load {load}: {status}", flush=True)
            if rows is None:
                failed_runs += 1
            else:
                runs[(procs, mode)].append(rows)
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    failed: list[str] = []
    print(
        f"#\n# XLA over MPI's time over strata's (above 1: strata faster), median of {args.runs}"
        f" alternated runs per column; '!' marks a point below {args.goal:g}x by more than the"
        f" noise (half the spread over the runs, at least {args.noise_floor:g}), '~' one below"
        " it within the noise; strata and MPI us are medians"
    )
    tables = {c: ratios(runs[c]) for c in combos}
    keys = list(dict.fromkeys(k for c in combos for k in tables[c]))
    head = "| op | size | " + " | ".join(f"{p} procs, {m}" for p, m in combos) + " |"
    print(head)
    print("|---|---|" + "---|" * len(combos))
    for op, size in keys:
        cells = []
        for c in combos:
            d = tables[c].get((op, size))
            if not d:
                cells.append("-")
                continue
            med, noise, bad = judge(d["ratio"], args.goal, args.noise_floor)
            mark = "!" if bad else ("~" if med < args.goal else "")
            cells.append(
                f"{statistics.median(d['strata']):.1f} / {statistics.median(d['mpi']):.1f} us"
                f" {med:.2f}x{mark}"
            )
            summary["points"].append(
                {
                    "procs": c[0],
                    "mode": c[1],
                    "op": op,
                    "size_bytes": size,
                    "strata_us": d["strata"],
                    "mpi_us": d["mpi"],
                    "ratio": d["ratio"],
                    "median": med,
                    "noise": noise,
                    "failed": bad,
                }
            )
            if bad:
                failed.append(f"{op} {size_str(size)} ({c[0]} processes, {c[1]}: {med:.2f}x)")
        print(f"| {op} | {size_str(size)} | " + " | ".join(cells) + " |")
    for c in combos:
        meds = [judge(d["ratio"], args.goal, args.noise_floor)[0] for d in tables[c].values()]
        if meds:
            below = sum(m < args.goal for m in meds)
            print(
                f"# {c[0]} processes, {c[1]}: median point {statistics.median(meds):.2f}x, "
                f"{below} of {len(meds)} medians below {args.goal:g}x; loads at the runs' "
                f"starts: {'; '.join(loads[c])}"
            )
    summary["failed"] = failed
    summary["elapsed_s"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_mpi.json").write_text(json.dumps(summary, indent=1))
    if failed:
        print(f"# FAILED: {len(failed)} point(s) below {args.goal:g}x: " + "; ".join(failed))
    else:
        print(f"# OK: no point below {args.goal:g}x outside the noise")
    if failed_runs:
        print(f"# {failed_runs} run(s) did not complete")
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
