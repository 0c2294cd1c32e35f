"""strata_jax: fabric-native collectives and MoE dispatch/combine for JAX.

Drop-in replacements for ``jax.lax`` collectives, implemented as XLA FFI custom calls that
read and write the participants' own buffers (StrataCL, Hu et al. 2026). Import strata_jax
before JAX creates its CPU backend (it sizes XLA's launch thread pool; see
``strata_jax._src.runtime.configure_launch_threads``).
"""

from strata_jax._src import runtime as _runtime

_runtime.configure_launch_threads()

from strata_jax import moe  # noqa: E402
from strata_jax._src.collectives import (  # noqa: E402
    all_gather,
    all_to_all,
    pbroadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from strata_jax._src.fabric import init, memory_stats  # noqa: E402
from strata_jax._src.ragged import ragged_all_to_all  # noqa: E402
from strata_jax._src.runtime import (  # noqa: E402
    COLLECTIVE_ERRORS,
    comm_stats,
    get_timeout,
    get_two_shot_threshold,
    set_timeout,
    set_two_shot_threshold,
)
from strata_jax._src.topology import topology  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
    "ragged_all_to_all",
    "set_timeout",
    "get_timeout",
    "set_two_shot_threshold",
    "get_two_shot_threshold",
    "comm_stats",
    "COLLECTIVE_ERRORS",
    "init",
    "memory_stats",
    "topology",
    "moe",
]
