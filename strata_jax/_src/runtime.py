"""Process-wide settings, the launch-pool check, and ``native()``: the extension for callers.

The extension itself is imported and its FFI targets registered in ``extension.py``.

Importing strata_jax must happen before JAX creates its CPU backend: XLA's CPU client sizes
its launch thread pool then (see ``configure_launch_threads``).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings

from strata_jax._src import extension

_MIN_LAUNCH_THREADS = 64


def _requested_cpu_devices() -> int:
    """Best guess of the number of CPU devices JAX will create (before the backend exists)."""
    n = 1
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if m:
        n = max(n, int(m.group(1)))
    for var in ("JAX_NUM_CPU_DEVICES",):
        if os.environ.get(var, "").isdigit():
            n = max(n, int(os.environ[var]))
    return n


def configure_launch_threads() -> None:
    """Gives XLA's CPU client enough launch threads that dispatch-ahead cannot deadlock.

    XLA CPU gang-schedules every multi-device launch: a launch needs all N devices' threads of the
    "XLAPjRtCpuClient" pool at once, and each launch also takes a per-device in-flight slot (32) *on
    a pool thread*. When Python runs ~33 launches ahead, one pool thread blocks on that semaphore
    and the oldest launch gets only N-1 threads: every participant of a collective waits for the
    missing one and XLA aborts ("only 7 of 8 arrived"). The pool has ``max(PJRT_NPROC, N)`` threads;
    with at least 2N threads the blocked semaphore waiter can no longer starve a launch (measured:
    20 of 20 runs of 1000 chained calls on 8 devices). No handler-side fix exists, so strata sets
    PJRT_NPROC here, before the backend is created, unless the user already chose a value.
    """
    want = max(_MIN_LAUNCH_THREADS, 2 * _requested_cpu_devices())
    cur = os.environ.get("PJRT_NPROC")
    _register_backend_hook()
    if cur is None:
        if _backend_initialized():
            launch_pool["set_in_time"] = False
            warnings.warn(
                "strata_jax was imported after JAX created its CPU backend, so it could not "
                "size XLA's launch thread pool: dispatching many multi-device calls ahead "
                "without blocking may deadlock inside XLA. Import strata_jax first, or set "
                f"PJRT_NPROC>={want} in the environment.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        os.environ["PJRT_NPROC"] = str(want)


# What strata knows about XLA's CPU launch pool (``python -m strata_jax.info`` prints it):
# whether PJRT_NPROC was in the environment when JAX created its CPU backend, the pool size that
# follows (max(PJRT_NPROC | NPROC | cores, devices)) and the number of local CPU devices.
launch_pool: dict = {"set_in_time": None, "threads": None, "devices": None}

_DEADLOCK_TIMEOUT_S = 20.0
_timeout_chosen = "STRATA_TIMEOUT_S" in os.environ  # the user picked a timeout: keep it
_launch_checked = False


def _pool_threads(devices: int) -> int:
    for var in ("PJRT_NPROC", "NPROC"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return max(int(v), devices)
    return max(os.cpu_count() or 1, devices)


def _register_backend_hook() -> None:
    from strata_jax._src import jax_compat

    jax_compat.on_backend_created(_on_backend_created)


def _on_backend_created(backend) -> None:
    """Runs when JAX creates a backend: records the launch pool, catches a missing init()."""
    if getattr(backend, "platform", None) != "cpu":
        return
    if launch_pool["set_in_time"] is None:
        launch_pool["set_in_time"] = "PJRT_NPROC" in os.environ
    check_launcher_init()


def check_launcher_init() -> None:
    """Raises when this process is one of several (started by ``strata_jax.launch``, mpirun or
    srun) but neither ``strata_jax.init()`` nor ``jax.distributed.initialize()`` was called.

    Without either, each rank creates a one-process JAX backend: every collective then runs over
    one process and returns its input (psum of one rank), a silently wrong result.
    """
    from strata_jax._src import launch_env

    env = launch_env.distributed_env()
    if env is not None:
        if env["num_processes"] < 2:
            return
        who = f"rank {env['process_id']} of {env['num_processes']} started by strata_jax.launch"
    else:
        var, n, _ = launch_env.cluster_env()
        if n < 2:
            return
        who = f"one of {n} processes started by a launcher such as mpirun or srun ({var}={n})"
    import jax

    if jax.distributed.is_initialized():
        return
    raise RuntimeError(
        f"This process is {who}, but strata_jax.init() was not called before JAX created its "
        "backend: every rank would run as a separate one-process job and collectives would "
        "silently return wrong results. Call strata_jax.init() first, before any other use "
        "of jax."
    )


def _check_launch_pool() -> None:
    """At the first lowering after the backend exists: a too-small launch pool gets a short
    timeout and a timeout error that names the dispatch-ahead deadlock and its fix."""
    global _launch_checked
    if _launch_checked or not _backend_initialized():
        return
    check_launcher_init()
    _launch_checked = True
    import jax

    n = jax.local_device_count("cpu")
    threads = _pool_threads(n)
    launch_pool.update(threads=threads, devices=n)
    if launch_pool["set_in_time"] is None:
        launch_pool["set_in_time"] = False
    if n < 2 or threads >= 2 * n:
        return
    shortened = ""
    if not _timeout_chosen:
        extension.load().set_timeout(_DEADLOCK_TIMEOUT_S)
        shortened = (
            f" (strata shortened its timeout to {_DEADLOCK_TIMEOUT_S:g} s for this reason; "
            "strata_jax.set_timeout overrides)"
        )
    extension.load().set_timeout_hint(
        f" Likely cause: the dispatch-ahead deadlock of XLA's CPU client. Its launch pool "
        f"has {threads} threads for {n} devices (fewer than 2x): strata_jax was imported "
        "after JAX created its CPU backend"
        + ("" if launch_pool["set_in_time"] else " and PJRT_NPROC was not set in time")
        + ". With ~32 multi-device calls dispatched ahead without blocking, a device never "
        "gets a thread, so its peers wait for it here. Fix: import strata_jax before any "
        f"other use of jax (or set PJRT_NPROC>={2 * n} in the environment), or block on a "
        "result every few calls (jax.block_until_ready)" + shortened + "."
    )


def _backend_initialized() -> bool:
    from strata_jax._src import jax_compat

    return jax_compat.backends_created()


def env_bytes(name: str, default: int, example: str, minimum: int = 0) -> int:
    """A byte count from the environment variable ``name``: digits with an optional K/M/G
    suffix (powers of 1024), >= ``minimum``; ``default`` when unset or empty.

    Raises:
      ValueError: naming the variable, the value and ``example`` (e.g. ``"1M; 0: off"``) when
        the value is not such a count (``1.5M``, ``-1``, ``foo``) or is below ``minimum``.
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:].upper(), 1)
    digits = v[:-1] if scale > 1 else v
    if not digits.isdigit() or int(digits) * scale < minimum:
        least = f" >= {minimum}" if minimum else ""
        raise ValueError(
            f"{name}={v!r}: give a number of bytes{least}, K/M/G allowed (e.g. {example})"
        )
    return int(digits) * scale


