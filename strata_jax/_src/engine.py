"""JAX's engine between processes: strata's MPI engine (default), gloo, or XLA over a real MPI.

Every cross-process collective XLA:CPU runs -- ``jax.lax`` collectives in ``shard_map`` and
``pmap``, and the all-reduces, all-gathers, reduce-scatters, all-to-alls and collective-permutes
XLA's partitioner inserts into ``jax.jit`` programs with shardings (GSPMD/Shardy) -- goes
through one "CPU collectives" object chosen when JAX creates its backend. With
``jax_cpu_collectives_implementation="mpi"``, jaxlib calls MPI through the MPItrampoline it
carries, which loads the library ``MPITRAMPOLINE_LIB`` names when jaxlib is loaded. strata ships
such a library, ``libstrata_mpi.so`` (native/mpiabi): the MPItrampoline ABI over strata's
shared-memory fabric, with the engine in strata's native extension (one fabric, one matching of
calls with strata's own custom calls). So in a job of several processes:

- ``import strata_jax`` (before jax) points ``MPITRAMPOLINE_LIB`` at ``libstrata_mpi.so``
  (:func:`select_before_jax`), the way mpi4jax's mpibackend4jax points it at MPIwrapper, and
  puts the variable back once jaxlib has loaded it (child processes do not inherit it);
- ``strata_jax.init()`` chooses XLA's MPI collectives, configures the engine's world (this
  process's rank and the job's size) before JAX creates its backend, and, once the fabric is
  connected, gives it every rank's device and process (:func:`before_backend`,
  :func:`after_fabric`).

The choice, in order: ``STRATA_ENGINE`` (``strata``, ``gloo`` or ``mpi``; the launcher's
``--engine`` sets it), else ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``, else
``MPITRAMPOLINE_LIB`` naming an MPI library of the user's (MPIwrapper's: XLA over that MPI when
JAX's collectives are MPI's, gloo otherwise, as without strata), else ``strata``.
strata's engine falls back to gloo, saying why on one stderr line, where it cannot run: jax
imported before strata_jax (MPItrampoline already loaded whatever it found), several devices
per process (XLA's MPI path takes one device per process), processes on several fabrics
(hosts), or the library missing.

This module imports only the standard library at import time: it runs before jax is imported.
"""

from __future__ import annotations

import os
import sys

ENV_ENGINE = "STRATA_ENGINE"
ENV_TRAMPOLINE = "MPITRAMPOLINE_LIB"
ENV_JAX_ENGINE = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
ENGINES = ("strata", "gloo", "mpi")
LIBRARY_NAME = "libstrata_mpi.so"

# engine: "strata" | "gloo" | "mpi" | None (a single process: no engine between processes);
# why: how it was chosen (or why strata's fell back); library: libstrata_mpi.so's path when
# MPItrampoline was pointed at it; fallback: a fallback's reason, printed once by init().
state: dict = {
    "engine": None,
    "why": "",
    "library": None,
    "previous": None,
    "fallback": "",
    "attached": False,
}

_CLUSTER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def library_path() -> str | None:
    """The path of ``libstrata_mpi.so``: next to this package (``pip install``), else next to
    the native extension (an editable install keeps both in site-packages); None if missing."""
    import importlib.util

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidate = os.path.join(pkg, LIBRARY_NAME)
    if os.path.isfile(candidate):
        return candidate
    try:
        spec = importlib.util.find_spec("strata_jax._strata")
    except Exception:  # noqa: BLE001 - an unbuilt source folder
        spec = None
    if spec is not None and spec.origin:
        candidate = os.path.join(os.path.dirname(os.path.realpath(spec.origin)), LIBRARY_NAME)
        if os.path.isfile(candidate):
            return candidate
    return None


def _several_processes(environ) -> bool:
    """Whether this process is one of a job of several: the launcher's rank, or mpirun/srun's."""
    if environ.get("STRATA_COORDINATOR"):
        return True
    for var in _CLUSTER_SIZE_VARS:
        v = environ.get(var, "")
        if v.isdigit() and int(v) > 1:
            return True
    return False


