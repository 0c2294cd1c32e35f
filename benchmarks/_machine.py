"""What a result was measured on: the machine, versions, command, commit and load
(:func:`machine_info`, printed before any number by :func:`print_machine`), and which allocator
serves XLA's buffers in this process (:func:`reexec_with_allocator` re-runs the script under
``LD_PRELOAD=libstrata_alloc.so``, the deployment shape). Nothing here imports jax at module
level.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _args import format_size, processes_env


def _plain_allocator() -> str:
    """What serves XLA's buffers without LD_PRELOAD: the hook ``import strata_jax`` installs
    (strata_jax/_src/allocator.py), or glibc when it is off or strata_jax is not imported."""
    mod = sys.modules.get("strata_jax._src.allocator")
    if mod is None or mod.state["mode"] != "hook":
        why = mod.state["reason"] if mod is not None else "strata_jax not imported"
        return f"glibc ({why}): large XLA buffers are fresh mmapped pages every call"
    return "libstrata_alloc hooked into jaxlib at import strata_jax: XLA buffers from its pool"


def reexec_with_allocator(enabled: bool = True) -> str:
    """Re-run this script under ``LD_PRELOAD=libstrata_alloc.so`` unless it already is, then
    return a line for the header saying which allocator serves XLA's buffers.

    The deployment shape (``python -m strata_jax.launch`` preloads it too): every large XLA
    buffer, of every implementation in the process, comes from the pool's reused, already
    registered memory. Without it glibc serves each large buffer from a fresh mmap, and the
    first-touch page faults (about 2 us per 4 KiB page here) dominate every implementation at
    large sizes. Must run before jax (or anything that allocates large buffers) is imported;
    a no-op when ``enabled`` is false or the library is not found (the line says so).
    """
    if "strata_alloc" in os.environ.get("LD_PRELOAD", ""):
        cap = os.environ.get("STRATA_ALLOC_CACHE_BYTES", "1G")
        return (
            f"libstrata_alloc (LD_PRELOAD, cache {cap}): XLA buffers of every implementation "
            "from its pool"
        )
    if not enabled:
        if processes_env() is not None:
            why = "several processes: the launcher's or mpirun/srun's setting applies"
        else:
            why = "--no-preload, or not run as a script"
        return f"no LD_PRELOAD ({why}): " + _plain_allocator()
    try:
        from strata_jax.launch import alloc_library_path  # no jax backend created yet
    except Exception as e:
        return f"glibc (strata_jax.launch not importable: {type(e).__name__})"
    lib = alloc_library_path()
    if not lib:
        return "glibc (libstrata_alloc.so not found)"
    pre = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{lib}:{pre}" if pre else lib
    # A sweep keeps several sets of 8 x 64 MiB buffers alive (input, reference, each
    # implementation's last output) and frees 512 MiB a call: past the default 1 GiB cap on
    # cached free memory the pool would release and remake segments every call, i.e. fresh
    # pages again. Your own setting wins.
    os.environ.setdefault("STRATA_ALLOC_CACHE_BYTES", "4G")
    sys.stdout.flush()
    # orig_argv keeps the interpreter's own flags (-O, -W, -X, -u); argv alone would drop them.
    args = sys.orig_argv[1:] if hasattr(sys, "orig_argv") else sys.argv
    os.execv(sys.executable, [sys.executable, *args])
    raise AssertionError("unreachable")


def allocator_for_script(preload: bool, argv: list[str] | None, script: str) -> str:
    """:func:`reexec_with_allocator` for a benchmark's ``main(argv)``: re-runs only when
    ``script`` (its ``__file__``) is what Python runs (the re-run repeats the command line) and
    not with several processes: ``strata_jax.launch``'s have the launcher's setting, and under
    mpirun/srun the hook ``import strata_jax`` installs serves XLA's buffers (``strata-run``
    preloads it instead)."""
    as_script = argv is None and Path(sys.argv[0]).resolve() == Path(script).resolve()
    return reexec_with_allocator(preload and as_script and processes_env() is None)


ENV_VARS = (
    "PJRT_NPROC",
    "NPROC",
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "JAX_NUM_CPU_DEVICES",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)


def _cpu_model() -> str:
    try:
        from strata_jax.info import cpu_model  # the description strata's bug reports give
    except Exception:  # noqa: BLE001 - strata_jax not importable (only --impl xla needs none)
        return platform.processor() or platform.machine()
    return cpu_model()


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return format_size(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return "?"


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _cmdline(pid: int) -> tuple[list[str], int] | None:
    """(argv, parent pid) of a process, from /proc; None if it cannot be read."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], int(stat.rsplit(")", 1)[1].split()[1])