def env_count(name: str, default: int, example: str) -> int:
    """A whole number >= 0 (digits only) from the environment variable ``name`` (spin and
    yield rounds, milliseconds); ``default`` when unset or empty.

    Raises:
      ValueError: naming the variable, the value and ``example`` (e.g. ``"2000"``) when the
        value is not such a number (``-3``, ``abc``, ``1.5``).
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not v.isdigit():
        raise ValueError(f"{name}={v!r}: give a whole number >= 0 (e.g. {example})")
    return int(v)


def env_bool(name: str, default: bool, meaning: str) -> bool:
    """An on/off setting from the environment variable ``name``: ``1`` (on) or ``0`` (off);
    ``default`` when unset or empty.

    Raises:
      ValueError: naming the variable, the value and ``meaning`` (what ``0`` or ``1`` does)
        for any other value (``maybe``, ``2``, ``on``).
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: give 1 or 0 ({meaning})")
    return v == "1"


# Byte settings the native library reads from the environment itself (native/common/env.cc,
# env_bytes): checked here at first use, so that a value it cannot read is an error instead of
# a path silently turned off.
_NATIVE_BYTE_SETTINGS = {
    "STRATA_LL_BYTES": "64K, the default; 0: no low-latency path",
    "STRATA_LL_STAGE_BYTES": "1M; 0 (the default): no staged form",
    "STRATA_DIRECT_BYTES": "4K, the default",
    "STRATA_STREAM_BYTES": "2M, the default",
    "STRATA_TWO_SHOT_BYTES": "1K, the default",
    "STRATA_ALLOC_KEEP_BYTES": "256M; unset: 1/32 of the host's memory over the fabric's "
    "processes, at least 16M",
}
# On/off settings the native library reads itself (native/common/env.cc, env_flag), with their
# default and what 1 and 0 do.
_NATIVE_BOOL_SETTINGS = {
    "STRATA_STATS": (True, "1, the default: per-operator counters; 0: off"),
    "STRATA_THP": (True, "1, the default: huge-page advice on large outputs; 0: none"),
    "STRATA_INPROC_PAIRS": (True, "1, the default: pairwise all_to_all in one process; 0: off"),
    "STRATA_PREFAULT": (False, "1: fault in a peer's segment on mapping; 0, the default: no"),
    "STRATA_ALLOC_DISABLE": (
        False,
        "1: the allocator serves everything from glibc; 0: it does not",
    ),
}
# Counts the native library reads itself (native/common/env.cc, env_count).
_NATIVE_COUNT_SETTINGS = {
    "STRATA_LL_SPINS": "2000, the default; 100 with more processes than cores",
    "STRATA_LL_YIELDS": "4, the default",
    "STRATA_SHM_SPINS": "64, the default",
    "STRATA_SHM_YIELDS": "16, the default; 4 with more processes than cores",
    "STRATA_SHM_BARRIER_GROUP": "0, the default: flat up to 64 ranks, ceil(sqrt(N)) above",
}
# The allocator's sizes (native/alloc/interpose.cc, read at its first allocation): it takes
# digits with an optional K/M/G and ignores anything after, and falls back to its default on
# anything else, so a value it cannot read is reported here, at first use.
_ALLOC_BYTE_SETTINGS = {
    "STRATA_ALLOC_THRESHOLD": "64K, the default",
    "STRATA_ALLOC_CACHE_BYTES": "1G, the default",
    "STRATA_ALLOC_SEGMENT_BYTES": "64M, the default",
    "STRATA_ALLOC_RESERVE_BYTES": "128M; 0: no reserve",
}
_ALLOC_BYTES_RE = re.compile(r"\d+([KMGkmg](i?[Bb])?|[Bb])?")
_env_checked = False


