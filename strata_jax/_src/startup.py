"""Multi-process start-up: ``jax.distributed`` and the shared-memory fabric.

``init()`` is the first call of a script that runs as several processes (under
``python -m strata_jax.launch``, mpirun, srun, or after ``jax.distributed.initialize`` by hand).
It finds the fabric domains (the processes of one host; see ``topology.py``) and connects
strata's native shared-memory fabric inside each: a full mesh of unix sockets (bootstrapped
through the ``jax.distributed`` key-value store) that carries memfd file descriptors, and a
control segment in shared memory, made by the first process of the fabric, that holds the
collectives' rendezvous. From then on every strata collective whose group lies inside a fabric
reads and writes the peers' own XLA buffers; a group that spans fabrics is lowered
hierarchically (``hierarchy/``: strata inside, XLA's own collectives between).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time

from strata_jax._src import allocator, mpi_engine, runtime, topology
from strata_jax._src import engine as _engine

REGISTRATION_MODES = ("on_alloc", "on_use", "staging")
ENV_REGISTRATION = "STRATA_REGISTRATION"
_KV_PREFIX = "strata_jax/fabric"

DEFAULT_INIT_TIMEOUT_S = 300.0  # jax.distributed.initialize's own default wait
_FAILED = f"{_KV_PREFIX}/init_failed"  # /<pid>: why process <pid> gave up in init()
_ENDING = f"{_KV_PREFIX}/init_ending"  # /<pid>: a late process read the failure and is ending
_POLL_S = 0.02  # start-up waits poll the key-value store (one small RPC) this often
_LINGER_MAX_S = 30.0
_LINGER_ARRIVED_S = 5.0  # more, once every awaited process has reached init() at last

_state: dict | None = None


def _distributed_client():
    from strata_jax._src.jax_compat import distributed

    return distributed.global_state.client


def _cluster_size() -> int:
    """Number of processes a cluster launcher (OpenMPI, PMI/MPICH, Slurm) says we are."""
    from strata_jax._src import launch_env

    return launch_env.cluster_env()[1]


INIT_AFTER_BACKEND = (  # under the launcher, mpirun and srun alike
    "strata_jax.init() was called after JAX created its backend, so it can no "
    "longer set the device count or join the other processes: call "
    "strata_jax.init() before any other use of jax (right after the imports)."
)


_hooks_installed = False


def _exit_on_uncaught_exception() -> None:
    """In a multi-process job, an uncaught exception ends the rank at once (exit code 1).

    A normal interpreter exit runs jax.distributed's shutdown, which waits for every other
    process: a rank that raised would then hang until its peers finish or time out, and the
    launcher (or mpirun/srun) could not see the failure and stop the others. Printing the
    traceback and calling os._exit lets the launcher name the failed rank and stop the rest
    within seconds.
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
            try:
                _before_exit()
            finally:
                os._exit(1)

    sys.excepthook = hook


def _broken_job() -> str:
    """Why this process's job cannot finish cleanly ("" when it can): a strata collective
    failed here (timeout, disagreement, dead peer), or a peer process disconnected."""
    native = runtime.native()
    why = []
    failures = int(native.comm_stats().get("failures", 0))
    if failures:
        why.append(f"{failures} strata collective call(s) failed in this process")
    info = native.fabric_info()
    if info and info.get("dead_processes"):
        # A peer that left at its normal exit (it said so first: fabric_leave) is not a broken
        # job: treating it as one cut a healthy job's jax.distributed shutdown short, and the
        # detached JAX client then aborted the process (SIGABRT) at exit.
        left = set(info.get("left_processes", "").split(", ")) - {""}
        dead = [p for p in info["dead_processes"].split(", ") if p and p not in left]
        if dead:
            why.append(f"process(es) {', '.join(dead)} disconnected")
    return "; ".join(why)


_SHUTDOWN_WAIT_S = 1.0


