"""Multi-process start-up: ``jax.distributed`` and the shared-memory fabric.

``init()`` is the first call of a script that runs as several processes on one host (under
``python -m strata_jax.launch``, mpirun, srun, or after ``jax.distributed.initialize`` by hand).
It connects strata's native shared-memory fabric: a full mesh of unix sockets (bootstrapped
through the ``jax.distributed`` key-value store) that carries memfd file descriptors, and a
control segment in shared memory that holds the collectives' rendezvous. From then on every
strata collective whose group spans processes reads and writes the peers' own XLA buffers.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from strata_jax._src import runtime

REGISTRATION_MODES = ("on_alloc", "on_use", "staging")
ENV_REGISTRATION = "STRATA_REGISTRATION"
_KV_PREFIX = "strata_jax/fabric"

_state: dict | None = None


def _distributed_client():
    from jax._src import distributed

    return distributed.global_state.client


def _cluster_size() -> int:
    """Number of processes a cluster launcher (OpenMPI, PMI/MPICH, Slurm) says we are."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return 1


def _exit_on_uncaught_exception() -> None:
    """Under the launcher, an uncaught exception ends the rank at once (exit code 1).

    A normal interpreter exit runs jax.distributed's shutdown, which waits for every other
    process: a rank that raised would then hang until its peers finish or time out, and the
    launcher could not see the failure and stop the others. Printing the traceback and calling
    os._exit lets the launcher name the failed rank and stop the rest within seconds.
    """
    import os
    import sys
    import traceback

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            (previous if previous is not sys.__excepthook__ else traceback.print_exception)(
                exc_type, exc, tb
            )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = hook