def _check_native_env() -> None:
    global _env_checked
    for name, example in _NATIVE_BYTE_SETTINGS.items():
        env_bytes(name, 0, example)
    for name, (default, meaning) in _NATIVE_BOOL_SETTINGS.items():
        env_bool(name, default, meaning)
    for name, example in _NATIVE_COUNT_SETTINGS.items():
        env_count(name, 0, example)
    for name, example in _ALLOC_BYTE_SETTINGS.items():
        v = os.environ.get(name, "").strip()
        if v and not _ALLOC_BYTES_RE.fullmatch(v):
            raise ValueError(
                f"{name}={v!r}: give a number of bytes, K/M/G allowed (e.g. {example}); the "
                "allocator ignored it and used its default"
            )
    # A segment of 0 bytes is none: the allocator would quietly use its smallest segment.
    v = os.environ.get("STRATA_ALLOC_SEGMENT_BYTES", "").strip()
    if v and int(re.match(r"\d+", v).group()) == 0:
        raise ValueError(
            f"STRATA_ALLOC_SEGMENT_BYTES={v!r}: give a number of bytes > 0, K/M/G allowed "
            "(e.g. 64M, the default)"
        )
    env_count(
        "STRATA_ALLOC_RESERVE_DELAY_MS", 200, "200 milliseconds, the default; 0: refill at once"
    )
    v = os.environ.get("STRATA_TIMEOUT_S", "").strip()
    if v:
        try:
            ok = math.isfinite(float(v)) and float(v) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"STRATA_TIMEOUT_S={v!r}: give the seconds a collective waits for its peers, a "
                "number > 0 (e.g. 300)"
            )
    _env_checked = True