def run_command() -> str:
    """How this benchmark was started, as the user typed it (what the docs print above each
    generated table).

    A benchmark may run under the launcher (``python -m strata_jax.launch -n 4 <script>``), or
    start the launcher or its own children itself (``collectives.py --procs 4``,
    ``registration.py``): the outermost of this process's ancestors (up to 6 up) that runs
    the launcher or this same script is taken; else this process's own ``python <script>
    <args>``.
    """
    script = os.path.basename(sys.argv[0])
    best = [sys.executable, sys.argv[0], *sys.argv[1:]]
    pid = os.getppid()
    for _ in range(6):
        if pid <= 1:
            break
        found = _cmdline(pid)
        if found is None:
            break
        words, pid = found
        launched = any(w == "strata_jax.launch" or w.endswith("strata-launch") for w in words)
        if launched or any(os.path.basename(w) == script for w in words[1:2]):
            best = words
    if best and os.path.basename(best[0]).startswith("python"):
        best = ["python", *best[1:]]
    return shlex.join(
        os.path.relpath(w) if w.endswith(".py") and os.path.isabs(w) else w for w in best
    )


# What "+dirty" looks at: the code a benchmark measures, not the docs around it.
CODE_PATHS = ("strata_jax", "native", "benchmarks", "CMakeLists.txt", "pyproject.toml")


def git_commit() -> str | None:
    """The commit of the checkout the benchmark runs from (``+dirty`` if it has uncommitted
    changes to the tracked files of :data:`CODE_PATHS`), or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(here.parent),
                "status",
                "--porcelain",
                "--untracked-files=no",
                *CODE_PATHS,
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info(extra_env_prefixes: Sequence[str] = ("STRATA_",)) -> dict[str, Any]:
    """CPU model, cores, memory, versions and the environment variables that change behaviour,
    with the command, the git commit and the load average (1, 5, 15 min) at the time of the call.

    Call after jax is imported if jax's own facts (devices) are wanted; it is imported lazily here.
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    env.update(
        {k: v for k, v in os.environ.items() if any(k.startswith(p) for p in extra_env_prefixes)}
    )
    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": run_command(),
        "commit": git_commit(),
        "load_avg": list(os.getloadavg()),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "memory": _mem_total(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            m: _version(m)
            for m in ("jax", "jaxlib", "numpy", "strata_jax", "mpi4jax")
            if _version(m) is not None
        },
        "env": env,
    }
    if "jax" in sys.modules:
        import jax

        try:
            devs = jax.devices()
            info["jax_backend"] = jax.default_backend()
            info["jax_devices"] = len(devs)
            info["jax_local_devices"] = jax.local_device_count()
            info["jax_processes"] = jax.process_count()
        except Exception as e:  # backend failed to start: report, do not die here
            info["jax_devices_error"] = repr(e)
    return info


def print_machine(info: dict[str, Any], write: Callable[[str], Any] = print) -> None:
    if "command" in info:
        load = ", ".join(f"{v:.2f}" for v in info.get("load_avg", []))
        write(f"# command    : {info['command']}")
        write(f"# commit     : {info.get('commit')}  date {info['date']}  load average {load}")
    write(f"# host       : {info['host']}  ({info['platform']})")
    write(
        f"# cpu        : {info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), "
        f"{info['memory']} RAM"
    )
    vers = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    write(f"# versions   : python {info['python']}, {vers}")
    if "jax_devices" in info:
        write(
            f"# jax        : backend {info['jax_backend']}, {info['jax_devices']} devices, "
            f"{info['jax_processes']} process(es), {info['jax_local_devices']} local"
        )
    env = info["env"]
    envs = " ".join(f"{k}={v}" for k, v in env.items()) if env else "(none set)"
    write(f"# env        : {envs}")


def print_header(write: Callable[[str], Any], *lines: str | None) -> dict[str, Any]:
    """Prints what a run is measured on (:func:`print_machine`) and then the run's own header
    ``lines`` (a None line is left out); returns the :func:`machine_info` it printed."""
    info = machine_info()
    print_machine(info, write)
    for line in lines:
        if line is not None:
            write(line)
    return info
