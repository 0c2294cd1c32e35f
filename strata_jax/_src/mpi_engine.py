"""XLA's MPI collectives as JAX's engine between processes: what XLA needs to run at all.

``jax_cpu_collectives_implementation="mpi"`` makes XLA's CPU collectives (``jax.lax`` across
processes, and the steps of strata's hierarchical collectives that cross fabrics) run over MPI,
loaded through MPItrampoline from the ``libmpiwrapper.so`` that ``MPITRAMPOLINE_LIB`` names. Out
of the box (jax/jaxlib 0.10.2) two things break, and ``strata_jax.init()`` fixes both when it
creates the backend (under mpirun, before any other use of jax):

1. Every XLA collective fails with "MPI: Communicator requested from a thread that is not the
   one MPI was initialized from". XLA initialises MPI (``MPI_THREAD_FUNNELED``) on the thread that
   creates the CPU backend and refuses to make a communicator on any other thread
   (``MPI_Is_thread_main``); with async dispatch a program runs on one of XLA's pool threads.
   With ``jax_cpu_enable_async_dispatch=False`` a one-device program runs on the thread that
   calls it, the Python main thread, which is MPI's main thread: no ``MPI_THREAD_MULTIPLE`` and
   no shim over ``MPI_Init_thread`` is needed (measured: jax.lax psum/all_gather/all_to_all/
   ppermute over 2 and 4 processes). ``init()`` sets it before the backend exists.
2. Every process aborts at exit: "The MPI_Comm_free() function was called after MPI_FINALIZE".
   JAX registers ``MPI_Finalize`` with Python's ``atexit`` when it creates the backend; atexit
   functions run before the interpreter releases the CPU client, whose communicators are freed
   afterwards. ``init()`` creates the backend itself, keeps that atexit registration back and
   finalises MPI from ``Py_AtExit`` instead (the extension's ``finalize_mpi_at_exit``), which
   runs after the interpreter has released everything it will release.

Nothing here runs unless the engine is ``mpi``.
"""

from __future__ import annotations

import os
import sys

ENV_TRAMPOLINE = "MPITRAMPOLINE_LIB"

state: dict = {"finalize": None}  # "py_atexit" | "xla" (JAX's own, aborts at exit) | None


def selected() -> bool:
    """Whether JAX's CPU collectives are XLA's MPI ones (config or JAX_CPU_COLLECTIVES_...)."""
    import jax

    return jax.config.jax_cpu_collectives_implementation == "mpi"


def async_dispatch() -> bool:
    """The value of ``jax_cpu_enable_async_dispatch`` (a flag jax.config has no attribute for)."""
    from strata_jax._src import jax_compat

    return jax_compat.cpu_async_dispatch()


def configure_before_backend() -> None:
    """Settings XLA's MPI collectives need before JAX creates its CPU backend.

    Raises:
      RuntimeError: ``MPITRAMPOLINE_LIB`` is unset or names no file (MPItrampoline would abort
        the process with a less helpful message when the backend is created).
    """
    import jax

    lib = os.environ.get(ENV_TRAMPOLINE, "")
    if not lib or not os.path.isfile(lib):
        raise RuntimeError(
            "jax_cpu_collectives_implementation is 'mpi', but MPITRAMPOLINE_LIB "
            + (f"names no file ({lib!r})" if lib else "is not set")
            + ": XLA loads MPI through MPItrampoline, which needs MPITRAMPOLINE_LIB set to a "
            "libmpiwrapper.so built from MPIwrapper against this machine's MPI (and passed to "
            "every rank, e.g. `mpirun -x MPITRAMPOLINE_LIB`); see docs/guide/hosts.md"
        )
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def create_backend() -> None:
    """Creates JAX's CPU backend with MPI finalised after the interpreter (see the module doc).

    A backend that already exists is left alone; if it was made with async dispatch on, XLA's
    collectives will fail on their thread check, which one stderr line says here.
    """
    import atexit

    import jax

    from strata_jax._src import runtime

    if runtime._backend_initialized():
        if async_dispatch():
            print(
                "strata_jax: XLA's MPI collectives need jax_cpu_enable_async_dispatch=False "
                "before JAX creates its backend, which already exists: every jax.lax "
                "collective across processes will fail ('Communicator requested from a thread "
                "that is not the one MPI was initialized from'). Fix: call strata_jax.init() "
                "before any other use of jax.",
                file=sys.stderr,
                flush=True,
            )
        return
    from strata_jax._src import jax_compat

    with jax_compat.held_back_atexit("Finalize") as held:
        jax.devices()
    if not held:
        return
    if runtime.native().finalize_mpi_at_exit(os.environ.get(ENV_TRAMPOLINE, "")):
        state["finalize"] = "py_atexit"
    else:  # MPIwrapper not found in the process: keep JAX's own finalisation
        for fn in held:
            atexit.register(fn)
        state["finalize"] = "xla"