def native():
    """The loaded ``strata_jax._strata`` extension, with its FFI targets registered
    (``extension.load()``); checks the launch pool at first use after the backend exists."""
    if not _env_checked:
        _check_native_env()
    module = extension.load()
    if not _launch_checked:
        _check_launch_pool()
    return module


def set_timeout(seconds: float) -> None:
    """Sets how long a collective waits for its peers before failing.

    Args:
      seconds: timeout in seconds (> 0). Default 300, or ``STRATA_TIMEOUT_S``.

    Raises:
      ValueError: if ``seconds`` is not positive.

    A collective that times out raises one of :data:`COLLECTIVE_ERRORS` naming the operation,
    the missing ranks and the phase it was in; it never hangs forever.
    """
    global _timeout_chosen
    if not seconds > 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds!r}")
    _timeout_chosen = True
    native().set_timeout(float(seconds))


def get_timeout() -> float:
    """Returns the collective timeout in seconds."""
    return float(native().get_timeout())


def _check_nbytes(nbytes) -> int:
    """A threshold in bytes must be an integer (Python's or numpy's; ``"abc"`` used to fail
    with a bare comparison TypeError) and not negative. Returns it as an int."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(
            f"threshold must be an integer number of bytes (e.g. 1024), got "
            f"{type(nbytes).__name__} {nbytes!r}"
        )
    if nbytes < 0:
        raise ValueError(f"threshold must be >= 0 bytes, got {nbytes}")
    return int(nbytes)


def set_two_shot_threshold(nbytes: int) -> None:
    """Sets the per-rank size (bytes) from which all-reduce runs two-shot instead of one-shot.

    Args:
      nbytes: threshold in bytes (>= 0), for the calls that start after this one;
        ``STRATA_TWO_SHOT_BYTES`` sets it at start-up.

    Raises:
      TypeError: if ``nbytes`` is not an integer: a string, a float or a bool is refused
        (``"64K"`` is not read as a size here; give 65536).
      ValueError: if ``nbytes`` is negative.
    """
    native().set_two_shot_bytes(_check_nbytes(nbytes))


def get_two_shot_threshold() -> int:
    """Returns the all-reduce one-shot/two-shot switch point in bytes per rank."""
    return int(native().get_two_shot_bytes())


def set_low_latency_threshold(nbytes: int) -> None:
    """Sets the input size per rank (bytes) up to which calls across processes take the
    low-latency path (data and arrival travel together through shared slots; no barriers).

    Args:
      nbytes: threshold in bytes (>= 0; 0 turns the path off; at most 1 MiB is used);
        ``STRATA_LL_BYTES`` sets it at start-up (default 64 KiB). A communicator (group of
        devices) takes the value of the process that first calls a collective on it and keeps
        it, so every rank of it agrees: set it before the first collective on a group.

    Raises:
      TypeError: if ``nbytes`` is not an integer.
      ValueError: if ``nbytes`` is negative.
    """
    native().set_ll_bytes(_check_nbytes(nbytes))


def get_low_latency_threshold() -> int:
    """Returns the low-latency threshold new communicators get, in bytes per rank."""
    return int(native().get_ll_bytes())


def _collective_errors() -> tuple[type[Exception], ...]:
    from jax.errors import JaxRuntimeError

    return (JaxRuntimeError, ValueError)


COLLECTIVE_ERRORS = _collective_errors()
"""The exceptions a failed strata collective raises: ``except strata_jax.COLLECTIVE_ERRORS:``.

The type is JAX's choice, not strata's: a handler returns an XLA error status (the message
starts with ``DEADLINE_EXCEEDED: strata_jax <op>: timed out ...`` for a timeout and
``INVALID_ARGUMENT: strata_jax <op>: ...`` for ranks that disagree or a peer that died), and
jaxlib turns it into ``jax.errors.JaxRuntimeError`` (a RuntimeError) on the Python dispatch
path (a jitted function's first call, or an error met in ``block_until_ready``/``np.asarray``)
but into ``ValueError`` on its C++ fast path (later calls of a function that already ran once,
where the failing execution raises during dispatch). Measured with jax/jaxlib 0.10.2 and
tested in tests/mp_scripts/call_matching.py. The message is the same either way.
"""
