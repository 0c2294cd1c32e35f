"""Many processes on one host, many simulated hosts, several devices per process: every
operator against numpy (tests/mp_scripts/check_at_scale.py, the nine collectives; check_ragged,
check_moe, check_moe_low_latency and check_pytree for ragged_all_to_all, MoE dispatch/combine,
the low-latency pair and the all-reduce combiner's list call), with nothing left in /dev/shm.

All behind ``-m slow``: 64 processes take about a minute of this 2-core machine and ~14 GiB of
its memory (JAX's own ~200 MiB per process, most of it), 96 about 20 GiB. Run them alone, under
the team's CPU lock, with nothing else holding memory (``free -g``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mp_util import netns_skip_reason

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ALL = [
    "check_at_scale.py",
    "--",
    "check_ragged.py",
    "--",
    "check_moe.py",
    "--",
    "check_moe_low_latency.py",
    "--",
    "check_pytree.py",
]


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


def _run(nproc: int, flags: list[str], scripts: list[str], need_gib: float):
    if _meminfo_available() < need_gib * (1 << 30):
        pytest.skip(f"needs {need_gib} GiB of available memory")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "JAX_"))}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    before = set(os.listdir("/dev/shm"))
    cmd = [sys.executable, "-m", "strata_jax.launch", "-n", str(nproc), *flags]
    cmd += [str(HERE / "mp_scripts" / "run_checks.py"), *scripts]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    done = [ln for ln in r.stdout.splitlines() if ln.endswith("== run_checks: all done")]
    assert len(done) == nproc, out[-4000:]
    assert "MISMATCH" not in out
    assert set(os.listdir("/dev/shm")) <= before, "left in /dev/shm"
    return r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [8, 16, 32, 64, 96])
def test_every_collective_on_n_processes(nproc):
    out = _run(nproc, [], ["check_at_scale.py"], need_gib=0.25 * nproc)
    assert out.count(f"on {nproc} devices, fabric shm, 1 fabric(s)") == nproc


# Memory the machine must have free for every operator at N processes: at 96 the lowest
# MemAvailable was 4.6 GiB of 22 (the checks' references are per process since they held
# ~150-250 MiB each and the OOM killer ended the job at 96).
EVERY_OPERATOR_GIB = {8: 3, 32: 9, 64: 14, 96: 19}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", sorted(EVERY_OPERATOR_GIB))
def test_every_operator_on_n_processes(nproc):
    out = _run(nproc, [], ALL, need_gib=EVERY_OPERATOR_GIB[nproc])
    for tag in ("OK scale ", "OK ragged ", "OK moe low-latency ", "OK pytree "):
        assert out.count(tag) == nproc, tag
    assert out.count("OK moe ") == 2 * nproc  # dispatch/combine and the low-latency pair


@pytest.mark.slow
def test_every_collective_on_8_hosts_of_4():
    out = _run(32, ["--hosts", "8"], ["check_at_scale.py"], need_gib=10)
    assert out.count("on 32 devices, fabric shm, 8 fabric(s)") == 32


# Across hosts: every operator but ragged_all_to_all and the low-latency MoE pair, which keep
# to one fabric (each raises NotImplementedError saying so when its group spans hosts).
ACROSS_HOSTS = ["check_at_scale.py", "--", "check_moe.py", "--", "check_pytree.py"]


@pytest.mark.slow
def test_every_operator_on_8_hosts_of_4_with_their_own_network():
    if (reason := netns_skip_reason()) is not None:
        pytest.skip(reason)
    out = _run(32, ["--hosts", "8", "--netns"], ACROSS_HOSTS, need_gib=10)
    assert out.count("on 32 devices, fabric shm, 8 fabric(s)") == 32
    for tag in ("OK moe ", "OK pytree "):
        assert out.count(tag) == 32, tag


@pytest.mark.slow
def test_every_operator_on_8_processes_of_4_devices():
    out = _run(8, ["--devices-per-proc", "4"], ALL, need_gib=4)
    assert out.count("on 32 devices, fabric shm, 1 fabric(s)") == 8


def _scale_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "benchmarks" / "scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scale_fit_reports_the_growth_exponent():
    """benchmarks/scale.py's verdict on start-up CPU against N: the log-log exponent of a fit."""
    bench = _scale_bench()
    ns = [2, 8, 16, 32, 64, 96]
    assert bench._power(ns, [0.05 + 0 * n for n in ns]) == pytest.approx(0.0, abs=1e-9)
    assert bench._power(ns, [0.003 * n for n in ns]) == pytest.approx(1.0)
    assert bench._power(ns, [1e-4 * n * n for n in ns]) == pytest.approx(2.0)
    assert bench._fit(ns, [1 + 2 * n for n in ns]) == pytest.approx((1.0, 2.0))


def test_scale_model_bytes_per_algorithm():
    """docs/scaling.md's peer bytes per rank and call, which scale.py compares with the counters."""
    bench = _scale_bench()
    mib = 1 << 20
    assert bench.model_peer_bytes("psum_1m", 96, "two_shot") == 2 * 95 * mib / 96
    assert bench.model_peer_bytes("psum_1m", 96, "one_shot") == 95 * mib
    assert bench.model_peer_bytes("psum_4k", 8, "low_latency") == 7 * 4096
    assert bench.model_peer_bytes("ag_64k", 64, "direct") == 63 * 65536
