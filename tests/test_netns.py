"""``python -m strata_jax.launch --netns``: simulated hosts with their own network, UTS and mount
namespaces, joined by (shaped) veth links to a bridge.

Every operator over 2 hosts in this mode against jax.lax over gloo runs in
``test_scaleout.py::test_two_hosts_every_collective`` (one launch shared with the other
simulated-host checks). Here: a whole host killed mid-run (the survivors stop fast, the dead
ranks are named, nothing is left: no namespace, veth, bridge, run dir or /dev/shm segment), a
Ctrl-C of the launcher, and the refusal where the launcher is not root or a command is missing.
Tests that need namespaces skip, saying why, where they cannot be made.

``--engine mpi``: XLA's MPI collectives between the simulated hosts, the ranks started by
mpirun from the launcher (every operator strata crosses hosts with, strata's and jax.lax's,
against numpy; MPI's bytes over the links; nothing left behind, after a failed rank too).
Those tests also skip, saying why, without Open MPI's mpirun or without a ``libmpiwrapper.so``
named by ``MPITRAMPOLINE_LIB`` (CI cannot build MPIwrapper: it reaches only package registries).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from _mp_util import job_env, netns_skip_reason

import strata_jax as sj
from strata_jax import launch

HERE = Path(__file__).resolve().parent
PKG_PARENT = str(Path(sj.__file__).resolve().parent.parent)
SCRIPTS = HERE / "mp_scripts"
LAUNCH_PY = str(Path(launch.__file__).resolve())


_NETNS_REASON = netns_skip_reason()
needs_netns = pytest.mark.skipif(_NETNS_REASON is not None, reason=str(_NETNS_REASON))
MPI_WRAPPER = os.environ.get("MPITRAMPOLINE_LIB", "")


def _mpi_reason() -> str | None:
    """None when `--engine mpi` can run here, else why not."""
    if shutil.which("mpirun") is None:
        return "Open MPI's mpirun is not installed (package openmpi-bin)"
    if not (MPI_WRAPPER and os.path.isfile(MPI_WRAPPER)):
        return (
            "XLA over MPI needs MPITRAMPOLINE_LIB naming a libmpiwrapper.so built from "
            f"MPIwrapper against this machine's MPI ({MPI_WRAPPER or 'not set'}; CI cannot build "
            "it; see docs/guide/hosts.md, XLA over MPI)"
        )
    return None


needs_mpi = pytest.mark.skipif(_mpi_reason() is not None, reason=str(_mpi_reason()))


def _env(tmpdir: Path) -> dict[str, str]:
    return job_env(TMPDIR=str(tmpdir))


def _mpi_env(tmpdir: Path) -> dict[str, str]:
    return dict(_env(tmpdir), MPITRAMPOLINE_LIB=MPI_WRAPPER)


class _Leftovers:
    """What a --netns job could leave behind, seen from the root namespaces."""

    def __init__(self) -> None:
        self.links = self._links()
        self.shm = set(os.listdir("/dev/shm"))

    @staticmethod
    def _links() -> set[str]:
        r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        return {ln.split(":")[1].strip().split("@")[0] for ln in r.stdout.splitlines()}

    @staticmethod
    def _live_netns() -> set[str]:
        live = set()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    live.add(os.readlink(f"/proc/{pid}/ns/net").split("[")[-1].rstrip("]"))
                except OSError:
                    pass
        return live

    def check(self, launcher_stderr: str, tmpdir: Path) -> None:
        inodes = re.findall(r"net:\[(\d+)\]", launcher_stderr)
        assert len(inodes) == 3, launcher_stderr[-2000:]  # host0, host1, the switch
        # A namespace dies with its last process: the holders are killed after the ranks.
        deadline = time.monotonic() + 5
        while (alive := set(inodes) & self._live_netns()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"network namespaces left: {alive}"
        new_links = self._links() - self.links
        assert not new_links, f"links appeared in the root namespace: {new_links}"
        new_shm = {e for e in set(os.listdir("/dev/shm")) - self.shm if "strata" in e}
        assert not new_shm, f"left in /dev/shm: {new_shm}"
        assert list(tmpdir.iterdir()) == [], f"left in TMPDIR: {list(tmpdir.iterdir())}"


@pytest.fixture
def tmpdir_short():
    d = Path(tempfile.mkdtemp(prefix="strata-t-", dir="/tmp"))
    yield d
    for p in d.iterdir():
        p.unlink() if p.is_file() else None
    d.rmdir() if not any(d.iterdir()) else None


@needs_netns
def test_host_killed_survivors_stop_and_nothing_is_left(tmpdir_short):
    """Both ranks of host1 SIGKILL themselves mid-psum (across the shaped 1 Gbit/s link); the
    launcher names them with their host, stops host0's ranks and frees every namespace, link,
    run dir and /dev/shm segment (the ranks made one each, in their host's private tmpfs)."""
    before = _Leftovers()
    cmd = [sys.executable, "-m", "strata_jax.launch", "--grace", "1", "-n", "4", "--hosts", "2"]
    cmd += ["--netns", "--link-gbit", "1", str(SCRIPTS / "kill_host.py")]
    t0 = time.monotonic()
    r = subprocess.run(
        cmd, env=_env(tmpdir_short), cwd=PKG_PARENT, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert r.stdout.count("step 2 ok") == 4, out[-3000:]
    killed = re.findall(r"rank (\d) was killed by SIGKILL on (host\d)", r.stderr)
    assert killed and all(h == "host1" for _, h in killed), out[-3000:]
    # Every rank named as ended by itself is host1's (the survivors were stopped by the launcher,
    # or failed on the closed connection and exited with an error, which is also named).
    assert {int(k) for k, _ in killed} <= {2, 3}, out[-3000:]
    assert elapsed < 90, f"took {elapsed:.0f} s"
    before.check(r.stderr, tmpdir_short)


@needs_netns
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["INT", "TERM"],
)
def test_ctrl_c_frees_everything(tmpdir_short, sig):
    """SIGINT/SIGTERM to the launcher while ranks run in their namespaces: it exits 128+sig and
    nothing is left (namespaces, links, run dirs)."""
    before = _Leftovers()
    # The launcher's source file: only the standard library to import (no jax), a fast start.
    cmd = [sys.executable, LAUNCH_PY, "--grace", "1", "-n", "2", "--hosts", "2"]
    cmd += ["--netns", "--link-gbit", "10", str(SCRIPTS / "sleep_ready.py")]
    p = subprocess.Popen(
        cmd,
        env=_env(tmpdir_short),
        cwd=PKG_PARENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if len([s for s in seen if "ready" in s]) == 2:
            break
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, (seen, out, err)
    assert sorted(s.split()[-1] for s in seen if "ready" in s) == ["host0", "host1"], seen
    before.check(err, tmpdir_short)


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = launch.netns_unavailable_reason(None)
    assert reason is not None and "needs root" in reason and "uid 1000" in reason
    assert launch.main(["-n", "2", "--hosts", "2", "--netns", "script.py"]) == 2
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(OSError, match="needs root"):
        launch.launch(2, ["true"], hosts=2, netns=True)


def test_refuses_without_commands(monkeypatch, tmp_path):
    """Only unshare and nsenter on PATH: ip (and tc with a rate) are named, with the package."""
    for name in ("unshare", "nsenter"):
        f = tmp_path / name
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "ip" in launch.netns_unavailable_reason(None) and "iproute2" in (
        launch.netns_unavailable_reason(None) or ""
    )
    assert "ip, tc" in (launch.netns_unavailable_reason(10.0) or "")
    monkeypatch.setenv("PATH", "")
    assert "unshare, nsenter, ip" in (launch.netns_unavailable_reason(None) or "")


def test_refuses_paths_the_private_mounts_hide(monkeypatch, tmp_path, capsys):
    """A script, an interpreter or a working directory under /tmp (or /dev/shm) does not exist
    inside a simulated host's private mounts: the launcher says so instead of every rank
    failing with nsenter's 'No such file or directory' (exit 127)."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(launch, "netns_unavailable_reason", lambda _: None)
    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.chdir("/")
    with pytest.raises(OSError, match=r"empty /tmp .* hide .*s\.py"):
        launch.launch(2, [sys.executable, str(script)], hosts=2, netns=True)
    with pytest.raises(OSError, match="hide"):
        launch.launch(2, [sys.executable, str(script)], private_mounts=True)
    monkeypatch.chdir(tmp_path)
    assert launch.main(["-n", "2", "--private-mounts", "s.py"]) == 2
    err = capsys.readouterr().err
    # the working directory and the script (and the interpreter too, from a venv under /tmp)
    hidden = err.split(" hide ", 1)[1].split(":")[0].split(", ") if " hide " in err else []
    assert str(tmp_path) in hidden and "s.py" in hidden, err
    assert (sys.executable in hidden) == sys.executable.startswith(("/tmp/", "/dev/shm/")), err
    assert launch._hidden_by_private_mounts(["/usr/bin/env", "-c"], "/root") == []


def test_link_rate_needs_netns(capsys):
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--link-gbit", "1", "script.py"])
    assert "--link-gbit needs --netns" in capsys.readouterr().err
    with pytest.raises(ValueError, match="link_gbit"):
        launch.launch(2, ["true"], link_gbit=1.0)


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (2, 1), (4, 2)])
def test_link_bound_counts_the_bytes_a_host_must_receive(hosts, per_host):
    """benchmarks/collectives.py's link bound (OpSpec.link_bytes) against a count on labelled
    inputs: every input element gets its own id, the op runs on the ids (numpy reference), and a
    host must receive every distinct id its ranks' outputs hold from other hosts (for the
    reductions, with 2 hosts: one partial sum per output position of its ranks)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import _collective_ops as B
    finally:
        sys.path.pop(0)
    n = hosts * per_host
    item = 4
    for op, spec in B.OPS.items():
        count = n * n * 3  # size (elements) per rank, nccl-tests convention
        ids = np.arange(n * spec.in_count(count, n), dtype=np.int64)
        owner = ids // spec.in_count(count, n) // per_host  # host of each input element
        want = spec.link_bytes(count * item, hosts, per_host)
        if spec.reduces or op in ("pmax", "pmin"):
            if hosts != 2:
                continue
            # positions of the reduced result each host's ranks hold: one partial each
            out = B.numpy_reference(op, np.arange(n * count, dtype=np.int64) % count, n)
            got = max(
                len({int(v) for r in range(h * per_host, (h + 1) * per_host) for v in out[r]})
                for h in range(hosts)
            )
        else:
            out = B.numpy_reference(op, ids, n)
            got = max(
                len(
                    {
                        int(v)
                        for r in range(h * per_host, (h + 1) * per_host)
                        for v in out[r]
                        if owner[v] != h
                    }
                )
                for h in range(hosts)
            )
        assert got * item == pytest.approx(want), (op, got * item, want)


@needs_netns
@pytest.mark.parametrize("engine", ["gloo", pytest.param("mpi", marks=needs_mpi)])
def test_launcher_killed_leaves_nothing(tmpdir_short, engine):
    """SIGKILL to the launcher itself (no chance to clean up): its namespace holders and ranks
    (and with --engine mpi, mpirun) die with it (setpriv --pdeathsig), so no namespace, link,
    run dir or mpirun session dir outlives it."""
    before = _Leftovers()
    cmd = [sys.executable, LAUNCH_PY, "-n", "2", "--hosts", "2", "--netns", "--engine", engine]
    cmd += [str(SCRIPTS / "sleep_ready.py")]
    p = subprocess.Popen(
        cmd,
        env=_mpi_env(tmpdir_short) if engine == "mpi" else _env(tmpdir_short),
        cwd=PKG_PARENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    ready = 0
    for line in p.stdout:
        ready += "ready" in line
        if ready == 2:
            break
    p.kill()
    p.wait(timeout=10)
    err = p.stderr.read()
    before.check(err, tmpdir_short)
    assert ready == 2, err


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (2, 4), (4, 2), (3, 1)])
def test_wire_floor_ring_crosses_one_way(hosts, per_host):
    """benchmarks/collectives.py's wire floor (the same bytes through gloo alone) runs along a
    ring in which every rank sends once and receives once, always to another host, and no two
    ranks exchange both ways (a gloo connection carrying both directions takes turns)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import _sweep as B
    finally:
        sys.path.pop(0)
    n = hosts * per_host
    pairs = B.wire_ring(n, hosts)
    assert sorted(s for s, _ in pairs) == sorted(d for _, d in pairs) == list(range(n))
    assert all(s // per_host != d // per_host for s, d in pairs), pairs
    assert not any((d, s) in pairs for s, d in pairs), pairs


@needs_netns
@needs_mpi
@pytest.mark.slow  # 12 s alone, 30 s at load 8: 4 ranks compiling 14 programs on 2 cores
def test_engine_mpi_between_netns_hosts(tmpdir_short):
    """`launch -n 4 --hosts 2 --netns --link-gbit 10 --engine mpi`: one MPI job of 4 ranks, 2
    per simulated host; psum (1 MiB and 1 KiB per rank: the one collective over MPI and the
    small path), pmax, all_gather, psum_scatter, all_to_all and ppermute of strata and of
    jax.lax over MPI equal numpy's on the same inputs; strata's inter-fabric steps crossed
    (the hosts found by hostname) and each host's eth0 sent at least what its ranks handed to
    MPI; every rank exits 0 (no abort at MPI_Finalize) and nothing is left (namespaces, links,
    the run and session dirs)."""
    before = _Leftovers()
    cmd = [sys.executable, "-m", "strata_jax.launch", "--grace", "1", "-n", "4", "--hosts", "2"]
    cmd += ["--netns", "--link-gbit", "10", "--engine", "mpi"]
    cmd += [str(SCRIPTS / "mpi_engine.py"), "--netns"]
    r = subprocess.run(
        cmd, env=_mpi_env(tmpdir_short), cwd=PKG_PARENT, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    out = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, out
    assert "PMIX ERROR" not in r.stdout + r.stderr, out
    res = sorted(
        (json.loads(ln.split("RESULT ", 1)[1]) for ln in r.stdout.splitlines() if "RESULT " in ln),
        key=lambda d: d["process"],
    )
    assert [d["process"] for d in res] == [0, 1, 2, 3], out
    for d in res:
        assert d["failures"] == [], d
        assert d["engine"] == "mpi" and d["async_dispatch"] is False, d
        assert d["finalize"] == "py_atexit", d
        assert d["mpi_rank"] == d["process"], d  # app context r is rank r
        assert d["hostname"] == f"host{d['process'] // 2}" and d["fabric_id_env"] is None, d
        assert d["num_fabrics"] == 2 and d["inter_fabric_bytes"] > 0, d
        assert d["count_bytes"] >= 512 * 1024, d  # psum's one collective over MPI
        assert d["zero_copy_bytes"] > 0 and d["staged_bytes"] == 0, d
        # MPI's bytes went over this host's link (Open MPI's TCP transport on eth0)
        assert d["eth0_tx_bytes"] >= d["inter_fabric_bytes"], d
    before.check(r.stderr, tmpdir_short)


@needs_netns
@needs_mpi
def test_engine_mpi_failed_rank_and_ctrl_c_leave_nothing(tmpdir_short):
    """Under `--netns --engine mpi`: a rank that exits 3 ends the job with mpirun's failure
    (the launcher says so, exit code non-zero), and a SIGINT to the launcher while the ranks
    sleep exits 130; neither leaves a namespace, link, run dir or mpirun session dir."""
    before = _Leftovers()
    cmd = [sys.executable, LAUNCH_PY, "--grace", "1", "-n", "2", "--hosts", "2", "--netns"]
    cmd += ["--engine", "mpi", str(SCRIPTS / "exit_on_rank1.py")]
    r = subprocess.run(
        cmd, env=_mpi_env(tmpdir_short), cwd=PKG_PARENT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode != 0, r.stdout + r.stderr
    assert "[rank 1] exiting with 3" in r.stdout, r.stdout + r.stderr
    assert re.search(r"strata-launch: mpirun exited with code \d+", r.stderr), r.stderr
    before.check(r.stderr, tmpdir_short)

    before = _Leftovers()
    cmd = [sys.executable, LAUNCH_PY, "--grace", "1", "-n", "2", "--hosts", "2", "--netns"]
    cmd += ["--engine", "mpi", str(SCRIPTS / "sleep_ready.py")]
    p = subprocess.Popen(
        cmd, env=_mpi_env(tmpdir_short), cwd=PKG_PARENT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    seen = []
    for line in p.stdout:
        seen.append(line)
        if len([s for s in seen if "ready" in s]) == 2:
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGINT, (seen, out, err)
    assert sorted(s.split()[-1] for s in seen if "ready" in s) == ["host0", "host1"], seen
    assert sorted(s.split()[1] for s in seen if "ready" in s) == ["0]", "1]"], seen
    before.check(err, tmpdir_short)


def test_engine_mpi_refusals(monkeypatch, tmp_path, capsys):
    """--engine mpi without mpirun, without MPITRAMPOLINE_LIB or with a wrong one, or with several
    devices per process: the launcher refuses before it starts anything, saying what to add."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("MPITRAMPOLINE_LIB", raising=False)
    reason = launch.mpi_unavailable_reason()
    assert reason is not None and "mpirun on PATH (package openmpi-bin)" in reason, reason
    assert "MPITRAMPOLINE_LIB naming a libmpiwrapper.so" in reason and "not set" in reason
    assert launch.main(["-n", "2", "--engine", "mpi", "script.py"]) == 2
    assert "--engine mpi (XLA's MPI collectives) needs" in capsys.readouterr().err
    with pytest.raises(OSError, match="needs Open MPI's mpirun"):
        launch.launch(2, ["true"], engine="mpi")
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    reason = launch.mpi_unavailable_reason({"MPITRAMPOLINE_LIB": str(tmp_path / "nope.so")})
    assert (
        reason is not None
        and "nope.so' is no file" in reason
        and "mpirun" not in reason.split("needs")[1].split("MPITRAMPOLINE_LIB")[0]
    ), reason
    assert launch.mpi_unavailable_reason({"MPITRAMPOLINE_LIB": str(tmp_path / "mpirun")}) is None
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--engine", "mpi", "--devices-per-proc", "2", "script.py"])
    assert "one device each" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one device per process"):
        launch.launch(2, ["true"], engine="mpi", devices_per_proc=2)
    with pytest.raises(ValueError, match="engine must be one of"):
        launch.launch(2, ["true"], engine="nccl")


def test_bench_runs_one_launch_per_engine():
    """benchmarks/collectives.py --impl strata,xla,mpi: XLA has one engine per process, so the
    parent makes one launch over gloo (strata, xla) and one with --engine mpi (strata, mpi)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import collectives as B
    finally:
        sys.path.pop(0)
    assert B.engine_launches(["strata", "xla", "mpi"]) == [
        ("gloo", ["strata", "xla"]),
        ("mpi", ["strata", "mpi"]),
    ]
    assert B.engine_launches(["strata", "mpi"]) == [("mpi", ["strata", "mpi"])]
    assert B.engine_launches(["strata", "xla"]) == [("gloo", ["strata", "xla"])]