def init(registration: str | None = None, *, timeout_s: float = 120.0) -> dict:
    """Initializes ``jax.distributed`` (if needed) and connects the shared-memory fabric.

    Call it first, before any other use of jax: it configures the CPU backend.

    Under the strata_jax launcher (``STRATA_COORDINATOR`` etc. set) and with ``jax.distributed``
    not yet initialized, it sets ``jax_num_cpu_devices`` to ``STRATA_LOCAL_DEVICES``, selects
    gloo for XLA's own CPU collectives (so ``jax.lax`` collectives work too, as the baseline) and
    calls ``jax.distributed.initialize(coordinator, num_processes, process_id)``. If
    ``jax.distributed`` is already initialized (mpirun, srun, by hand), that is used as is. With
    a single process (no launcher, no jax.distributed) there is nothing to connect: strata runs
    on the in-process fabric and this returns at once.

    Args:
      registration: how buffers are registered with the fabric: ``"on_alloc"`` (default: the
        allocator registers every new segment from a background thread, so collectives find
        their buffers already shared), ``"on_use"`` (a collective registers a buffer's segment
        the first time it meets it, on the critical path) or ``"staging"`` (never share XLA's
        buffers; copy through a pre-registered bounce buffer, like NCCL/gloo). Default:
        ``$STRATA_REGISTRATION`` or ``"on_alloc"``. All modes give bitwise identical results.
        Buffers the allocator does not own (smaller than its threshold, or the allocator not
        preloaded) are staged in every mode.
      timeout_s: seconds to wait for the other processes during start-up.

    Returns:
      dict with ``process_id``, ``num_processes``, ``registration`` and ``fabric`` (``"shm"``
      or ``"inproc"``).

    Raises:
      ValueError: unknown registration mode, or a malformed launcher environment.
      RuntimeError: the fabric cannot connect (a peer missing, a socket error), or ``init`` is
        called again with a different mode.
    """
    global _state
    mode = registration or os.environ.get(ENV_REGISTRATION) or "on_alloc"
    if mode not in REGISTRATION_MODES:
        raise ValueError(
            f"registration must be one of {REGISTRATION_MODES}, got {mode!r} "
            f"(argument or ${ENV_REGISTRATION})"
        )
    if _state is not None:
        if _state["registration"] != mode and _state["fabric"] == "shm":
            raise RuntimeError(
                f"strata_jax.init() already connected with registration={_state['registration']!r}"
                f"; the mode cannot change in a running process (asked for {mode!r})"
            )
        return dict(_state)

    import jax

    from strata_jax import launch

    env = launch.distributed_env()
    if env is not None:
        _exit_on_uncaught_exception()
    if not jax.distributed.is_initialized() and env is not None:
        if runtime._backend_initialized():
            raise RuntimeError(
                "strata_jax.init() was called after JAX created its backend, so it can no "
                "longer set the device count or join the other processes: call "
                "strata_jax.init() before any other use of jax (right after the imports)."
            )
        jax.config.update("jax_num_cpu_devices", env["local_device_count"])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=env["coordinator_address"],
            num_processes=env["num_processes"],
            process_id=env["process_id"],
        )
    elif not jax.distributed.is_initialized() and _cluster_size() > 1:
        # mpirun / srun: jax.distributed detects the cluster itself.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
    native = runtime.native()
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        _state = {
            "process_id": 0,
            "num_processes": 1,
            "registration": mode,
            "fabric": "inproc",
        }
        return dict(_state)

    pid, n = jax.process_index(), jax.process_count()
    client = _distributed_client()
    ms = int(timeout_s * 1000)
    run_dir = os.environ.get(launch.ENV_RUN_DIR)
    own_dir = None
    if not run_dir or not os.path.isdir(run_dir) or len(run_dir) > 90:
        # A private folder of our own (unix socket paths are limited to 107 bytes); removed
        # again as soon as every process is connected.
        base = tempfile.gettempdir()
        own_dir = run_dir = tempfile.mkdtemp(
            prefix="strata-fabric-", dir=base if len(base) < 60 else "/tmp"
        )  # mode 0700
    try:
        path = native.fabric_listen(run_dir, pid)
        client.key_value_set(f"{_KV_PREFIX}/path/{pid}", path)
        paths = [client.blocking_key_value_get(f"{_KV_PREFIX}/path/{j}", ms) for j in range(n)]
        native.fabric_connect(pid, n, paths, mode)
        # Every process is connected: the socket files are no longer needed. Removing them now
        # leaves nothing in the file system even if a process is killed later.
        client.wait_at_barrier(f"{_KV_PREFIX}/connected", ms)
    finally:
        native.fabric_unlink()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    _state = {"process_id": pid, "num_processes": n, "registration": mode, "fabric": "shm"}
    return dict(_state)


def memory_stats() -> dict:
    """Registration, zero-copy and allocator counters of this process.

    Returns:
      dict with (bytes are bytes, seconds are seconds, counts are per process):

      - ``fabric``: ``"shm"`` (connected across processes) or ``"inproc"``;
        ``registration``: the mode (``"none"`` in-process).
      - ``registered_segments`` / ``registered_bytes``: live segments of this process exported
        to every peer (allocator segments and bounce buffers).
      - ``peer_segments_mapped`` / ``peer_bytes_mapped``: peers' segments mapped here.
      - ``registrations_critical`` / ``registrations_critical_s``: registrations a collective
        had to do itself or wait for (on the critical path), and the time they took.
      - ``registrations_offpath`` / ``registrations_offpath_s``: registrations done by the
        allocator's background thread (off the critical path).
      - ``zero_copy_bytes``: bytes collectives read from / wrote to peers' own buffers.
      - ``staged_bytes``: bytes copied into / out of bounce buffers; ``staged_calls``: calls
        that staged at least one buffer; ``peer_bounce_bytes``: bytes moved between peers
        through bounce buffers; ``bounce_buffer_bytes``: size of this process's bounce buffers.
      - ``allocator``: whether libstrata_alloc serves this process; ``pool_segments``,
        ``pool_segment_bytes``, ``pool_bytes_in_use``, ``pool_bytes_cached``, ``pool_allocs``,
        ``pool_threshold`` from ``strata_alloc_stats`` (zeros without the allocator).
    """
    return dict(runtime.native().memory_stats())
