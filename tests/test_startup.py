"""strata_jax.init() with a peer that is late, never comes or dies.

Every wait of init() gives, on the process that waits, an error naming ``strata_jax.init``, the
missing processes and ``timeout_s``; a process that arrives after another gave up fails at once
with a clear error naming it (not JAX's abort); the launcher exits non-zero naming the ranks.
The jobs of one test run at the same time (each sleeps for its case; the CPU is shared).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from _mp_util import PKG_PARENT, SCRIPTS, job_env, launch_cmd

from strata_jax._src import startup

SCRIPT = "late_peer.py"
ABORT = "Terminating process because the JAX distributed service"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        launch_cmd(2, SCRIPT, *args),
        env=job_env(),
        cwd=PKG_PARENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(p: subprocess.Popen, timeout: float = 150) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail("job did not end:\n" + out[-3000:])
    return p.returncode, out


def _init_failed_after(out: str, rank: int) -> float:
    m = re.search(rf"\[rank {rank}\] INIT FAILED after ([0-9.]+) s", out)
    assert m, out[-3000:]
    return float(m.group(1))


def _check_late(rc: int, out: str) -> None:
    """Rank 0 gave up after ~5 s naming init, process 1 and timeout_s; rank 1 (8 s late)
    ended with its own clear error naming process 0; no abort; the launcher named both."""
    assert rc != 0, out[-3000:]
    assert 4.5 <= _init_failed_after(out, 0) < 8, out[-3000:]
    assert (
        "[rank 0] INIT FAILED after" in out
        and "strata_jax.init: process 0 timed out after 5 s (timeout_s) waiting for process 1"
        in out
    ), out[-3000:]
    assert "[rank 1] INIT FAILED after" in out, out[-3000:]
    assert "strata_jax.init: process 1 arrived after process 0 gave up waiting for it" in out
    assert ABORT not in out and "Check failure" not in out, out[-3000:]
    assert "DEADLINE_EXCEEDED" not in out, out[-3000:]
    assert re.search(r"strata-launch: rank [01] exited with code 1", out), out[-3000:]
    assert re.search(r"rank [01] exited with code 1 as well", out), out[-3000:]


def test_35_late_peer_at_init():
    """A late peer's values: jax.distributed started by hand and the backend created; rank 1
    sleeps 8 s before strata_jax.init(timeout_s=5). With a 3 s sleep both connect and a psum
    over the two processes is right. Both jobs run at once."""
    late, ok = _start("8", "5"), _start("3", "5")
    rc, out = _finish(late)
    _check_late(rc, out)
    rc, out = _finish(ok)
    assert rc == 0, out[-3000:]
    assert out.count("OK late_peer psum 3") == 2, out[-3000:]


def _no_abort(out: str) -> None:
    assert ABORT not in out and "Check failure" not in out and "SIGABRT" not in out, out[-3000:]


def _connect_failed(out: str, pid: int, other: int, timeout_s: int = 4) -> None:
    """Process ``pid`` gave up after ~timeout_s waiting for ``other`` to connect."""
    assert timeout_s - 0.5 <= _init_failed_after(out, pid) < timeout_s + 4, out[-3000:]
    assert (
        f"strata_jax.init: process {pid} timed out after {timeout_s} s (timeout_s) waiting for "
        f"process {other} to connect to jax.distributed" in out
    ), out[-3000:]
    assert "strata_jax.init(timeout_s=...)" in out, out[-3000:]


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_late_peer_when_init_starts_jax_distributed():
    """init() starts jax.distributed itself (the launcher's usual way): rank 1 sleeps 8 s
    before init(timeout_s=4). Rank 0 fails after ~4 s naming init, process 1 and timeout_s and
    exits with code 1; the launcher stops rank 1. Before, timeout_s was not honoured: JAX's
    connection wait (RegisterTask, retried) let this 8 s late rank in, and a 12 s late one
    got rank 0 aborted by JAX's client (SIGABRT, exit 134, 'RegisterTask ...
    DEADLINE_EXCEEDED'). A 1 s sleep connects and the psum is right. Both jobs run at once."""
    late, ok = _start("8", "4", "arrive", "strata"), _start("1", "4", "arrive", "strata")
    rc, out = _finish(late)
    assert rc == 1, out[-3000:]
    _connect_failed(out, 0, 1)
    _no_abort(out)
    assert "strata-launch: rank 0 exited with code 1; stopping the other ranks" in out
    rc, out = _finish(ok)
    assert rc == 0, out[-3000:]
    assert out.count("OK late_peer psum 3") == 2, out[-3000:]


def _plain(rank: int, port: int, *args: str) -> subprocess.Popen:
    """One rank of a 2-process job started without a launcher (no one stops the others)."""
    env = job_env(STRATA_COORDINATOR=f"127.0.0.1:{port}", STRATA_NUM_PROCESSES="2")
    env["STRATA_PROCESS_ID"] = str(rank)
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / SCRIPT), *args],
        env=env,
        cwd=PKG_PARENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow  # the same wait as test_late_peer_when_init_starts_jax_distributed, no launcher
