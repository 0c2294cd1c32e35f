"""Tests of the launcher, strata_jax/launch.py (``python -m strata_jax.launch``).

Most ranks here are tiny Python scripts without jax, so the whole file runs in seconds; one test
starts jax.distributed (gloo) across the ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _mp_util import environ_without_settings, run_python, write_script
from alloc_helpers.common import LAUNCH_PY, ROOT, find_or_build_alloc_library, launch_module


@pytest.fixture(scope="module")
def alloc_lib(tmp_path_factory) -> str:
    return find_or_build_alloc_library(tmp_path_factory.mktemp("alloc_lib"))


def _env(**extra: str) -> dict[str, str]:
    return environ_without_settings(**extra)


def _launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 60, module=False):
    """Runs the launcher (as a module or as the source file) and returns the CompletedProcess."""
    head = ["-m", "strata_jax.launch"] if module else [str(LAUNCH_PY)]
    return run_python(
        head + args, env=env if env is not None else _env(), cwd=ROOT, timeout=timeout
    )


def _script(tmp_path: Path, body: str, name: str = "rank.py") -> str:
    return write_script(tmp_path, body, name)


REPORT = """
import os, stat, sys
run_dir = os.environ["STRATA_RUN_DIR"]
mode = stat.S_IMODE(os.stat(run_dir).st_mode)
print("env", os.environ["STRATA_PROCESS_ID"], os.environ["STRATA_NUM_PROCESSES"],
      os.environ["STRATA_COORDINATOR"], os.environ["STRATA_LOCAL_DEVICES"], run_dir, oct(mode),
      " ".join(sys.argv[1:]))
print("to stderr", file=sys.stderr)
sys.stdout.write("no newline at the end")
"""


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_get_their_environment(tmp_path, n):
    script = _script(tmp_path, REPORT)
    r = _launch(
        ["-n", str(n), "--devices-per-proc", "2", "--no-preload", script, "a", "--b"],
        module=(n == 2),
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if " env " in ln]
    assert len(lines) == n
    seen = {}
    for ln in lines:
        prefix, _, rest = ln.partition("] ")
        rank = int(prefix.removeprefix("[rank "))
        _, pid, nproc, coord, devices, run_dir, mode, args = rest.split(" ", 7)
        assert int(pid) == rank and int(nproc) == n and devices == "2" and args == "a --b"
        assert coord.startswith("127.0.0.1:") and mode == "0o700"
        seen[rank] = (coord, run_dir)
    assert sorted(seen) == list(range(n))
    assert len(set(seen.values())) == 1  # one coordinator and one run dir for all ranks
    run_dir = next(iter(seen.values()))[1]
    assert not os.path.exists(run_dir), "run dir must be removed after a normal exit"
    # every line of every stream is prefixed, a final partial line included
    for i in range(n):
        assert f"[rank {i}] to stderr" in r.stderr
        assert f"[rank {i}] no newline at the end" in r.stdout
    assert all(ln.startswith("[rank ") for ln in r.stdout.splitlines())


def test_failed_rank_stops_the_others(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["STRATA_PROCESS_ID"] == "1":
            time.sleep(0.3)
            sys.exit(7)
        time.sleep(60)
        print("should not get here")
        """,
    )
    t0 = time.monotonic()
    r = _launch(["-n", "3", "--no-preload", "--grace", "2", script])
    elapsed = time.monotonic() - t0
    assert r.returncode == 7
    assert "rank 1 exited with code 7" in r.stderr
    assert "should not get here" not in r.stdout
    assert elapsed < 10


