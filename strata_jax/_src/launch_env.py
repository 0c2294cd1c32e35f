"""The launcher's environment contract: what ``strata_jax.launch`` sets for each rank, and the
readers every rank calls (``strata_jax.init()``, the allocator, the benchmarks).

Environment of each rank (:func:`rank_env`; read back with :func:`distributed_env`):

======================== ===================================================================
``STRATA_COORDINATOR``   ``127.0.0.1:PORT``, a free loopback port for ``jax.distributed``
                         (with ``--netns``: host 0's address, ``10.87.0.1:8476``)
``STRATA_NUM_PROCESSES`` N
``STRATA_PROCESS_ID``    this rank, 0..N-1
``STRATA_LOCAL_DEVICES`` CPU devices per process (``--devices-per-proc``; ``jax_num_cpu_devices``)
``STRATA_RUN_DIR``       a private 0700 folder for unix sockets, removed when the launcher exits
                         (one per simulated host with ``--hosts``); ``strata_jax.init()`` also
                         leaves ``joined-<rank>`` there once the rank is part of the N-process
                         job (:func:`mark_joined`), which tells the launcher it was not run as
                         N one-process jobs (:func:`joined_ranks`)
``STRATA_FABRIC_ID``     with ``--hosts H``: ``host<h>``, the simulated host of the rank (ranks
                         ``h*N/H .. (h+1)*N/H - 1``); ``strata_jax.init()`` connects shared
                         memory only among ranks with the same id (see ``_src/topology.py``).
                         Not set with ``--netns``: each host has its own hostname there
``LD_PRELOAD``           ``libstrata_alloc.so`` prepended (unless ``--no-preload``)

Also read here: what a cluster launcher (mpirun, srun) set (:func:`cluster_env`), and where
``libstrata_alloc.so`` lies (:func:`alloc_library_path`). Standard library only: the launcher
and the library import it before jax.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ALLOC_LIBRARY_NAME = "libstrata_alloc.so"

ENV_COORDINATOR = "STRATA_COORDINATOR"
ENV_NUM_PROCESSES = "STRATA_NUM_PROCESSES"
ENV_PROCESS_ID = "STRATA_PROCESS_ID"
ENV_LOCAL_DEVICES = "STRATA_LOCAL_DEVICES"
ENV_RUN_DIR = "STRATA_RUN_DIR"
ENV_ALLOC_LIB = "STRATA_ALLOC_LIB"
ENV_FABRIC_ID = "STRATA_FABRIC_ID"
ENV_TRAMPOLINE = "MPITRAMPOLINE_LIB"
ENV_ENGINE = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"


def alloc_library_path() -> str | None:
    """Returns the path of ``libstrata_alloc.so``, or None when it cannot be found.

    Looked for, in order: ``$STRATA_ALLOC_LIB`` (an explicit override: used as is, or None if that
    file does not exist), in the package folder (where ``pip install`` puts it), then next to the
    native extension this package loads (an editable install keeps both in site-packages). Never
    a build folder of the source tree: that copy may be stale or from another configuration.
    """
    override = os.environ.get(ENV_ALLOC_LIB)
    if override:
        return override if os.path.isfile(override) else None
    here = Path(__file__).resolve().parent.parent  # strata_jax/, where pip installs it
    candidate = here / ALLOC_LIBRARY_NAME
    if candidate.is_file():
        return str(candidate)
    try:
        import importlib.util

        spec = importlib.util.find_spec("strata_jax._strata")
    except Exception:  # noqa: BLE001 - the package itself does not import here (no jax)
        spec = None
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).resolve().parent / ALLOC_LIBRARY_NAME
        if candidate.is_file():
            return str(candidate)
    return None


_CLUSTER_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("PMI_SIZE", "PMI_RANK"),
    ("SLURM_NTASKS", "SLURM_PROCID"),
)


def preload_env(environ: Mapping[str, str], lib: str) -> dict[str, str]:
    """``environ`` with ``lib`` first in ``LD_PRELOAD`` (kept once if already there).

    The dynamic loader splits ``LD_PRELOAD`` at spaces and colons, with no escape for either
    (ld.so(8)): a library under a path with a space (a venv in "~/My Projects") is named by its
    file name there, its folder going first in ``LD_LIBRARY_PATH`` (split at colons only), else
    ld.so found no library and printed "cannot be preloaded" for each piece. A folder with a
    colon in its name cannot be given to the loader at all: then ``environ`` comes back as it
    is (``import strata_jax`` hooks the allocator into jaxlib instead, ``allocator.py``).
    """
    env = dict(environ)
    folder, name = os.path.split(lib)
    entry = lib
    if " " in lib or ":" in lib:
        if ":" in folder or " " in name or ":" in name or not folder:
            return env
        entry = name
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != folder]
        env["LD_LIBRARY_PATH"] = ":".join([folder, *paths])
    parts = env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    env["LD_PRELOAD"] = ":".join([entry, *(p for p in parts if p and p not in (lib, entry))])
    return env


def cluster_env(environ: Mapping[str, str] | None = None) -> tuple[str, int, int]:
    """What a cluster launcher (Open MPI's mpirun, a PMI launcher such as MPICH's, Slurm's srun)
    set for this process: ``(variable, number of processes, this process's rank)``, or
    ``("", 1, 0)`` outside one.

    Reads ``OMPI_COMM_WORLD_SIZE``/``_RANK``, ``PMI_SIZE``/``PMI_RANK`` and
    ``SLURM_NTASKS``/``SLURM_PROCID``, in that order (the variables JAX's own cluster detection
    reads); a missing or malformed rank reads as 0. Safe before jax is imported.
    """
    env = os.environ if environ is None else environ
    for size_var, rank_var in _CLUSTER_VARS:
        v = env.get(size_var, "")
        if v.isdigit():
            r = env.get(rank_var, "")
            return size_var, int(v), int(r) if r.isdigit() else 0
    return "", 1, 0


JOINED_PREFIX = "joined-"


def mark_joined(process_id: int, environ: Mapping[str, str] | None = None) -> None:
    """Leaves ``joined-<process_id>`` in the launcher's ``STRATA_RUN_DIR`` (nothing outside the
    launcher, or where that folder is gone): this process joined a job of several processes."""
    run_dir = (os.environ if environ is None else environ).get(ENV_RUN_DIR)
    if not run_dir:
        return
    try:
        with open(os.path.join(run_dir, f"{JOINED_PREFIX}{process_id}"), "wb"):
            pass
    except OSError:
        pass  # only a hint for the launcher's end-of-job message


def joined_ranks(run_dirs: list[str]) -> set[int]:
    """The ranks that left a :func:`mark_joined` file in any of ``run_dirs``."""
    ranks = set()
    for d in run_dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            tail = name[len(JOINED_PREFIX) :]
            if name.startswith(JOINED_PREFIX) and tail.isdigit():
                ranks.add(int(tail))
    return ranks


def listening(address: str, proc_net: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")):
    """Whether a TCP socket listens on ``address`` (``host:port``) in this network namespace,
    read from ``/proc/net/tcp*`` (nothing is connected to it); False where that cannot be read.
    """
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit():
        return False
    want = f":{int(port):04X}"
    for path in proc_net:
        try:
            with open(path) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(want):
                        return True
        except OSError:
            continue
    return False


def distributed_env(environ: Mapping[str, str] | None = None) -> dict | None:
    """The ``jax.distributed`` settings the launcher gave this process, or None outside it.

    Returns ``{"coordinator_address": str, "num_processes": int, "process_id": int,
    "local_device_count": int}``. Raises ValueError when the variables are present but malformed.
    """
    env = os.environ if environ is None else environ
    coordinator = env.get(ENV_COORDINATOR)
    if not coordinator:
        return None
    try:
        num_processes = int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID])
        local_devices = int(env.get(ENV_LOCAL_DEVICES, "1"))
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}/"
            f"{ENV_LOCAL_DEVICES} are missing or not integers ({e}); start the script with "
            "`python -m strata_jax.launch` or unset STRATA_COORDINATOR"
        ) from None
    if not 0 <= process_id < num_processes or local_devices < 1:
        raise ValueError(
            f"inconsistent launcher environment: process_id={process_id}, "
            f"num_processes={num_processes}, local_device_count={local_devices}"
        )
    return {
        "coordinator_address": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_count": local_devices,
    }


def rank_env(
    base: Mapping[str, str],
    *,
    rank: int,
    nproc: int,
    coordinator: str,
    devices_per_proc: int,
    run_dir: str,
    preload: str | None,
    fabric_id: str | None = None,
) -> dict[str, str]:
    """The environment of one rank: ``base`` plus the STRATA_* variables and LD_PRELOAD."""
    env = dict(base)
    if fabric_id is not None:
        env[ENV_FABRIC_ID] = fabric_id
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(nproc)
    env[ENV_PROCESS_ID] = str(rank)
    env[ENV_LOCAL_DEVICES] = str(devices_per_proc)
    env[ENV_RUN_DIR] = run_dir
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the prefixer as they are printed
    return preload_env(env, preload) if preload else env


# gloo prints one such line per rank when XLA's CPU collectives connect (std::cout, no log