def test_late_peer_without_a_launcher_to_stop_it():
    """Two processes started by hand (launcher variables, no launcher), init() starting
    jax.distributed, timeout_s=3: the late one arrives 6 s late, after the other gave up.
    Every process fails within timeout_s of its own arrival, naming the one it waited for,
    with exit code 1 and no abort. Late rank 1: rank 0 names process 1; rank 1, arriving
    when nothing listens at the coordinator's address, names process 0. Late rank 0 (the
    coordinator): the same the other way round. Before, the waiting process 0 was aborted by
    JAX (exit -6) and the late process waited out JAX's connection wait before its abort."""
    from strata_jax.launch import free_port

    jobs = {}
    for late in (1, 0):
        port = free_port()
        jobs[late] = [_plain(r, port, "6", "3", "arrive", "strata", str(late)) for r in (0, 1)]
    for procs in jobs.values():
        for rank, p in enumerate(procs):
            rc, out = _finish(p)
            out = out.replace("INIT FAILED", f"[rank {rank}] INIT FAILED")
            assert rc == 1, out[-3000:]
            _connect_failed(out, rank, 1 - rank, timeout_s=3)
            _no_abort(out)
            if rank != 0:
                assert "nothing listens at that address: process 0 runs the coordinator" in out


@pytest.mark.slow
def test_never_peer_by_hand_is_named_before_jax_aborts_it():
    """jax.distributed started by hand; rank 1 never calls init(). Rank 0 gives up after 3 s,
    keeps the service up 3 s more, then says, before it exits, that process 1's JAX client
    will abort and why (JAX's abort of a connected process cannot be prevented from outside
    it). The launcher exits with rank 0's code 1."""
    rc, out = _finish(_start("0", "3", "never"))
    assert rc == 1, out[-3000:]
    line = (
        "strata_jax.init: process 1 did not reach strata_jax.init() within 3 s (timeout_s) nor "
        "in the 3 s since: if it is alive, JAX's client there ends the process with an abort"
    )
    assert line in out, out[-3000:]
    if ABORT in out:
        assert out.index(line) < out.index(ABORT), out[-3000:]


@pytest.mark.slow
def test_peer_dying_while_others_wait_at_init():
    """A peer that dies before init() while rank 0 waits (timeout_s=30): the launcher stops the
    job at once, naming the rank and its exit code."""
    t0 = time.monotonic()
    rc, out = _finish(_start("1", "30", "die"))
    assert rc == 7, out[-3000:]
    assert "strata-launch: rank 1 exited with code 7; stopping the other ranks" in out
    assert time.monotonic() - t0 < 60


def test_default_timeout_is_not_shorter_than_jax_distributed():
    import inspect

    import jax

    default = inspect.signature(startup.init).parameters["timeout_s"].default
    jax_default = (
        inspect.signature(jax.distributed.initialize).parameters["initialization_timeout"].default
    )
    assert default == startup.DEFAULT_INIT_TIMEOUT_S >= jax_default == 300


class _FakeStore:
    """The three key-value calls _Startup makes, over a dict (one process's view)."""

    def __init__(self, data=None):
        self.data = dict(data or {})

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

    def key_value_set(self, key, value, allow_overwrite=False):
        self.data[key] = value


def test_startup_wait_messages(monkeypatch):
    """In-process: a timeout names the missing processes and posts why; a later arrival reads
    it and fails at once naming the process that gave up."""
    monkeypatch.setattr(startup, "_gave_up", {})
    monkeypatch.setattr(startup, "_ending", [])
    store = _FakeStore({"strata_jax/fabric/fabric_id/0": "a"})
    keys = {p: f"strata_jax/fabric/fabric_id/{p}" for p in range(4)}
    t = time.monotonic()
    with pytest.raises(startup.StartupError) as e:
        startup._Startup(store, 0, 4, 0.2).wait("reach strata_jax.init()", keys)
    assert 0.2 <= time.monotonic() - t < 2
    assert str(e.value).startswith(
        "strata_jax.init: process 0 timed out after 0.2 s (timeout_s) waiting for processes "
        "1, 2, 3 to reach strata_jax.init()"
    )
    assert "strata_jax.init(timeout_s=...)" in str(e.value)
    assert store.data["strata_jax/fabric/init_failed/0"] == str(e.value)
    assert startup._gave_up["missing"] == [1, 2, 3]
    late = startup._Startup(store, 2, 4, 60)
    t = time.monotonic()
    with pytest.raises(startup.StartupError, match="process 2 arrived after process 0 gave up"):
        late.wait("reach strata_jax.init()", keys)
    assert time.monotonic() - t < 1
    late.announce_ending()
    assert "strata_jax/fabric/init_ending/2" in store.data
    store.data.pop("strata_jax/fabric/init_failed/0")
    for p in range(4):
        store.data[keys[p]] = str(p)
    assert startup._Startup(store, 1, 4, 60).wait("x", keys) == {p: str(p) for p in range(4)}


def test_an_mpirun_jax_cannot_read_fails_at_once_naming_the_cause():
    """Open MPI 5's mpirun sets OMPI_COMM_WORLD_* but no ORTE URI, so JAX cannot find the
    coordinator without mpi4py: init() fails at once with JAX's reason and what to install,
    not after timeout_s as if a peer were late."""
    env = {k: v for k, v in job_env().items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env.update(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0", OMPI_VERSION="5.0.7")
    code = "import strata_jax as sj; sj.init(timeout_s=60)"
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=PKG_PARENT, capture_output=True, text=True
    )
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert "jax.distributed.initialize failed" in r.stderr, r.stderr[-2000:]
    assert "mpi4py" in r.stderr and "Open MPI 5" in r.stderr, r.stderr[-2000:]
    assert took < 30, took  # not the 60 s of a peer that never comes
