"""Expert-parallel MoE token routing over strata's fabric (DeepEP-style dispatch/combine).

The normal mode (training, prefill) is :mod:`strata_jax.moe._dispatch`, the low-latency mode
(decode) :mod:`strata_jax.moe._low_latency`: each opens with its algorithm and semantics.
"""

from strata_jax.moe._dispatch import MoELayout, combine, dispatch, dispatch_layout
from strata_jax.moe._layer import expert_mlp, moe_mlp
from strata_jax.moe._low_latency import (
    LowLatencyHandle,
    low_latency_combine,
    low_latency_dispatch,
)

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