def override(name: str) -> None:
    """``strata_jax.init(engine=...)``: the engine asked for by the program, before
    ``STRATA_ENGINE``. Raises ValueError for an unknown name."""
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    state["override"] = name


def requested(environ=None) -> tuple[str, str]:
    """The engine asked for, and why: ``strata_jax.init(engine=...)``, ``STRATA_ENGINE``, an
    explicit choice of JAX's, or the default (strata's). Raises ValueError for an unknown
    ``STRATA_ENGINE``."""
    if environ is None and state.get("override"):
        return state["override"], f"strata_jax.init(engine={state['override']!r})"
    env = os.environ if environ is None else environ
    v = env.get(ENV_ENGINE, "").strip().lower()
    if v:
        if v not in ENGINES:
            raise ValueError(
                f"{ENV_ENGINE}={env.get(ENV_ENGINE)!r} is not one of {', '.join(ENGINES)} "
                "(strata: strata's engine for XLA's collectives, the default; gloo; mpi: XLA "
                "over the MPI that MPITRAMPOLINE_LIB names)"
            )
        return v, f"{ENV_ENGINE}={v}"
    jax_choice = env.get(ENV_JAX_ENGINE, "").strip().lower()
    if jax_choice == "gloo":
        return "gloo", f"{ENV_JAX_ENGINE}=gloo"
    lib = env.get(ENV_TRAMPOLINE, "")
    if lib and os.path.basename(lib) != LIBRARY_NAME:
        # An MPI of the user's (MPIwrapper's library): XLA over it when JAX's collectives are
        # MPI's, else gloo, as without strata (mpi_engine.py).
        return "mpi", f"{ENV_TRAMPOLINE}={lib}"
    return "strata", "the default"


def select_before_jax() -> None:
    """At ``import strata_jax``, before jax: in a job of several processes whose engine is
    strata's (or wherever ``STRATA_ENGINE=strata`` asks for it: processes that start
    ``jax.distributed`` by hand), points MPItrampoline at ``libstrata_mpi.so``. Does nothing
    in a single process otherwise."""
    explicit = os.environ.get(ENV_ENGINE, "").strip().lower() == "strata"
    if state["engine"] is not None or not (explicit or _several_processes(os.environ)):
        return
    try:
        engine, why = requested()
    except ValueError:
        return  # init() raises it with the same message
    state.update(engine=engine, why=why)
    if engine != "strata":
        return
    if "jaxlib" in sys.modules or "jax" in sys.modules:
        _fall_back(
            "jax was imported before strata_jax, so jaxlib's MPItrampoline had already loaded "
            "its MPI library; import strata_jax before jax to run XLA's collectives on strata"
        )
        return
    lib = library_path()
    if lib is None:
        _fall_back(f"{LIBRARY_NAME} is not installed next to strata_jax (reinstall strata_jax)")
        return
    state["previous"] = os.environ.get(ENV_TRAMPOLINE)
    state["library"] = lib
    os.environ[ENV_TRAMPOLINE] = lib


def _fall_back(reason: str) -> None:
    state.update(engine="gloo", fallback=reason, why=f"strata's engine cannot run: {reason}")


def after_jax_import(native) -> None:
    """Once jaxlib is loaded: restores ``MPITRAMPOLINE_LIB`` (MPItrampoline read it already)
    and attaches strata's engine to the library jaxlib loaded."""
    lib = state["library"]
    if lib is None:
        return
    if os.environ.get(ENV_TRAMPOLINE) == lib:
        if state["previous"] is None:
            os.environ.pop(ENV_TRAMPOLINE, None)
        else:
            os.environ[ENV_TRAMPOLINE] = state["previous"]
    ok, why = native.mpi_engine_attach(lib)
    state["attached"] = bool(ok)
    if not ok:
        state["library"] = None
        _fall_back(f"{LIBRARY_NAME} could not take strata's engine: {why}")


def active() -> bool:
    """Whether XLA's collectives run on strata's engine (chosen, and not fallen back)."""
    return state["engine"] == "strata" and state["attached"]


