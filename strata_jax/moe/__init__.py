"""Expert-parallel MoE token routing over strata's fabric (DeepEP-style dispatch/combine).

See :mod:`strata_jax.moe._dispatch` for the algorithm and semantics.
"""

from strata_jax.moe._dispatch import (
    LowLatencyHandle,
    MoELayout,
    combine,
    dispatch,
    dispatch_layout,
    low_latency_combine,
    low_latency_dispatch,
)
from strata_jax.moe._layer import expert_mlp, moe_mlp

__all__ = [
    "MoELayout",
    "dispatch",
    "dispatch_layout",
    "combine",
    "moe_mlp",
    "expert_mlp",
    "LowLatencyHandle",
    "low_latency_dispatch",
    "low_latency_combine",
]
