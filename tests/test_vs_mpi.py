"""benchmarks/vs_mpi.py: strata against jax.lax over XLA's MPI collectives, every point.

The slow test runs the check itself (2 and 4 processes, under strata's launcher and under
mpirun, three alternated runs of collectives.py from 4 KiB to 4 MiB per rank: 5-10 minutes
here) and fails when a point's median ratio is below 1.0x by more than its noise; it skips,
saying why, where MPIwrapper is not built (MPITRAMPOLINE_LIB names no file) or mpirun is
missing. The quick tests check how the script judges a point, on made-up rows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import vs_mpi  # noqa: E402


def _rows(op: str, size: int, strata_us: float, mpi_us: float) -> list[dict]:
    return [
        {"op": op, "size_bytes": size, "impl": "strata", "time_us": strata_us},
        {"op": op, "size_bytes": size, "impl": "mpi", "time_us": mpi_us},
    ]


def test_judge_takes_the_median_and_the_spread():
    # Below 1.0x in every run, by more than the noise: a loss.
    med, noise, bad = vs_mpi.judge([0.90, 0.92, 0.93], 1.0, 0.02)
    assert med == pytest.approx(0.92) and noise == pytest.approx(0.02) and bad
    # One run at 1.10x: the spread covers 1.0x, so the median of 0.95x is noise.
    med, noise, bad = vs_mpi.judge([0.95, 0.94, 1.10], 1.0, 0.02)
    assert med == pytest.approx(0.95) and noise == pytest.approx(0.08) and not bad
    # Within the floor of the noise.
    assert not vs_mpi.judge([0.99, 0.985, 0.99], 1.0, 0.02)[2]
    assert vs_mpi.judge([1.25, 1.26, 1.27], 1.3, 0.02)[2]


def test_ratios_pair_each_run_by_point():
    runs = [
        _rows("psum", 4096, 10.0, 12.0) + _rows("ppermute", 4096, 10.0, 9.0),
        _rows("psum", 4096, 10.0, 11.0) + _rows("ppermute", 4096, 8.0, 9.0),
    ]
    r = vs_mpi.ratios(runs)
    assert r[("psum", 4096)]["ratio"] == pytest.approx([1.2, 1.1])
    assert r[("ppermute", 4096)]["ratio"] == pytest.approx([0.9, 1.125])
    assert r[("ppermute", 4096)]["strata"] == [10.0, 8.0]


def test_commands_of_both_modes(tmp_path, monkeypatch):
    args = vs_mpi.parse_args(["--procs", "2", "--mode", "launcher,mpirun", "-b", "64K"])
    launcher = vs_mpi.command(2, "launcher", args, tmp_path)
    assert launcher[:2] == [sys.executable, str(BENCH / "collectives.py")]
    assert "--procs" in launcher and "strata,mpi" in launcher and "64K" in launcher
    mpirun = vs_mpi.command(2, "mpirun", args, tmp_path)
    assert mpirun[:3] == ["mpirun", "-n", "2"] and "MPITRAMPOLINE_LIB" in mpirun
    with pytest.raises(SystemExit):
        vs_mpi.parse_args(["--mode", "srun"])


def test_skips_without_mpi(monkeypatch, capsys):
    monkeypatch.setenv("MPITRAMPOLINE_LIB", "/nonexistent/libmpiwrapper.so")
    assert vs_mpi.main(["--runs", "1"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert vs_mpi.main(["--runs", "1", "--require"]) == 2


@pytest.mark.slow  # 5-10 minutes: 12 runs of collectives.py across 2 and 4 processes
def test_strata_at_least_as_fast_as_xla_over_mpi(tmp_path):
    reason = vs_mpi.unavailable()
    if reason is not None:
        pytest.skip(reason)
    r = subprocess.run(
        [sys.executable, str(BENCH / "vs_mpi.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "# OK: no point below 1x outside the noise" in out, out[-6000:]
