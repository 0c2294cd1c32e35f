"""Starting `python -m strata_jax.launch` from tests, and checking what a job leaves behind.

Shared by the tests that start processes: the launcher's, the multi-process checks, the fault
campaign, the soak test. Ranks import the same
strata_jax as the test process (the installed package with its native extension); the
launcher runs from the package's parent folder, never the source root, which would shadow it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import strata_jax

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "mp_scripts"
PKG_PARENT = str(Path(strata_jax.__file__).resolve().parent.parent)


# What the processes a test starts get as XLA_FLAGS (conftest.py: LLVM -O0, compiles faster).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def environ_without_settings(*more_prefixes: str, **extra: str) -> dict[str, str]:
    """The test's environment without strata's, JAX's and XLA's settings and LD_PRELOAD (nor
    variables starting with `more_prefixes`), plus `extra`."""
    prefixes = ("STRATA_", "XLA_FLAGS", "JAX_", "LD_PRELOAD", *more_prefixes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


def run_python(
    args: list[str], *, env: dict[str, str], cwd: str | Path, timeout: float
) -> subprocess.CompletedProcess:
    """``python args`` (this interpreter) to its end, its output captured as text."""
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def write_script(tmp_path: Path, body: str, name: str) -> str:
    """``body`` (dedented) as the file ``name`` in ``tmp_path``; returns its path."""
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def job_env(**extra: str) -> dict[str, str]:
    """The test's environment without strata/jax/XLA settings (XLA_FLAGS is TEST_XLA_FLAGS)
    nor the shell's MPITRAMPOLINE_LIB (which names MPIwrapper for the tests that ask for it, and
    would take jaxlib's MPI away from strata's engine in every other job), plus `extra`."""
    env = environ_without_settings("MPITRAMPOLINE_LIB")
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_PARENT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launch_cmd(nproc: int, script: str | Path, *args: str, devices: int = 1, grace: float = 1):
    script = Path(script)
    if not script.is_absolute():
        script = SCRIPTS / script
    return [
        sys.executable,
        "-m",
        "strata_jax.launch",
        "-n",
        str(nproc),
        "--grace",
        str(grace),
        "--devices-per-proc",
        str(devices),
        str(script),
        *args,
    ]


def _job(env: dict[str, str]) -> dict:
    """How a job is started: the tests' environment, from the package's parent folder, its
    stdout and stderr together as text."""
    return dict(
        env=job_env(**env),
        cwd=PKG_PARENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def popen(
    nproc: int, script: str | Path, *args: str, devices: int = 1, grace: float = 1, **env: str
):
    """Starts a job in its own session (so a test can kill what is left by process group)."""
    return subprocess.Popen(
        launch_cmd(nproc, script, *args, devices=devices, grace=grace),
        start_new_session=True,
        **_job(env),
    )


def launch(
    nproc: int,
    script: str | Path,
    *args: str,
    devices: int = 1,
    timeout: float = 150,
    grace: float = 1,
    **env: str,
) -> tuple[subprocess.CompletedProcess, float]:
    """Runs a job to its end; returns (CompletedProcess with stdout+stderr in .stdout, seconds).

    `grace` is the launcher's SIGTERM-to-SIGKILL grace: tests of how fast a job stops pass a
    long one, so that a rank which ignores SIGTERM shows up as slow instead of being killed."""
    t = time.monotonic()
    r = subprocess.run(
        launch_cmd(nproc, script, *args, devices=devices, grace=grace), timeout=timeout, **_job(env)
    )
    return r, time.monotonic() - t


def run_job(
    cmd: list[str], *, timeout: float, **env: str
) -> tuple[subprocess.CompletedProcess, str]:
    """Runs a command line (launch_cmd, mpirun_cmd, a script) to its end in the tests'
    environment plus `env` (job_env), from the package's parent folder; returns (the
    CompletedProcess, its stdout and stderr together)."""
    r = subprocess.run(
        cmd, env=job_env(**env), cwd=PKG_PARENT, capture_output=True, text=True, timeout=timeout
    )
    return r, r.stdout + r.stderr


def run_benchmark(
    name: str, out: Path, *args: str, nproc: int = 2, hosts: int = 1, timeout: float = 300
) -> str:
    """Runs ``benchmarks/<name>`` under ``launch -n nproc --hosts hosts`` with ``--no-progress
    --out out`` and the tests' environment; asserts it exits 0 and returns stdout + stderr."""
    script = HERE.parent / "benchmarks" / name
    argv = [sys.executable, "-m", "strata_jax.launch", "-n", str(nproc), "--hosts", str(hosts)]
    argv += [str(script), *args, "--no-progress", "--out", str(out)]
    r = subprocess.run(
        argv, env=job_env(), cwd=out, capture_output=True, text=True, timeout=timeout
    )
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    return text


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def shm_left_behind(before: set[str]) -> list[str]:
    """The /dev/shm entries new since ``before`` (:func:`shm_names`) that a job may have left
    behind: made by this user and held (open or mapped) by no live process. The machine's
    other programs make entries of their own meanwhile (a browser, an Open MPI job's
    vader_segment files, the other pytest-xdist worker's mpirun tests); those are someone
    else's, in use, or gone again."""
    uid = os.geteuid()
    new = set()
    for name in shm_names() - before:
        try:
            if os.lstat(f"/dev/shm/{name}").st_uid == uid:
                new.add(name)
        except OSError:  # removed meanwhile
            pass
    if not new:
        return []
    held = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            text = Path(f"/proc/{p}/maps").read_text()
            links = [os.readlink(f"/proc/{p}/fd/{fd}") for fd in os.listdir(f"/proc/{p}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        for name in new:
            path = f"/dev/shm/{name}"
            if path in text or any(link.startswith(path) for link in links):
                held.add(name)
    return sorted(n for n in new - held if os.path.lexists(f"/dev/shm/{n}"))


def procs_with(token: str) -> list[int]:
    """Pids of live processes whose command line contains `token` (zombies excluded)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmd and state != "Z":
            out.append(int(p))
    return out


def strata_run_dirs() -> set[str]:
    """strata's private folders in the temp dirs (launcher run dirs, fabric fallback dirs)."""
    import tempfile

    found = set()
    for base in {tempfile.gettempdir(), "/tmp"}:
        try:
            found |= {
                os.path.join(base, n)
                for n in os.listdir(base)
                if n.startswith(("strata-run-", "strata-fabric-"))
            }
        except OSError:
            pass
    return found


def assert_low_latency_checks(out: str, nproc: int) -> None:
    """tests/mp_scripts/check_low_latency.py passed every check in each of its `nproc` processes
    (its lines in the job's output `out`)."""
    for line in (
        "OK ll mismatch both low-latency",
        "OK ll mismatch across paths",
        "OK ll mismatch slot and general path",
        "checks rank",
    ):
        assert out.count(line) == nproc, out[-3000:]


def results(text: str, tag: str = "RESULT ") -> list:
    """Every JSON object printed after ``tag`` in ``text`` (the ranks of an mpirun job share one
    pipe, so a line of one rank may follow another's without a newline)."""
    import json

    dec = json.JSONDecoder()
    out = []
    i = text.find(tag)
    while i >= 0:
        obj, end = dec.raw_decode(text, i + len(tag))
        out.append(obj)
        i = text.find(tag, end)
    return out


def netns_skip_reason() -> str | None:
    """Why ``strata_jax.launch --netns`` jobs cannot run here, or None: the launcher cannot make
    namespaces (``launch.netns_unavailable_reason``), or the interpreter, strata_jax or the test
    scripts live under /tmp or /dev/shm, which each simulated host's private mounts hide (the
    launcher refuses such a job; a venv under /tmp is common for root)."""
    from strata_jax import launch

    reason = launch.netns_unavailable_reason(1.0)
    if reason is not None:
        return reason
    hidden = ("/tmp/", "/dev/shm/")  # each simulated host gets a private tmpfs on these
    for what, path in (
        ("the Python interpreter", sys.executable),
        ("strata_jax", PKG_PARENT),
        ("the test scripts", str(SCRIPTS)),
    ):
        if os.path.abspath(path).startswith(hidden):
            return f"{what} lives under /tmp or /dev/shm ({path}), which a private mount hides"
    return None


def mpirun_skip_reason() -> str | None:
    """Why jobs started by plain mpirun (strata_jax.init() finding the job as JAX does) cannot
    run here, or None: no mpirun, or Open MPI 5 without mpi4py (its mpirun gives JAX no
    coordinator address; JAX finds it through mpi4py)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "Open MPI's mpirun not installed (apt-get install openmpi-bin)"
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"Open MPI\)? (\d+)\.", out)
    if m and int(m.group(1)) >= 5 and importlib.util.find_spec("mpi4py") is None:
        return (
            f"Open MPI {m.group(1)}'s mpirun gives jax.distributed no coordinator address "
            "without mpi4py (pip install mpi4py)"
        )
    return None


def mpirun_cmd(nproc: int, *cmd: str) -> list[str]:
    """mpirun as the tests here use it: root allowed, more ranks than cores, no binding (the
    ranks share the machine's cores with other work)."""
    return [
        shutil.which("mpirun") or "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-n",
        str(nproc),
        *cmd,
    ]


# Scripts that misuse init() (test_adoption.py under strata_jax.launch, test_mpirun.py under
# mpirun): the script body and the fix its error must name.
FORGOT_INIT = """
import strata_jax as sj  # no sj.init(): each rank would be a one-process job
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda a: sj.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
print("result", f(jnp.ones(jax.device_count())))
"""

INIT_AFTER_JAX = """
import jax
jax.devices()  # JAX creates its backend before strata_jax is even imported
import strata_jax as sj
sj.init()
print("no error")
"""

MISUSE_CASES = [
    (FORGOT_INIT, "Call strata_jax.init() first"),
    (INIT_AFTER_JAX, "call strata_jax.init() before any other use of jax"),
]


def run_launcher(
    args: list[str],
    script: str,
    *sargs: str,
    tmpdir: Path | None = None,
    timeout=240,
    extra_env: dict[str, str] | None = None,
):
    """Runs ``python -m strata_jax.launch --grace 1 <args> <script> <sargs>`` to its end from
    the package's parent folder with the tests' XLA flags and no STRATA_/JAX_ settings of the
    caller's; returns the CompletedProcess (stdout and stderr apart). ``tmpdir``: the job's
    TMPDIR (short paths for the fabric's sockets)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STRATA_", "XLA_FLAGS", "JAX_", "LD_PRELOAD"))
    }
    env.update(extra_env or {})
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as tests/_mp_util.TEST_XLA_FLAGS
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_PARENT, env.get("PYTHONPATH")]))
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    cmd = [sys.executable, "-m", "strata_jax.launch", "--grace", "1", *args]
    cmd += [str(SCRIPTS / script), *sargs]
    return subprocess.run(
        cmd, env=env, cwd=PKG_PARENT, capture_output=True, text=True, timeout=timeout
    )
