"""strata_jax under Open MPI's mpirun, without strata's launcher.

``mpirun -n 2 python script.py`` with ``strata_jax.init()`` must give registration on
allocation: ``import strata_jax`` hooks libstrata_alloc into jaxlib (no LD_PRELOAD), so a large
psum reads the peers' own buffers (``zero_copy_bytes > 0``, ``staged_bytes == 0``). With the
hook turned off the mode in effect is reported as ``staging`` (never ``on_alloc`` while every
byte is staged) and init() says in one line what to change; ``strata-run`` (LD_PRELOAD) after
mpirun gives registration on allocation too. Needs Open MPI's ``mpirun`` (Debian's
``openmpi-bin``, installed by .ci/run); skipped without it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from _mp_util import (
    FORGOT_INIT,
    MISUSE_CASES,
    PKG_PARENT,
    SCRIPTS,
    job_env,
    mpirun_cmd,
    mpirun_skip_reason,
    results,
)

MPIRUN = shutil.which("mpirun")
SKIP = mpirun_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _run(cmd: list[str], timeout: float = 240, **extra: str):
    env = job_env(**extra)
    r = subprocess.run(
        cmd,
        env=env,
        cwd=PKG_PARENT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, results(r.stdout)


def test_plain_mpirun_registers_on_allocation():
    """Fails before the hook: zero_copy_bytes 0 and every byte staged, yet on_alloc reported."""
    r, res = _run(mpirun_cmd(2, sys.executable, str(SCRIPTS / "mpirun_psum.py")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(res) == 2, r.stdout
    for d in res:
        assert d["ok"]
        assert d["allocator_mode"] == "hook" and d["init_allocator"] == "hook", d
        assert d["registration"] == d["init_registration"] == "on_alloc", d
        assert d["zero_copy_bytes"] > 0 and d["staged_bytes"] == 0, d
    assert "strata_jax: registration" not in r.stderr  # nothing to tell


def test_mpirun_without_allocator_reports_staging_and_the_fix():
    r, res = _run(
        mpirun_cmd(2, sys.executable, str(SCRIPTS / "mpirun_psum.py")), STRATA_ALLOC_HOOK="0"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(res) == 2, r.stdout
    for d in res:
        assert d["ok"]
        assert d["allocator_mode"] == "off", d
        assert d["registration"] == d["init_registration"] == "staging", d
        assert d["zero_copy_bytes"] == 0 and d["staged_bytes"] > 0, d
    # One message per process. mpirun forwards both processes' stderr into one stream, where
    # two lines written at the same moment can run into each other: count the messages.
    msg = "strata_jax: registration 'on_alloc' needs libstrata_alloc serving XLA's buffers"
    assert r.stderr.count(msg) == 2, r.stderr[-3000:]
    assert r.stderr.count("STRATA_ALLOC_HOOK=0") >= 2, r.stderr[-3000:]
    assert r.stderr.count("Fix: unset STRATA_ALLOC_HOOK") == 2, r.stderr[-3000:]


def test_strata_run_preload_env():
    """The wrapper's environment: the library first in LD_PRELOAD, others kept, no duplicate."""
    from strata_jax.run import preload_env

    assert preload_env({}, "/x/lib.so")["LD_PRELOAD"] == "/x/lib.so"
    env = preload_env({"LD_PRELOAD": "/a.so /x/lib.so:/b.so", "K": "v"}, "/x/lib.so")
    assert env["LD_PRELOAD"] == "/x/lib.so:/a.so:/b.so" and env["K"] == "v"


@pytest.mark.slow  # a third mpirun job (~20 s here): the hook test above covers the default run
def test_strata_run_after_mpirun_preloads_the_allocator():
    strata_run = [sys.executable, "-m", "strata_jax.run"]
    r, res = _run(mpirun_cmd(2, *strata_run, sys.executable, str(SCRIPTS / "mpirun_psum.py")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(res) == 2, r.stdout
    for d in res:
        assert d["ok"]
        assert d["allocator_mode"] == "preload", d
        assert d["registration"] == "on_alloc", d
        assert d["zero_copy_bytes"] > 0 and d["staged_bytes"] == 0, d


@pytest.mark.parametrize(
    "body, expected",
    MISUSE_CASES,
    ids=["forgot_init", "init_after_jax"],
)
def test_mpirun_misuse_fails_with_the_fix(tmp_path, body, expected):
    """Before: without init() every rank ran as its own one-process job and psum returned the
    rank's own input, silently; init() after jax said to raise a timeout it never waited for."""
    script = tmp_path / "misuse.py"
    script.write_text(body)
    r, _ = _run(mpirun_cmd(2, sys.executable, str(script)), timeout=120)
    assert r.returncode != 0, r.stdout
    assert "result" not in r.stdout and "no error" not in r.stdout, r.stdout
    # Each rank raises it, but mpirun kills the job as soon as the first rank exits non-zero
    # (Open MPI 5's prterun often before the second rank has printed): at least one says it.
    assert r.stderr.count(expected) >= 1, r.stderr[-3000:]
    if body is FORGOT_INIT:
        assert "OMPI_COMM_WORLD_SIZE=2" in r.stderr, r.stderr[-3000:]
    else:
        assert "raise the timeout" not in r.stderr, r.stderr[-3000:]


def test_workload_script_under_plain_mpirun(tmp_path):
    """train_recsys.py (its start-up is train_moe.py's, which serve_moe.py shares) under mpirun
    without strata_jax.launch: one job of 2 processes, not 2 separate one-process jobs each
    printing its own run and writing the same files (before), with the losses of strata and
    jax.lax equal and the several-process preset picked."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "train_recsys.py"
    args = ["--steps", "4", "--warmup", "1", "--eval-every", "2", "--rows", "20000"]
    args += ["--preset", "paper", "--no-progress", "--out", str(tmp_path)]
    r, _ = _run(mpirun_cmd(2, sys.executable, str(script), *args), timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("# jax        :") == 1, r.stdout[-3000:]  # process 0 reports
    assert "2 process(es), 1 local" in r.stdout, r.stdout[-3000:]
    assert "# preset     : paper (several processes)" in r.stdout, r.stdout[-3000:]
    assert "loss curves strata vs xla" in r.stdout and "OK" in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "train_recsys.json").is_file()