def test_first_error_is_said_last_when_a_crash_buries_it(tmp_path):
    """Rank 2 prints an error (a chained exception: the first exception line is the root) and
    waits; rank 0 then aborts with a long trace, the first rank to end (as when a peer's exit
    takes down the coordinator and XLA aborts the others). The launcher names rank 0 first,
    and its last line names rank 2's error."""
    script = _script(
        tmp_path,
        """
        import os, sys, time, traceback
        rank = os.environ["STRATA_PROCESS_ID"]
        if rank == "2":  # prints its error, then waits (as in a collective that never ends)
            try:
                try:
                    raise KeyError("the real cause")
                except KeyError:
                    raise RuntimeError("while handling it")
            except RuntimeError:
                traceback.print_exc()
                sys.stderr.flush()
        if rank == "0":
            time.sleep(1.0)
            for i in range(300):
                print(f"    @ 0x{i:012x}  some::frame()", file=sys.stderr)
            os.abort()
        time.sleep(60)
        """,
    )
    r = _launch(["-n", "3", "--no-preload", "--grace", "2", script])
    assert r.returncode != 0
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("strata-launch: ")]
    assert said[0] == "strata-launch: rank 0 was killed by SIGABRT; stopping the other ranks"
    assert (
        said[-1]
        == "strata-launch: the first error a rank raised: rank 2: KeyError: 'the real cause'"
    )


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["STRATA_PROCESS_ID"] == "0":
            time.sleep(0.3)
            sys.exit(2)
        time.sleep(60)
        """,
    )
    t0 = time.monotonic()
    r = _launch(["-n", "2", "--no-preload", "--grace", "0.5", script])
    assert r.returncode == 2 and "rank 0 exited with code 2" in r.stderr
    assert time.monotonic() - t0 < 10


def test_sigkilled_rank_cleans_up_run_dir(tmp_path):
    record = tmp_path / "run_dir.txt"
    script = _script(
        tmp_path,
        f"""
        import os, signal, time
        if os.environ["STRATA_PROCESS_ID"] == "0":
            open(os.path.join(os.environ["STRATA_RUN_DIR"], "sock"), "w").close()
            with open({str(record)!r}, "w") as f:
                f.write(os.environ["STRATA_RUN_DIR"])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    r = _launch(["-n", "2", "--no-preload", "--grace", "1", script])
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL" in r.stderr
    run_dir = record.read_text()
    assert run_dir and not os.path.exists(run_dir)


def test_timeout(tmp_path):
    script = _script(tmp_path, "import time\ntime.sleep(60)\n")
    t0 = time.monotonic()
    r = _launch(["-n", "2", "--no-preload", "--timeout", "1", "--grace", "1", script])
    assert r.returncode == 124 and "timed out" in r.stderr
    assert time.monotonic() - t0 < 10