def _skip_distributed_shutdown_if_broken() -> None:
    """atexit (runs before jax's own clean-up, which was registered at ``import jax``).

    jax.distributed's shutdown waits in a barrier for every process. After a collective failed, a
    peer may be stuck (asleep, or waiting in another call) and never arrive: a rank that caught the
    error and called ``sys.exit(1)`` hung there for minutes (122 s). So when this process saw a
    strata collective fail, or a peer disconnect, the shutdown gets ``_SHUTDOWN_WAIT_S`` seconds; if
    the peers have not all arrived by then, the jax.distributed objects are detached (kept alive:
    their destructors would wait too) and the process exits with its own exit code; the launcher,
    mpirun or srun stops the peers. A healthy job never takes this path.
    """
    import sys
    import threading

    if _connect_pending:
        # init() gave up while JAX was still connecting (in a thread, see
        # _initialize_distributed): JAX's shutdown would wait for that connection, and its
        # client abort the process when JAX's own wait runs out. The error is already out.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _before_exit()
    why = _broken_job()
    # Leave the fabric first, whatever the exit: a peer still waiting in a collective for
    # this process (which will never arrive: it is exiting, e.g. by sys.exit() mid-job) fails
    # at once naming it, instead of at the timeout while this process waits for it in
    # jax.distributed's shutdown barrier. Peers that are done with this process see nothing.
    runtime.native().fabric_leave()
    if not why:
        return
    from strata_jax._src.jax_compat import distributed

    st = distributed.global_state
    if st.client is None and st.service is None:
        return
    objs = [x for x in (st.preemption_sync_manager, st.client, st.service) if x is not None]
    done = threading.Event()

    def shutdown() -> None:
        try:
            st.shutdown()
        except Exception:  # noqa: BLE001  (the peers are gone or stuck: nothing to report)
            pass
        done.set()

    threading.Thread(target=shutdown, name="strata-jax-shutdown", daemon=True).start()
    if done.wait(_SHUTDOWN_WAIT_S):
        return
    print(
        f"strata_jax: {why}; not waiting longer than {_SHUTDOWN_WAIT_S:g} s for the other "
        "processes in jax.distributed's shutdown",
        file=sys.stderr,
        flush=True,
    )
    _detached.extend(objs)
    st.preemption_sync_manager = st.client = st.service = None


_detached: list = []  # detached jax.distributed objects, kept alive until the process ends


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    import atexit

    _exit_on_uncaught_exception()
    atexit.register(_skip_distributed_shutdown_if_broken)
    _hooks_installed = True


class StartupError(RuntimeError):
    """A wait of :func:`init` failed: a process did not arrive in time, arrived after another
    process gave up, or the ``jax.distributed`` service could not be reached."""


def _procs(ps) -> str:
    ps = sorted(ps)
    return ("process " if len(ps) == 1 else "processes ") + ", ".join(map(str, ps))


