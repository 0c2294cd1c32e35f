"""Collectives across processes on the shared-memory fabric, started through the launcher.

Each case launches one script (tests/mp_scripts/) that batches many checks, because a process
with jax takes seconds to start: every collective against numpy on 2 and 4 processes and on
2 processes x 2 devices (a 2x2 mesh mixing local and remote peers), the three registration
modes bit for bit, MoE dispatch/combine with gradients, a peer that never arrives, and
clean-up after SIGKILL of a rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import strata_jax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PKG_PARENT = str(Path(strata_jax.__file__).resolve().parent.parent)
SCRIPTS = HERE / "mp_scripts"


def _launch(
    nproc: int,
    script: str,
    *args: str,
    devices: int = 1,
    mode: str = "on_alloc",
    tmpdir: Path | None = None,
    timeout: float = 150,
) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STRATA_", "XLA_FLAGS", "JAX_", "LD_PRELOAD"))
    }
    env["STRATA_REGISTRATION"] = mode
    # The ranks import the same strata_jax as this test process: the installed package (with
    # its native extension), or the source tree when it was built in place.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_PARENT, env.get("PYTHONPATH")]))
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    cmd = [
        sys.executable,
        "-m",
        "strata_jax.launch",
        "-n",
        str(nproc),
        "--grace",
        "1",
        "--devices-per-proc",
        str(devices),
        str(SCRIPTS / script),
        *args,
    ]
    # cwd is not the source root: `python -m` puts cwd first on sys.path, which would shadow
    # the installed package with the unbuilt source folder.
    return subprocess.run(
        cmd, env=env, cwd=PKG_PARENT, capture_output=True, text=True, timeout=timeout
    )


def _require_allocator() -> None:
    from strata_jax import launch

    if launch.alloc_library_path() is None:
        pytest.skip("libstrata_alloc.so not built: the zero-copy path needs the allocator")


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("digests")


@pytest.mark.parametrize("mode", ["on_alloc", "on_use", "staging"])
def test_two_processes_every_collective(digests, mode):
    _require_allocator()
    r = _launch(2, "check_collectives.py", str(digests), mode=mode)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(f"mode {mode}") == 2, r.stdout[-2000:]


def test_modes_give_the_same_bits(digests):
    files = sorted(digests.glob("digest-*-2-*.txt"))
    if len(files) < 6:
        pytest.skip("needs the three two-process runs above")
    per_mode = {}
    for f in files:
        _, mode, _, pid = f.stem.split("-")
        per_mode.setdefault(pid, set()).add(f.read_text())
    for pid, values in per_mode.items():
        assert len(values) == 1, f"process {pid}: modes disagree: {values}"


def test_four_processes_every_collective(digests):
    _require_allocator()
    r = _launch(4, "check_collectives.py", str(digests), mode="on_use")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK ") == 4


def test_two_processes_two_devices_each(digests):
    _require_allocator()
    r = _launch(2, "check_collectives.py", str(digests), devices=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK 110 checks") == 2, r.stdout[-2000:]


@pytest.mark.parametrize(
    "nproc,devices,mode", [(2, 1, "on_alloc"), (2, 2, "on_alloc"), (2, 1, "staging")]
)
def test_moe_dispatch_combine_across_processes(nproc, devices, mode):
    """moe.dispatch/combine and their gradients (the weights cotangent goes through the
    gather op) across processes, against numpy; 2x2 mixes local and remote peers."""
    _require_allocator()
    r = _launch(nproc, "check_moe.py", devices=devices, mode=mode)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(f"OK moe {15 * devices} checks") == nproc, r.stdout[-2000:]


def test_timeout_then_sigkill_leaves_nothing():
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="strata-t-", dir="/tmp"))  # short: socket paths
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    try:
        r = _launch(2, "timeout_then_kill.py", tmpdir=tmp, timeout=120)
        out = r.stdout + r.stderr
        assert "TIMEOUT-OK" in out, out[-3000:]
        assert "rank 1 was killed by SIGKILL" in out, out[-3000:]
        assert r.returncode != 0
        left = list(tmp.iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert left == [], f"left behind: {left}"
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after <= shm_before, f"left in /dev/shm: {shm_after - shm_before}"


def test_uncaught_exception_on_one_rank_stops_everyone_quickly():
    """A Python exception on rank 1 ends the job within seconds and names rank 1 (without
    strata's excepthook the rank would hang in jax.distributed's shutdown)."""
    import time

    t = time.time()
    r = _launch(4, "raise_on_rank1.py", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "boom on rank 1" in out, out[-3000:]
    assert "rank 1 exited with code 1" in out, out[-3000:]
    assert time.time() - t < 60, f"took {time.time() - t:.0f} s"
