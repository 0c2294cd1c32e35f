"""Failures in a job of several simulated hosts (``launch --hosts``): what each process is told
when a rank on another host dies or never comes."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
from _mp_util import run_launcher as _launch


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_rank_of_other_fabric_killed():
    tmp = Path(tempfile.mkdtemp(prefix="strata-t-", dir="/tmp"))  # short: socket paths
    try:
        r = _launch(["-n", "4", "--hosts", "2"], "kill_other_fabric.py", tmpdir=tmp, timeout=120)
        left = list(tmp.iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    # Whichever the launcher sees first: rank 3's death, or a survivor that already failed on
    # the closed inter-fabric (gloo) connection to it.
    assert "rank 3 was killed by SIGKILL" in out or "Connection closed by peer" in out, out[-3000:]
    assert left == [], f"left behind: {left}"


def test_timeout_on_other_host_names_job_processes():
    """launch -n 4 --hosts 2: process 3 never calls psums inside host 1 (the low-latency and
    the general path) nor one across both hosts. Process 2's timeouts name the job's processes
    (2 reporting, 3 missing) and the devices; for the call across hosts every message says that
    a rank missing within a host may itself wait for another host. Before: each host's fabric
    numbers its processes from 0, and the messages said "process 0" for process 2 and named no
    device for the missing rank."""
    r = _launch(["-n", "4", "--hosts", "2"], "stuck_rank_hosts.py", timeout=150)
    out = r.stdout + r.stderr
    dev = {int(m[1]): m[2] for m in re.finditer(r"\[rank (\d)\] DEVICE (\d+)", r.stdout)}
    assert len(dev) == 4, out[-4000:]
    for rank in (0, 2, 3):
        assert f"[rank {rank}] DONE" in r.stdout, out[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] OK ll" in r.stdout and f"[rank {rank}] OK general" in r.stdout
    raised = {m[1]: m[2] for m in re.finditer(r"\[rank 2\] RAISED (\w+) (.*)", r.stdout)}
    assert set(raised) == {"ll", "general", "across"}, out[-4000:]
    hint = "a rank missing here may itself be waiting for a process on another host"
    for call, (me, missing, path) in {
        "ll": ("rank 0 (partition 2", "rank 1", True),
        "general": ("rank 1 (partition 3", "rank 0", False),
        "across": ("rank 0 (partition 2", "rank 1", True),
    }.items():
        msg = raised[call]
        assert "timed out after 3 s" in msg and hint in msg, msg
        assert f"reported by {me}, device {dev[2]}, process 2)" in msg, msg
        assert f"where the missing run: {missing} (device {dev[3]}, process 3)" in msg, msg
        assert ("low-latency path" in msg) == path, msg
    # Host 0 cannot see process 3: its message names its own partner, and says why that can be.
    m = re.search(r"\[rank 0\] RAISED across (.*)", r.stdout)
    assert m and hint in m[1] and f"device {dev[1]}, process 1)" in m[1], out[-4000:]
    assert "[rank 3] RAISED" not in r.stdout, out[-4000:]