class _Startup:
    """The waits of one :func:`init` call, on the ``jax.distributed`` key-value store.

    Every wait polls the store (one ``key_value_dir_get`` of strata's prefix every
    ``_POLL_S``) until the keys it needs are there, another process has posted that it gave
    up, or the deadline (``timeout_s`` after ``jax.distributed`` is up) passes. A process that
    times out names the missing processes and ``timeout_s`` and posts its message under
    ``_FAILED``; a process arriving later reads it and fails at once with a message naming
    the process that gave up, instead of waiting out its own timeout for a peer that is gone.
    JAX's own waits (``blocking_key_value_get``, ``wait_at_barrier``) would say only
    ``DEADLINE_EXCEEDED: GetKeyValue() timed out with key ...``.
    """

    def __init__(self, client, pid: int, n: int, timeout_s: float):
        self.client, self.pid, self.n, self.timeout_s = client, pid, n, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def _store(self) -> dict[str, str]:
        try:
            return dict(self.client.key_value_dir_get(f"{_KV_PREFIX}/"))
        except Exception as e:  # noqa: BLE001  (the service is gone: say so, with JAX's words)
            raise StartupError(
                f"strata_jax.init: process {self.pid} lost the jax.distributed service "
                f"(it runs in process 0, which has probably exited or crashed; its own error "
                f"says why): {e}"
            ) from e

    def set(self, key: str, value: str) -> None:
        try:
            self.client.key_value_set(key, value)
        except Exception as e:  # noqa: BLE001
            raise StartupError(
                f"strata_jax.init: process {self.pid} could not write to the jax.distributed "
                f"key-value store (process 0, which runs it, has probably exited): {e}"
            ) from e

    def wait(self, what: str, keys: dict[int, str]) -> dict[int, str]:
        """Waits until every key of ``keys`` (process -> key) is set; returns their values."""
        while True:
            store = self._store()
            failed = {k: v for k, v in store.items() if k.startswith(_FAILED + "/")}
            if failed:
                self._late(failed)
            got = {p: store[k] for p, k in keys.items() if k in store}
            if len(got) == len(keys):
                return got
            if time.monotonic() > self.deadline:
                self._timed_out(what, sorted(set(keys) - set(got)))
            time.sleep(_POLL_S)

    def barrier(self, name: str, procs) -> None:
        """Every process of ``procs`` reaches this point (a key each, so that a timeout can
        name the processes that did not)."""
        self.set(f"{_KV_PREFIX}/arrived/{name}/{self.pid}", "1")
        self.wait(f"reach {name}", {p: f"{_KV_PREFIX}/arrived/{name}/{p}" for p in procs})

    def _timed_out(self, what: str, missing: list[int]) -> None:
        msg = (
            f"strata_jax.init: process {self.pid} timed out after {self.timeout_s:g} s "
            f"(timeout_s) waiting for {_procs(missing)} to {what}"
            + f". {_procs(missing).capitalize()} did not reach strata_jax.init() in time: late, "
            "stuck or dead. If they only start slowly, raise the timeout: "
            "strata_jax.init(timeout_s=...)."
        )
        try:
            self.client.key_value_set(f"{_FAILED}/{self.pid}", msg)
        except Exception:  # noqa: BLE001  (the store is gone: the peers fail on it anyway)
            pass
        _gave_up.update(
            missing=missing, linger_s=min(self.timeout_s, _LINGER_MAX_S), timeout_s=self.timeout_s
        )
        raise StartupError(msg)

    def _late(self, failed: dict[str, str]) -> None:
        first = min(failed, key=lambda k: int(k.rsplit("/", 1)[1]))
        who = int(first.rsplit("/", 1)[1])
        _ending.append(self)
        raise StartupError(
            f"strata_jax.init: process {self.pid} arrived after process {who} gave up waiting "
            f"for it; process {who} said: {failed[first]}"
        )

    def announce_ending(self) -> None:
        """Tells a process that lingers for this one that it is ending now (at exit)."""
        try:
            self.client.key_value_set(f"{_ENDING}/{self.pid}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass


# A late process that read another's failure: at exit it tells the lingering service host.
_ending: list[_Startup] = []
# This process gave up in init(): the processes it waited for, and how long to keep the
# jax.distributed service up for them (only if this process runs it) at exit.
_gave_up: dict = {}


def _before_exit() -> None:
    """At exit after a failed init(): keeps a late peer from JAX's abort.

    When the process that runs the jax.distributed service (process 0) exits, every other
    process's JAX client terminates its process ("Terminating process because the JAX
    distributed service detected fatal errors": a C++ abort that Python cannot catch). So a
    process 0 that gave up waiting in init() keeps the service up, at most
    ``min(timeout_s, _LINGER_MAX_S)`` seconds, until each process it waited for has arrived,
    read why, and is ending with its own clear error (``_ENDING``), or ``_LINGER_ARRIVED_S``
    more once all of them have reached init(); then it exits.
    """
    for st in _ending:
        st.announce_ending()
    if not _gave_up:
        return
    from strata_jax._src.jax_compat import distributed

    gs = distributed.global_state
    if gs.service is None or gs.client is None:
        return
    missing, linger = _gave_up["missing"], _gave_up["linger_s"]
    print(
        f"strata_jax.init: keeping the jax.distributed service up for at most {linger:g} s "
        f"so that {_procs(missing)} can fail with this error instead of an abort",
        file=sys.stderr,
        flush=True,
    )
    until = time.monotonic() + linger
    waiting, extended = list(missing), False
    while time.monotonic() < until:
        try:
            store = dict(gs.client.key_value_dir_get(f"{_KV_PREFIX}/"))
        except Exception:  # noqa: BLE001
            return
        waiting = [p for p in missing if f"{_ENDING}/{p}" not in store]
        if not waiting:
            time.sleep(0.5)  # they exit right after saying so
            return
        if not extended and all(f"{_KV_PREFIX}/fabric_id/{p}" in store for p in waiting):
            # They have all just reached init() and are reading why: a few seconds more.
            until, extended = max(until, time.monotonic() + _LINGER_ARRIVED_S), True
        time.sleep(_POLL_S * 5)
    # Not in strata_jax.init() (busy or asleep before it) or dead: a live one is connected to
    # jax.distributed, and its JAX client aborts it when this process, which runs the
    # service, exits. Say so first, so that the abort is read as this error's consequence.
    print(
        f"strata_jax.init: {_procs(waiting)} did not reach strata_jax.init() within "
        f"{_gave_up['timeout_s']:g} s (timeout_s) nor in the {linger:g} s since: if "
        f"{'it is' if len(waiting) == 1 else 'they are'} alive, JAX's client there ends "
        "the process with an abort (SIGABRT, 'the JAX distributed service detected fatal "
        "errors') when this process, which runs the jax.distributed service, exits now: that "
        "abort is the consequence of this error, not a separate fault",
        file=sys.stderr,
        flush=True,
    )


# jax.distributed's own connection wait is this much longer than init()'s, so that init() gives
# up first with its own error: when JAX's wait runs out, its client ends the process with an
# abort (a C++ LOG(FATAL): "Terminating process because the JAX distributed service detected
# fatal errors ... RegisterTask ... DEADLINE_EXCEEDED") that Python can neither catch nor explain.
_JAX_CONNECT_MARGIN_S = 120
_connect_pending: list = []  # the connecting thread of a jax.distributed start that timed out


def _coordinator_refuses(address: str) -> bool:
    """Whether nothing listens at the coordinator's address (process 0 not started, or gone)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return True
    return False


def _connect_timed_out(timeout_s: float) -> StartupError:
    """init()'s error when ``jax.distributed`` did not connect every process in ``timeout_s``.

    JAX's service, in process 0, holds every process in its registration barrier until all
    have registered and says to no one which are missing; so process 0 names all the others,
    and another process names process 0 when nothing listens at the coordinator's address.
    """
    from strata_jax._src.jax_compat import distributed

    gs = distributed.global_state
    pid, n, where = gs.process_id, gs.num_processes, gs.coordinator_address or "?"
    others = [p for p in range(n) if p != pid]
    if pid != 0 and gs.coordinator_address and _coordinator_refuses(gs.coordinator_address):
        who, why = [0], " (nothing listens at that address: process 0 runs the coordinator)"
    else:
        who = others
        why = "" if len(others) == 1 else " (some of them: jax.distributed does not say which)"
    return StartupError(
        f"strata_jax.init: process {pid} timed out after {timeout_s:g} s (timeout_s) waiting for "
        f"{_procs(who)} to connect to jax.distributed (coordinator {where}){why}. "
        f"{_procs(who).capitalize()} did not reach strata_jax.init() in time: late, stuck or "
        "dead. If they only start slowly, raise the timeout: strata_jax.init(timeout_s=...)."
    )


def _is_connection_error(e: BaseException) -> bool:
    """Whether ``jax.distributed.initialize`` failed to reach or hear from its peers (a late,
    stuck or dead process), rather than on the cluster's description or its arguments."""
    text = str(e)
    return any(
        k in text
        for k in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "timed out", "Barrier", "connect", "Socket")
    )