def choose(local_devices: int) -> str:
    """init()'s choice before JAX creates its backend: ``"strata"``, ``"gloo"`` or ``"mpi"``.

    Sets ``jax_cpu_collectives_implementation`` for strata's and gloo; for ``"mpi"`` (a real
    MPI of the user's) the caller keeps its own path (mpi_engine.py). ``local_devices``: CPU
    devices per process.
    """
    import jax

    engine, why = requested()  # raises ValueError for a bad STRATA_ENGINE
    if engine == "mpi" and state["engine"] == "strata" and state["library"]:
        # MPITRAMPOLINE_LIB pointed at strata's library: there is no other MPI to run over.
        engine, why = "strata", why + f" ({ENV_TRAMPOLINE} names strata's library)"
    if engine == "strata" and state["engine"] == "gloo" and state["fallback"]:
        engine = "gloo"
    elif engine == "strata" and not active():
        _fall_back(
            f"{LIBRARY_NAME} was not loaded by jaxlib (MPITRAMPOLINE_LIB was not pointed at it "
            "when jax was imported)"
        )
        engine = "gloo"
    if engine == "strata" and local_devices > 1:
        _fall_back(
            f"{local_devices} devices per process: XLA's MPI collectives, which strata's engine "
            "runs, take one device per process (XLA opens one MPI communicator per process)"
        )
        engine = "gloo"
    if engine in ("strata", "gloo"):
        impl = "mpi" if engine == "strata" else "gloo"
        jax.config.update("jax_cpu_collectives_implementation", impl)
    state["engine"] = engine
    if engine != "gloo" or not state["fallback"]:
        state["why"] = why
    return engine


def fall_back_before_backend(reason: str) -> None:
    """Switches JAX to gloo before its backend exists (strata's engine cannot run this job)."""
    import jax

    _fall_back(reason)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def say_fallback() -> None:
    """One stderr line when strata's engine fell back to gloo (printed by init() in process 0)
    where the user would not expect it: strata's engine asked for by name (``STRATA_ENGINE`` or
    the launcher's ``--engine strata``), or jax imported before strata_jax. The default's fall
    backs for several devices per process or several hosts are said by :func:`engine_info`
    and :func:`strata_jax.coverage` instead."""
    explicit = os.environ.get(ENV_ENGINE, "").strip().lower() == "strata"
    if state["fallback"] and (explicit or state["fallback"].startswith("jax was imported")):
        print(
            f"strata_jax: XLA's collectives between processes run over gloo, not strata's engine: "
            f"{state['fallback']}",
            file=sys.stderr,
            flush=True,
        )


def before_backend(native, process_id: int, num_processes: int) -> None:
    """Configures the engine's world before JAX creates its backend (MPI_Init_thread)."""
    native.mpi_engine_configure(process_id, num_processes)


def after_fabric(native, devices: list[int], procs: list[int]) -> None:
    """Gives the engine each rank's global device id and process index in this fabric."""
    native.mpi_engine_set_world(devices, procs)


def describe() -> dict:
    """What :func:`strata_jax.engine_info` returns (see there)."""
    return {
        "engine": state["engine"],
        "why": state["why"],
        "fallback": state["fallback"] or None,
        "library": state["library"],
    }


# What XLA:CPU refuses on its MPI path before calling MPI (measured, jax 0.10.2): reductions
# and all-gathers of float16 and of the float8 types (computed in float16). all_to_all and
# ppermute move bytes and pass; bfloat16 reductions are promoted to float32 by XLA first.
_REFUSED_PRIMITIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "unreduced_psum",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "all_gather_reduced",
        "reduce_scatter",
        "unreduced_reduce_scatter",
    }
)


def reroutes(primitive: str, dtype) -> bool:
    """Whether a ``jax.lax`` collective inside ``shard_map``/``pmap`` goes to strata's custom call
    although ``use_for_jax_lax()`` is off: with strata's engine running XLA's collectives, those
    XLA's MPI path refuses (float16 and float8 reductions and all-gathers) would fail where gloo
    runs them; strata's custom calls run them (lax_compat.py calls this)."""
    if not active() or primitive not in _REFUSED_PRIMITIVES:
        return False
    import numpy as np

    name = np.dtype(dtype).name
    return name == "float16" or name.startswith("float8")
