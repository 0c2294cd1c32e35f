"""Native module loading, FFI target registration and process-wide settings.

Importing strata_jax must happen before JAX creates its CPU backend: XLA's CPU client sizes
its launch thread pool then (see ``configure_launch_threads``).
"""

from __future__ import annotations

import os
import re
import warnings

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

    XLA CPU gang-schedules every multi-device launch: a launch needs all N devices' threads of
    the "XLAPjRtCpuClient" pool at once, and each launch also takes a per-device in-flight slot
    (32) *on a pool thread*. When Python runs ~33 launches ahead, one pool thread blocks on
    that semaphore and the oldest launch gets only N-1 threads: every participant of a
    collective waits for the missing one and XLA aborts ("only 7 of 8 arrived"). The pool has
    ``max(PJRT_NPROC, N)`` threads; with at least 2N threads the blocked semaphore waiter can
    no longer starve a launch (measured in ../shared/DESIGN.md: 20 of 20 runs of 1000 chained
    calls on 8 devices). No handler-side fix exists, so strata sets PJRT_NPROC here, before the
    backend is created, unless the user already chose a value.
    """
    want = max(_MIN_LAUNCH_THREADS, 2 * _requested_cpu_devices())
    cur = os.environ.get("PJRT_NPROC")
    if cur is None:
        if _backend_initialized():
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


def _backend_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # pragma: no cover - private API moved
        return False


_native = None


def native():
    """The loaded ``strata_jax._strata`` extension, with its FFI targets registered."""
    global _native
    if _native is None:
        import jax

        from strata_jax import _strata

        for name, capsule in _strata.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
        _native = _strata
    return _native


def set_timeout(seconds: float) -> None:
    """Sets how long a collective waits for its peers before failing.

    Args:
      seconds: timeout in seconds (> 0). Default 300, or ``STRATA_TIMEOUT_S``.

    Raises:
      ValueError: if ``seconds`` is not positive.

    A collective that times out raises one of :data:`COLLECTIVE_ERRORS` naming the operation,
    the missing ranks and the phase it was in; it never hangs forever.
    """
    if not seconds > 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds!r}")
    native().set_timeout(float(seconds))


def get_timeout() -> float:
    """Returns the collective timeout in seconds."""
    return float(native().get_timeout())


def set_two_shot_threshold(nbytes: int) -> None:
    """Sets the per-rank size (bytes) from which all-reduce runs two-shot instead of one-shot.

    Args:
      nbytes: threshold in bytes (>= 0); ``STRATA_TWO_SHOT_BYTES`` sets it at start-up.
        Takes effect for calls that start after it.
    """
    if nbytes < 0:
        raise ValueError(f"threshold must be >= 0 bytes, got {nbytes}")
    native().set_two_shot_bytes(int(nbytes))


def get_two_shot_threshold() -> int:
    """Returns the all-reduce one-shot/two-shot switch point in bytes per rank."""
    return int(native().get_two_shot_bytes())


def comm_stats() -> dict[str, int]:
    """Process-wide communication counters.

    Returns:
      dict with ``calls`` (collective calls, counted per rank), ``zero_copy_bytes`` (bytes
      read straight from peers' buffers), ``staged_bytes`` (bytes copied through a bounce
      buffer), ``one_shot_all_reduce``/``two_shot_all_reduce`` (algorithm choices) and
      ``timeouts``.
    """
    return dict(native().comm_stats())


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