def _initialize_distributed(timeout_s: float, **kwargs) -> None:
    """``jax.distributed.initialize`` within init()'s timeout; its errors say what to change.

    JAX's connection runs in a thread of its own, with a wait ``_JAX_CONNECT_MARGIN_S`` longer
    than ``timeout_s``; this thread waits ``timeout_s`` for it. A process that misses the wait
    therefore fails here with a StartupError naming the processes and ``timeout_s``, instead of
    being aborted by JAX's client when its own wait runs out. The thread, left
    waiting, is never joined: the process ends (the launcher's, mpirun's or srun's stop, or the
    uncaught error's exit) before JAX's longer wait runs out.
    """
    import threading

    import jax

    done: dict = {}

    def connect() -> None:
        try:
            jax.distributed.initialize(
                initialization_timeout=math.ceil(timeout_s) + _JAX_CONNECT_MARGIN_S, **kwargs
            )
        except BaseException as e:  # noqa: BLE001  (handed to the waiting thread)
            done["error"] = e

    t = threading.Thread(target=connect, name="strata-jax-distributed-connect", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        _connect_pending.append(t)
        raise _connect_timed_out(timeout_s)
    e = done.get("error")
    if e is not None and not _is_connection_error(e):  # the cluster or the call is at fault
        hint = ""
        ompi5 = "OMPI_COMM_WORLD_SIZE" in os.environ and "OMPI_MCA_orte_hnp_uri" not in os.environ
        if "mpi4py" in str(e) or ompi5:
            hint = (
                " This looks like Open MPI 5, whose mpirun gives JAX no coordinator address: "
                "JAX finds it through mpi4py (pip install mpi4py, against this machine's "
                "MPI), or start the job with python -m strata_jax.launch."
            )
        text = str(e).rstrip(". ")
        raise StartupError(
            f"strata_jax.init: jax.distributed.initialize failed: {text}.{hint}"
        ) from e
    if e is not None:
        where = kwargs.get("coordinator_address") or "the address the cluster gives"
        raise StartupError(
            f"strata_jax.init: jax.distributed.initialize did not connect every process to "
            f"the coordinator at {where} within {timeout_s:g} s (timeout_s): a process is "
            "late, stuck or dead, or the coordinator (process 0) is gone. If processes only "
            f"start slowly, raise the timeout: strata_jax.init(timeout_s=...). JAX said: {e}"
        ) from e


def init(
    registration: str | None = None,
    *,
    timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    engine: str | None = None,
) -> dict:
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
      timeout_s: seconds to wait for the other processes during start-up (default 300,
        JAX's own ``jax.distributed.initialize`` default, so strata never gives up before
        the wait it sits behind). When init() starts ``jax.distributed`` itself, waiting for
        every process to connect is init()'s wait too: JAX connects in a thread, with its own
        wait 120 s longer (when JAX's wait runs out it aborts the process), and init() gives
        up at ``timeout_s``. A process that gives up names the processes it waited for; one
        that arrives after another gave up fails at once naming it (see
        docs/guide/troubleshooting.md).

    Fabric domains: each process's fabric id (``$STRATA_FABRIC_ID``, else hostname + boot id)
    is exchanged through the ``jax.distributed`` key-value store; shared memory is connected
    only among processes with the same id (nothing of one fabric -- socket path, file,
    segment -- is looked up from another), and a process alone in its fabric connects nothing.

    The allocator: ``import strata_jax`` already put libstrata_alloc in XLA's allocation
    path (preloaded by the launcher or ``strata-run``, else hooked into jaxlib; see
    ``allocator.py``), so mpirun, srun and a plain ``python`` get registration on allocation
    too. Where it could not (``STRATA_ALLOC_HOOK=0``, library missing), a shared-memory
    fabric runs in ``staging`` mode and one line on stderr says why and what to change.

    Returns:
      dict with ``process_id``, ``num_processes``, ``registration`` (the mode in effect),
      ``registration_requested``, ``allocator`` (``"preload"``, ``"hook"`` or ``"off"``),
      ``fabric`` (``"shm"``
      when this process shares memory with others, else ``"inproc"``), ``fabric_index``,
      ``num_fabrics`` and ``fabric_processes`` (the processes of this fabric); with several
      processes also ``engine``, what runs XLA's collectives between them (``jax.lax``'s and
      those XLA's partitioner inserts): ``"strata"`` (strata's engine, the default: XLA's MPI
      collectives over ``libstrata_mpi.so``), ``"gloo"`` or ``"mpi"`` (a real MPI), and
      ``engine_why`` (how it was chosen, or why strata's fell back to gloo).

    ``engine``: what runs XLA's collectives between processes, ``"strata"``, ``"gloo"`` or
    ``"mpi"`` (XLA over the MPI that ``MPITRAMPOLINE_LIB`` names); default ``$STRATA_ENGINE``,
    else strata's (see docs/guide/processes.md). strata's needs ``import strata_jax`` before
    jax.

    Raises:
      ValueError: unknown registration mode, a malformed launcher environment, or an
        unknown ``STRATA_ENGINE``.
      StartupError (a RuntimeError): a process did not reach ``init`` within ``timeout_s``
        (message: ``strata_jax.init: process P timed out after T s (timeout_s) waiting for
        process Q ...``, ``... to connect to jax.distributed`` when init() started it), this
        process arrived after another gave up, or ``jax.distributed.initialize`` failed. A
        process whose jax.distributed connection timed out ends with exit code 1 at
        interpreter exit, even if the error was caught (JAX's connecting thread cannot be
        stopped).
      RuntimeError: the fabric cannot connect (a socket error), or ``init`` is called again
        with a different mode.
    """
    global _state
    if engine is not None:
        _engine.override(engine)
    mode = registration or os.environ.get(ENV_REGISTRATION) or "on_alloc"
    if mode not in REGISTRATION_MODES:
        raise ValueError(
            f"registration must be one of {REGISTRATION_MODES}, got {mode!r} "
            f"(argument or ${ENV_REGISTRATION})"
        )
    if _state is not None:
        if _state["registration_requested"] != mode and _state["fabric"] == "shm":
            raise RuntimeError(
                f"strata_jax.init() already connected with registration={_state['registration']!r}"
                f"; the mode cannot change in a running process (asked for {mode!r})"
            )
        return dict(_state)

    import jax

    from strata_jax._src import launch_env

    env = launch_env.distributed_env()
    if env is not None:
        _install_exit_hooks()
    # init() starts jax.distributed (the launcher's, or mpirun/srun's): JAX's backend must not
    # exist yet, or each rank has already made a one-process one.
    starts = not jax.distributed.is_initialized() and (env is not None or _cluster_size() > 1)
    if starts and runtime._backend_initialized():
        raise RuntimeError(INIT_AFTER_BACKEND)
    if not jax.distributed.is_initialized() and env is not None:
        jax.config.update("jax_num_cpu_devices", env["local_device_count"])
        if _engine.choose(env["local_device_count"]) == "mpi" and mpi_engine.selected():
            if _cluster_size() != env["num_processes"]:
                raise ValueError(
                    "jax_cpu_collectives_implementation is 'mpi', but these processes were not "
                    "started as one MPI job (each would be an MPI world of its own): use "
                    "`python -m strata_jax.launch --engine mpi` (it starts the ranks with "
                    "mpirun), or mpirun itself (see docs/guide/hosts.md, XLA over MPI), or gloo "
                    "under the launcher"
                )
            # The launcher's --engine mpi: an MPI job whose jax.distributed coordinator is the
            # launcher's (mpirun's own address is not reachable from a simulated host).
            mpi_engine.configure_before_backend()
        elif not _engine.active():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _initialize_distributed(
            timeout_s,
            coordinator_address=env["coordinator_address"],
            num_processes=env["num_processes"],
            process_id=env["process_id"],
        )
    elif not jax.distributed.is_initialized() and _cluster_size() > 1:
        # mpirun / srun: jax.distributed detects the cluster itself. The engine between
        # processes is strata's (engine.py), unless the user chose gloo or XLA's MPI
        # collectives over a real MPI (mpi_engine.py).
        _install_exit_hooks()
        if _engine.choose(_local_device_count()) == "mpi" and mpi_engine.selected():
            mpi_engine.configure_before_backend()
        elif not _engine.active():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from strata_jax._src import jax_compat

        _initialize_distributed(timeout_s, **jax_compat.cluster_detection_kwargs())
    if mpi_engine.selected() and jax.distributed.is_initialized():
        if not runtime._backend_initialized():
            # also where the user started jax.distributed by hand before init()
            mpi_engine.configure_before_backend()
        mpi_engine.create_backend()  # now, so MPI is finalised after XLA's communicators
    native = runtime.native()
    early = _engine_before_backend(native, timeout_s)  # strata's engine: before MPI_Init_thread
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        _state = {
            "process_id": 0,
            "num_processes": 1,
            "registration": mode,
            "registration_requested": mode,
            "allocator": allocator.state["mode"],
            "fabric": "inproc",
        }
        return dict(_state)

    pid, n = jax.process_index(), jax.process_count()
    launch_env.mark_joined(pid)  # the launcher's end-of-job check: not N one-process jobs
    _install_exit_hooks()  # also under mpirun/srun or a hand-made jax.distributed
    if early is not None:
        start, ids = early
    else:
        start = _Startup(_distributed_client(), pid, n, timeout_s)
        ids = _fabric_ids(start, pid, n)
    fmap = topology.set_fabric_map([ids[j] for j in range(n)], pid)
    members = fmap.members(fmap.own)
    requested = mode
    _check_limits(start, pid, n, members)
    if len(members) > 1:
        mode = _mode_in_effect(native, mode)
        _connect_fabric(native, start, pid, members, mode, len(fmap.names))
    if _engine.active():
        _engine_after_fabric(native, n, members)
    elif pid == 0:
        _engine.say_fallback()
    # Every process is connected (or alone in its fabric) before any collective runs.
    start.barrier("connected", range(n))
    fabric = "shm" if len(members) > 1 else "inproc"
    _state = {
        "process_id": pid,
        "num_processes": n,
        "registration": mode,
        "registration_requested": requested,
        "allocator": allocator.state["mode"],
        "fabric": fabric,
        "fabric_index": fmap.own,
        "num_fabrics": len(fmap.names),
        "fabric_processes": list(members),
        **_engine_state(),
    }
    return dict(_state)


def _engine_state() -> dict:
    """init()'s ``engine`` (what runs XLA's collectives between processes) and ``engine_why``."""
    import jax

    eng = _engine.state["engine"]
    if eng is None or (eng == "mpi" and not mpi_engine.selected()):
        eng = "strata" if _engine.active() else jax.config.jax_cpu_collectives_implementation
    return {"engine": eng or "none", "engine_why": _engine.state["why"] or "jax's configuration"}


def _fabric_ids(start: _Startup, pid: int, n: int) -> dict[int, str]:
    """Every process's fabric id (topology.py), exchanged through the key-value store."""
    # Fabric domains: shared memory connects only the processes of one fabric (see topology.py).
    start.set(f"{_KV_PREFIX}/fabric_id/{pid}", topology.local_fabric_id())
    return start.wait(
        "reach strata_jax.init()", {j: f"{_KV_PREFIX}/fabric_id/{j}" for j in range(n)}
    )


def _local_device_count() -> int:
    """CPU devices per process as configured before the backend exists (mpirun/srun)."""
    import re

    import jax

    n = int(jax.config.jax_num_cpu_devices)
    if n > 0:
        return n
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def _engine_before_backend(native, timeout_s: float):
    """With strata's engine for XLA's collectives (engine.py), before JAX creates its backend
    (where XLA calls MPI_Init_thread): the fabric ids, exchanged now, decide whether the engine
    can run (one fabric: every process shares memory with every other), then its world is
    configured; else XLA's collectives fall back to gloo, one stderr line saying why.
    Returns (start, ids) for init() to go on with, or None (nothing exchanged)."""
    from strata_jax._src.jax_compat import distributed

    gs = distributed.global_state
    if not _engine.active() or gs.client is None or (gs.num_processes or 1) < 2:
        return None
    if runtime._backend_initialized():
        # jax.distributed and the backend were made by hand before init() (the backend called
        # MPI_Init_thread unconfigured and failed there): nothing to change any more.
        return None
    import jax

    # jax.distributed started by hand (not by init()): XLA's collectives are still MPI's.
    jax.config.update("jax_cpu_collectives_implementation", "mpi")
    pid, n = gs.process_id, gs.num_processes
    start = _Startup(_distributed_client(), pid, n, timeout_s)
    ids = _fabric_ids(start, pid, n)
    fabrics = len(set(ids.values()))
    if fabrics > 1:
        _engine.fall_back_before_backend(
            f"the {n} processes are on {fabrics} fabrics (hosts), and strata's engine moves "
            "bytes only inside one (it does not yet hand the bytes that cross hosts to a real "
            "MPI): XLA's collectives run over gloo, and give the same values. For XLA over a real "
            "MPI between hosts, start the job with `--engine mpi` (mpirun, and MPITRAMPOLINE_LIB "
            "naming a libmpiwrapper.so built from https://github.com/eschnett/MPIwrapper "
            "against that MPI); strata's own operators (strata_jax.psum ..., use_for_jax_lax()) "
            "cross hosts hierarchically either way"
        )
    else:
        _engine.before_backend(native, pid, n)
    return start, ids


def _engine_after_fabric(native, n: int, members) -> None:
    """Gives strata's engine each process's device and its index in this fabric."""
    import jax

    first: dict[int, int] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(d.process_index, d.id)
    local = {p: i for i, p in enumerate(members)}
    _engine.after_fabric(native, [first[p] for p in range(n)], [local.get(p, -1) for p in range(n)])


def _check_limits(start: _Startup, pid: int, n: int, members: tuple[int, ...]) -> None:
    """Every process checks the system's limits for its fabric (``limits.py``) and posts what it
    found; every process then fails alike, naming each short process and limit, or goes on."""
    from strata_jax._src import limits

    problems = []
    if len(members) > 1:
        problems = limits.check(
            len(members), n, limits.default_reserve(len(members)), control_bytes=1 << 20
        )
    start.set(f"{_KV_PREFIX}/limits/{pid}", "\n".join(problems) or "ok")
    found = start.wait(
        "check the system's limits", {j: f"{_KV_PREFIX}/limits/{j}" for j in range(n)}
    )
    by_message: dict[str, list[int]] = {}
    for j in sorted(found):
        if found[j] != "ok":
            for msg in found[j].split("\n"):
                by_message.setdefault(msg, []).append(j)
    if by_message:
        # Every process fails alike; process 0 keeps the jax.distributed service up until the
        # others have said they are ending (else their JAX clients abort them before they print).
        _ending.append(start)
        if pid == 0:
            _gave_up.update(missing=list(range(1, n)), linger_s=10.0, timeout_s=start.timeout_s)
        lines = [f"{_procs(ps)}: {msg}" for msg, ps in by_message.items()]
        raise limits.LimitError(
            f"strata_jax.init: a limit of the operating system is too low for this job of {n} "
            f"processes (reported by process {pid}); " + "; ".join(lines)
        )


def _mode_in_effect(native, mode: str) -> str:
    """The registration mode this process can honour: ``on_alloc``/``on_use`` need the
    allocator to serve XLA's buffers; without it every byte is staged, so the mode in effect
    (what ``init()`` and ``memory_stats()`` report) is ``staging``, and one line says why and
    what to change."""
    import sys

    if mode == "staging" or native.memory_stats().get("allocator"):
        return mode
    st = allocator.install()
    print(
        f"strata_jax: registration {mode!r} needs libstrata_alloc serving XLA's buffers, but "
        f"{st['reason'] or 'it is not active'}: collectives stage every byte (registration "
        f"'staging'). Fix: {st['fix'] or 'start each process as `strata-run python script.py`'}.",
        file=sys.stderr,
        flush=True,
    )
    return "staging"


def _connect_fabric(
    native, start: _Startup, pid: int, members: tuple[int, ...], mode: str, fabrics: int = 1
):
    """Connects the shared-memory fabric among ``members`` (process indices of one fabric).

    The native fabric numbers its processes 0..len(members)-1 in process order; the first
    member makes the control segment. Socket paths are exchanged through the key-value store,
    but only members read each other's: nothing of this fabric is looked up from another.
    """
    from strata_jax._src import launch_env

    run_dir = os.environ.get(launch_env.ENV_RUN_DIR)
    own_dir = None
    if not run_dir or not os.path.isdir(run_dir) or len(run_dir) > 90:
        # A private folder of our own (unix socket paths are limited to 107 bytes); removed
        # again as soon as every process is connected.
        base = tempfile.gettempdir()
        own_dir = run_dir = tempfile.mkdtemp(
            prefix="strata-fabric-", dir=base if len(base) < 60 else "/tmp"
        )  # mode 0700
    try:
        # Which process owns each device: a collective that waits for a rank whose process
        # disconnected fails at once instead of at the timeout. The native fabric numbers the
        # members of this fabric 0..len(members)-1 (other fabrics' devices are not listed); its
        # messages name the job's process indices (``members``), as the user knows them.
        import jax

        local = {p: i for i, p in enumerate(members)}
        devices = [d for d in jax.devices() if d.process_index in local]
        native.fabric_set_device_procs(
            [d.id for d in devices],
            [local[d.process_index] for d in devices],
            list(members),
            fabrics,
        )
        path = native.fabric_listen(run_dir, pid)
        start.set(f"{_KV_PREFIX}/path/{pid}", path)
        paths = start.wait(
            "publish a fabric socket path", {j: f"{_KV_PREFIX}/path/{j}" for j in members}
        )
        native.fabric_connect(members.index(pid), len(members), [paths[j] for j in members], mode)
        # Every member is connected: the socket files are no longer needed. Removing them now
        # leaves nothing in the file system even if a process is killed later.
        start.barrier(f"connected/{members[0]}", members)
    finally:
        native.fabric_unlink()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