def test_sigint_is_forwarded(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    script = _script(
        tmp_path,
        f"""
        import os, signal, sys, time
        def on_int(sig, frame):
            print("got SIGINT", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGINT, on_int)
        open(os.path.join({str(ready)!r}, os.environ["STRATA_PROCESS_ID"]), "w").close()
        time.sleep(60)
        """,
    )
    p = subprocess.Popen(
        [sys.executable, str(LAUNCH_PY), "-n", "2", "--no-preload", script],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGINT, err
    assert out.count("got SIGINT") == 2
    assert "[rank 0] got SIGINT" in out and "[rank 1] got SIGINT" in out


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigkilled_launcher_leaves_no_rank_and_no_run_dir(tmp_path):
    """SIGKILL to the launcher itself, without namespaces (its own cleanup never runs): the
    ranks die with it (setpriv --pdeathsig) and the hosts' run dirs go (the launcher's reaper,
    which removes them when the launcher's pipe to it closes)."""
    if shutil.which("setpriv") is None:
        pytest.skip("util-linux's setpriv is not installed: ranks cannot die with the launcher")
    tmp, ready = tmp_path / "tmp", tmp_path / "ready"
    tmp.mkdir()
    ready.mkdir()
    script = _script(
        tmp_path,
        f"""
        import os, time
        with open(os.path.join({str(ready)!r}, os.environ["STRATA_PROCESS_ID"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        """,
    )
    p = subprocess.Popen(
        [sys.executable, str(LAUNCH_PY), "-n", "2", "--hosts", "2", "--no-preload", script],
        env=_env(TMPDIR=str(tmp)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int((ready / f).read_text()) for f in os.listdir(ready)]
    assert len(pids) == 2 and len(os.listdir(tmp)) == 2  # both ranks up; a run dir per host
    p.kill()
    p.wait(timeout=10)
    deadline = time.monotonic() + 5
    while (any(map(_alive, pids)) or os.listdir(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [q for q in pids if _alive(q)], "ranks outlived the SIGKILLed launcher"
    assert os.listdir(tmp) == [], f"left in TMPDIR: {os.listdir(tmp)}"


def test_setpriv_without_pdeathsig_is_not_used(tmp_path):
    """A setpriv without --pdeathsig (util-linux before 2.33: RHEL 8) is left out, not passed
    the option: every rank used to fail with "unrecognized option '--pdeathsig'"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "setpriv"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --help ]; then echo " --reuid <uid>  set real and effective uid"; exit 0; fi\n'
        "echo \"setpriv: unrecognized option '$1'\" >&2; exit 1\n"
    )
    fake.chmod(0o755)
    script = _script(tmp_path, "print('hello')\n")
    env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = _launch(["-n", "2", "--no-preload", script], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("hello") == 2 and "unrecognized option" not in r.stderr


def test_launch_returns_while_a_forked_child_holds_the_reaper_pipe(tmp_path):
    """launch() from a program that forks meanwhile (a child that inherits every fd, as
    multiprocessing's fork does) returns at once: its reaper is killed, not waited for."""
    prog = _script(
        tmp_path,
        """
        import os, sys, threading, time
        from strata_jax.launch import launch  # the installed package, as the other tests

        def fork_later():
            time.sleep(0.3)
            if os.fork() == 0:  # holds every fd of the parent but its own stdout/stderr
                os.close(1)
                os.close(2)
                time.sleep(15)
                os._exit(0)

        threading.Thread(target=fork_later).start()
        t0 = time.monotonic()
        rc = launch(2, [sys.executable, "-c", "import time; time.sleep(1)"], preload=False)
        print("rc", rc, "after", round(time.monotonic() - t0, 1), flush=True)
        os._exit(0)
        """,
        name="host.py",
    )
    r = subprocess.run(
        [sys.executable, prog], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rc, after = r.stdout.split()[1], float(r.stdout.split()[3])
    assert rc == "0" and after < 6, r.stdout


PRELOAD_CHECK = """
import ctypes, os
lib = ctypes.CDLL(None)
active = lib.strata_alloc_active() if hasattr(lib, "strata_alloc_active") else -1
print("preload", os.environ.get("LD_PRELOAD", ""), "active", active)
"""


def test_preload_on_by_default(tmp_path, alloc_lib):
    script = _script(tmp_path, PRELOAD_CHECK)
    r = _launch(["-n", "2", script], env=_env(STRATA_ALLOC_LIB=alloc_lib))
    assert r.returncode == 0, r.stderr
    # The library's path, or its file name where the path has a space (preload_env)
    entry = launch_module().preload_env({}, alloc_lib)["LD_PRELOAD"]
    assert r.stdout.count(f"preload {entry} active 1") == 2
    assert "cannot be preloaded" not in r.stderr, r.stderr


def test_preload_from_a_folder_with_a_space(tmp_path, alloc_lib):
    """ld.so splits LD_PRELOAD at spaces and colons with no escape: a venv in "~/my work" had
    the allocator preloaded nowhere ("ERROR: ld.so: object '/root/my' ... cannot be preloaded",
    every byte staged). The launcher names it by file name, its folder first in
    LD_LIBRARY_PATH; a folder with a colon cannot be named at all and is left out."""
    folder = tmp_path / "my work"
    folder.mkdir()
    lib = folder / "libstrata_alloc.so"
    shutil.copy(alloc_lib, lib)
    env = launch_module().preload_env({"LD_PRELOAD": "", "LD_LIBRARY_PATH": "/x"}, str(lib))
    assert env["LD_PRELOAD"] == "libstrata_alloc.so"
    assert env["LD_LIBRARY_PATH"] == f"{folder}:/x"
    assert launch_module().preload_env({"A": "1"}, "/a:b/libstrata_alloc.so") == {"A": "1"}
    script = _script(tmp_path, PRELOAD_CHECK)
    r = _launch(["-n", "2", script], env=_env(STRATA_ALLOC_LIB=str(lib)))
    assert r.returncode == 0, r.stderr
    assert "cannot be preloaded" not in r.stderr, r.stderr
    assert r.stdout.count("preload libstrata_alloc.so active 1") == 2, r.stdout + r.stderr


def test_preload_keeps_existing_ld_preload(tmp_path, alloc_lib):
    script = _script(tmp_path, PRELOAD_CHECK)
    other = (
        "/lib/x86_64-linux-gnu/libm.so.6"
        if os.path.exists("/lib/x86_64-linux-gnu/libm.so.6")
        else ""
    )
    env = _env(STRATA_ALLOC_LIB=alloc_lib, LD_PRELOAD=other)
    r = _launch(["-n", "2", script], env=env)
    assert r.returncode == 0, r.stderr
    entry = launch_module().preload_env({}, alloc_lib)["LD_PRELOAD"]
    expected = f"{entry}:{other}" if other else entry
    assert r.stdout.count(f"preload {expected} active 1") == 2


def test_no_preload(tmp_path, alloc_lib):
    script = _script(tmp_path, PRELOAD_CHECK)
    r = _launch(["-n", "2", "--no-preload", script], env=_env(STRATA_ALLOC_LIB=alloc_lib))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("preload  active -1") == 2


def test_distributed_env():
    mod = launch_module()
    assert mod.distributed_env({}) is None
    env = {
        "STRATA_COORDINATOR": "127.0.0.1:1234",
        "STRATA_NUM_PROCESSES": "4",
        "STRATA_PROCESS_ID": "3",
        "STRATA_LOCAL_DEVICES": "2",
    }
    assert mod.distributed_env(env) == {
        "coordinator_address": "127.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
        "local_device_count": 2,
    }
    with pytest.raises(ValueError):
        mod.distributed_env({**env, "STRATA_PROCESS_ID": "x"})
    with pytest.raises(ValueError):
        mod.distributed_env({**env, "STRATA_PROCESS_ID": "4"})


def test_run_dir_is_private_and_unique():
    mod = launch_module()
    a = mod.rank_env(
        {}, rank=0, nproc=1, coordinator="c", devices_per_proc=1, run_dir="d", preload=None
    )
    assert "LD_PRELOAD" not in a and a["STRATA_RUN_DIR"] == "d"


def test_jax_distributed_sees_all_devices(tmp_path, alloc_lib):
    script = _script(
        tmp_path,
        """
        import os, sys
        sys.path.insert(0, os.environ["LAUNCH_DIR"])
        from launch import distributed_env
        cfg = distributed_env()
        import jax
        jax.config.update("jax_num_cpu_devices", cfg["local_device_count"])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(cfg["coordinator_address"], cfg["num_processes"],
                                   cfg["process_id"])
        print("devices", len(jax.devices()), "local", len(jax.local_devices()),
              "process", jax.process_index(), flush=True)
        import time; time.sleep(0.3)  # a program's work: the launcher looks every 20 ms
        jax.distributed.shutdown()
        """,
    )
    env = _env(STRATA_ALLOC_LIB=alloc_lib, LAUNCH_DIR=str(LAUNCH_PY.parent))
    r = _launch(
        ["-n", "2", "--devices-per-proc", "2", "--timeout", "90", script], env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for i in range(2):
        assert f"[rank {i}] devices 4 local 2 process {i}" in r.stdout, r.stdout
    assert SEPARATE_JOBS not in r.stderr  # jax.distributed by hand: the coordinator was seen


SEPARATE_JOBS = "processes ran as 2 separate one-process jobs"
GSPMD = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
print("process", jax.process_index(), "of", jax.process_count(), "sum", float(jax.jit(jnp.sum)(x)))
"""


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "wrap"])
def test_unmodified_script_without_wrap_is_told_it_ran_as_separate_jobs(tmp_path, wrap):
    """A jit + NamedSharding script that never imports strata_jax, launched without --wrap, runs
    as N one-process jobs (exit code 0, as each succeeded): one launcher line on stderr says so
    and names --wrap. With --wrap the ranks make one job and nothing is said."""
    script = _script(tmp_path, GSPMD, "gspmd.py")
    r = _launch(["-n", "2", *(["--wrap"] if wrap else []), script], module=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    if wrap:
        for i in range(2):
            assert f"[rank {i}] process {i} of 2 sum 28.0" in r.stdout, r.stdout
        assert SEPARATE_JOBS not in r.stderr, r.stderr[-3000:]
    else:
        for i in range(2):
            assert f"[rank {i}] process 0 of 1 sum 28.0" in r.stdout, r.stdout
        said = [ln for ln in r.stderr.splitlines() if SEPARATE_JOBS in ln]
        assert len(said) == 1 and "--wrap" in said[0] and "strata_jax.init()" in said[0], r.stderr
        assert said[0].startswith("strata-launch: "), said


def test_mpirun_tagged_output_becomes_rank_lines():
    """mpirun --tag-output tags each piece a rank writes ("ready", " ", "host0\\n" from an
    unbuffered print), and pieces of several ranks share a line: the launcher puts each rank's
    line back together as `[rank R] ...`; mpirun's own lines get its prefix."""
    import io
    import threading

    from strata_jax import launch

    src = io.BytesIO(
        b"[1,0]<stdout>:ready[1,1]<stdout>:exiting with 3[1,0]<stdout>: [1,0]<stdout>:host0"
        b"[1,0]<stdout>:\n[1,1]<stdout>:\nmpirun noticed that process rank 1 exited\n"
        b"[1,2]<stderr>:no newline at the end"
    )
    out = io.BytesIO()
    launch._pump(src, out, b"[mpirun] ", threading.Lock(), relabel=True)
    assert out.getvalue().decode().splitlines() == [
        "[rank 0] ready host0",
        "[rank 1] exiting with 3",
        "[mpirun] mpirun noticed that process rank 1 exited",
        "[rank 2] no newline at the end",
    ]


@pytest.mark.parametrize("how", ["module", "import"])
def test_mpitrampoline_lib_naming_no_file_is_an_error(tmp_path, how):
    """MPITRAMPOLINE_LIB naming no file: jaxlib's MPItrampoline ends the process inside
    ``import jax`` with its own message (exit 1), so ``python -m strata_jax.launch --engine
    mpi`` and ``import strata_jax`` used to die without saying which variable to change; now
    ``import strata_jax`` raises an ImportError naming it, before jax is imported."""
    bad = str(tmp_path / "nope" / "libmpiwrapper.so")
    env = _env(MPITRAMPOLINE_LIB=bad)
    if how == "module":
        p = _launch(["-n", "2", "--engine", "mpi", str(tmp_path / "x.py")], env=env, module=True)
    else:
        p = subprocess.run(
            [sys.executable, "-c", "import strata_jax"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert p.returncode != 0
    assert f"MPITRAMPOLINE_LIB={bad!r} is no file" in p.stderr, p.stderr


def test_mpirun_failure_message_follows_its_report(tmp_path):
    """Under --engine mpi the launcher's "mpirun exited with code N (mpirun's own message above
    names the rank)" comes after mpirun's output is drained (its report naming the failed rank
    printed after that line under --netns); here a late line from mpirun's process group, which
    the launcher printed nothing of before (its message came first, then the group was
    killed)."""
    from strata_jax import launch

    script = (
        "echo '[1,1]<stderr>:boom' >&2; "
        "(sleep 0.5; echo 'Process name: [[1,1],1]' >&2) & exit 1"  # a late report line
    )
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        run = launch._Launch(grace=5, err=err)
        try:
            run.start(["sh", "-c", script], dict(os.environ), 0, out, label="mpirun")
            code = run.watch(None)
        finally:
            run.finish()
    lines = (tmp_path / "err").read_text().splitlines()
    assert code == 1
    assert "[mpirun] Process name: [[1,1],1]" in lines, lines
    assert lines[-1].startswith("strata-launch: mpirun exited with code 1"), lines
