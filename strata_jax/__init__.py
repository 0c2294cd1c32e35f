"""strata_jax: fabric-native collectives and MoE dispatch/combine for JAX.

Drop-in replacements for ``jax.lax`` collectives, implemented as XLA FFI custom calls that
read and write the participants' own buffers (StrataCL, Hu et al. 2026). Import strata_jax
before JAX creates its CPU backend (it sizes XLA's launch thread pool; see
``strata_jax._src.runtime.configure_launch_threads``).
"""


def _installed_copy_if_unbuilt():
    """The installed strata_jax when this package is an unbuilt source folder, else None.

    ``python -m pytest``, ``python -m strata_jax.launch`` and ``python script.py`` run from the
    repository root put the root first on ``sys.path``, so Python finds the source folder, which
    has no native extension after a plain ``pip install .``. Then the installed package (found on
    the rest of ``sys.path``) is loaded in its place and replaces this module in ``sys.modules``
    (Python's import returns that entry). An editable install or an in-place build has the
    extension, so nothing changes there. Without any built copy: one ImportError saying what to
    run.
    """
    import importlib.machinery
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec(f"{__name__}._strata") is not None:
        return None  # built in place, installed, or an editable install's redirect
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, rest)
    if spec is None or spec.origin is None or os.path.dirname(spec.origin) == here:
        raise ImportError(
            f"strata_jax's native extension (strata_jax._strata) is not built: {here} is a "
            "source folder without a build and no installed strata_jax was found. Run "
            '`pip install ".[test]"` (a normal install; running from the repository root then '
            'uses it automatically), or `pip install --no-build-isolation -e ".[test]"` for '
            "development (see docs/contributing.md)."
        )
    installed = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = installed
    spec.loader.exec_module(installed)
    return installed


def _check_mpitrampoline_lib() -> None:
    """An ImportError naming ``MPITRAMPOLINE_LIB`` when it is a path to no file.

    jaxlib carries MPItrampoline, which dlopens that library as soon as jaxlib is loaded and,
    when it cannot, prints "MPItrampoline: Could not dlopen library" and ends the process
    (exit code 1) inside ``import jax``: no Python error, and neither ``init()`` nor
    ``python -m strata_jax.launch --engine mpi`` would get to say what to change. A value without
    a "/" is searched by the dynamic loader and left to it.
    """
    import os

    lib = os.environ.get("MPITRAMPOLINE_LIB", "")
    if "/" in lib and not os.path.isfile(lib):
        raise ImportError(
            f"MPITRAMPOLINE_LIB={lib!r} is no file: jaxlib's MPItrampoline loads it when jax is "
            "imported and would end this process. Set it to a libmpiwrapper.so built from "
            "MPIwrapper against this machine's MPI, or unset it (docs/guide/hosts.md, XLA over "
            "MPI)."
        )


_check_mpitrampoline_lib()

# What follows then runs against the installed copy (it is sys.modules["strata_jax"] now) and
# only fills this discarded module object.
_installed = _installed_copy_if_unbuilt()

from strata_jax._src import runtime as _runtime  # noqa: E402

_runtime.configure_launch_threads()

from strata_jax._src import allocator as _allocator  # noqa: E402

_allocator.install()  # the pool serves XLA's buffers under any launcher (see allocator.py)

from strata_jax import moe  # noqa: E402
from strata_jax._src import combiner as _combiner  # noqa: E402, F401  (hooks shard_map)
from strata_jax._src import jax_compat as _jax_compat  # noqa: E402
from strata_jax._src.collectives import (  # noqa: E402
    all_gather,
    all_to_all,
    pbroadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    pprod,
    psum,
    psum_scatter,
)
from strata_jax._src.coverage import ProgramCoverage, coverage  # noqa: E402
from strata_jax._src.lax_hooks import disable, enable, use_for_jax_lax  # noqa: E402
from strata_jax._src.ragged import empty, ragged_all_to_all  # noqa: E402
from strata_jax._src.runtime import (  # noqa: E402
    COLLECTIVE_ERRORS,
    get_low_latency_threshold,
    get_timeout,
    get_two_shot_threshold,
    set_low_latency_threshold,
    set_timeout,
    set_two_shot_threshold,
)
from strata_jax._src.startup import init  # noqa: E402
from strata_jax._src.stats import comm_stats, memory_stats, reset_stats  # noqa: E402
from strata_jax._src.topology import topology  # noqa: E402

_jax_compat.warn_if_untested()  # one warning on a JAX newer than the tested range

from strata_jax._src import extension as _extension  # noqa: E402

_extension.check_installed()  # a build for a newer jaxlib's FFI API fails here, with the fix

__version__ = "0.2.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pprod",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
    "ragged_all_to_all",
    "empty",
    "set_timeout",
    "get_timeout",
    "set_two_shot_threshold",
    "get_two_shot_threshold",
    "set_low_latency_threshold",
    "get_low_latency_threshold",
    "comm_stats",
    "coverage",
    "ProgramCoverage",
    "COLLECTIVE_ERRORS",
    "reset_stats",
    "init",
    "memory_stats",
    "topology",
    "moe",
    "use_for_jax_lax",
    "enable",
    "disable",
]
