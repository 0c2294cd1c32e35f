"""What the MoE primitives of both modes share (``_dispatch.py``, ``_low_latency.py``): the checks
of the routing and combine inputs, the result types, and the lowering to the native call (or, for
an expert axis that spans fabrics, to the hierarchical form).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from strata_jax._src import hierarchy, lowering

FLOATS = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


def check_routing(name: str, axes: tuple, num_experts: int, topk_idx, x=None):
    """Checks ``axes``, ``num_experts`` against the axis size R, ``topk_idx`` [T, K] and (when
    given) ``x`` [T, H] of ``strata_jax.moe.<name>``; returns R. ValueError saying what to
    change."""
    lowering.check_axis_names(axes, f"moe.{name}")
    r = lowering.axis_size(axes)
    if not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
        raise ValueError(
            f"strata_jax.moe.{name}: num_experts must be a positive int, got {num_experts!r}."
        )
    if num_experts % r:
        raise ValueError(
            f"strata_jax.moe.{name}: num_experts={num_experts} is not divisible "
            f"by the size {r} of axis {axes}; every rank must hold the same "
            "number of experts."
        )
    if topk_idx.ndim != 2 or not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(
            f"strata_jax.moe.{name}: topk_idx must be an integer array [T, K], "
            f"got {topk_idx.dtype}{list(topk_idx.shape)}."
        )
    if x is not None:
        if x.ndim != 2 or x.dtype not in [jnp.dtype(d) for d in FLOATS]:
            raise ValueError(
                f"strata_jax.moe.{name}: x must be a float32/float64/bfloat16/"
                f"float16 array [T, H], got {x.dtype}{list(x.shape)}."
            )
        if x.shape[0] != topk_idx.shape[0]:
            raise ValueError(
                f"strata_jax.moe.{name}: x has {x.shape[0]} tokens but topk_idx "
                f"has {topk_idx.shape[0]}."
            )
    return r


def check_combine(
    name: str,
    handle,
    handle_type: type,
    made_by: str,
    rows: Callable[[int], int],
    rows_text: str,
    expert_y,
    topk_weights,
):
    """Checks the inputs of ``strata_jax.moe.<name>`` (a combine): ``handle`` the
    ``handle_type`` that ``strata_jax.moe.<made_by>`` returned, ``expert_y`` [E_local, rows(R),
    H] in a float dtype (``rows_text`` names the second size in the error), and
    ``topk_weights`` floats shaped like the handle's ``topk_idx``. Returns (axes, expert_y,
    topk_weights), the two as arrays; ValueError saying what to change."""
    if not isinstance(handle, handle_type):
        arg = "layout" if made_by == "dispatch" else "handle"
        raise ValueError(
            f"strata_jax.moe.{name}: {arg} must be the {handle_type.__name__} returned by "
            f"strata_jax.moe.{made_by}, got {type(handle).__name__}."
        )
    axis_name, num_experts, topk_idx = handle.axis_name, handle.num_experts, handle.topk_idx
    axes = lowering.axis_tuple(axis_name)
    lowering.check_axis_names(axes, f"moe.{name}")
    expert_y = jnp.asarray(expert_y)
    topk_weights = jnp.asarray(topk_weights)
    r = lowering.axis_size(axes)
    t, k = topk_idx.shape
    want = (num_experts // r, rows(r))
    if expert_y.ndim != 3 or tuple(expert_y.shape[:2]) != want:
        raise ValueError(
            f"strata_jax.moe.{name}: expert_y must have shape "
            f"[{want[0]}, {want[1]}, H] (E_local, {rows_text}), got "
            f"{list(expert_y.shape)}."
        )
    if expert_y.dtype not in [jnp.dtype(d) for d in FLOATS]:
        raise ValueError(
            f"strata_jax.moe.{name}: expert_y must be float32/float64/bfloat16/"
            f"float16, got {expert_y.dtype}."
        )
    if topk_weights.shape != (t, k) or not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise ValueError(
            f"strata_jax.moe.{name}: topk_weights must be a float array "
            f"[{t}, {k}] like topk_idx, got {topk_weights.dtype}"
            f"{list(topk_weights.shape)}."
        )
    return axes, expert_y, topk_weights


def out_aval(like, shape, dtype, operands, axes):
    """The aval of a result of ``shape`` and ``dtype``, varying over ``axes`` and every axis its
    ``operands`` vary over (under check_vma)."""
    aval = like.update(shape=tuple(shape), dtype=jnp.dtype(dtype))
    if not lowering.vma_on():
        return aval
    vma = frozenset(axes).union(*(o.mat.varying for o in operands))
    return aval.update(manual_axis_type=aval.mat.update(varying=vma))


def lower(target: str, api: str):
    """The CPU lowering rule of an MoE primitive: native ``target`` over the groups of ``axes``
    (``api`` names it in errors), hierarchical when the axis spans fabrics."""

    def rule(ctx, *args, axes, **attrs):
        # An expert axis that spans fabric domains: hierarchical collectives (hierarchy/).
        split = hierarchy.lower_moe_across_fabrics(ctx, target, args, axes, attrs)
        if split is not None:
            return split
        return lowering.lower_strata_call(
            ctx, target, api, args, lowering.mesh_groups(ctx, axes, api), **attrs
        )

    return rule


def acc_dtype(dtype):
    """Accumulator (and weight) dtype of rows of `dtype`: float64 for float64, else float32."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32
