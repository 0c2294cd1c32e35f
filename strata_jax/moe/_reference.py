"""Pure-JAX reference of MoE dispatch/combine: the semantics of ``strata_jax.moe``, slowly.

Same signatures and semantics as ``strata_jax.moe.dispatch`` / ``combine``, written
with ``jax.lax`` collectives and scatter/gather only. Two uses:

* a test oracle for the native implementation and for :func:`strata_jax.moe._layer.moe_mlp`;
* a stand-in (``moe_mlp(..., impl="reference")``) where the native operators are missing.

It moves far more bytes than it must (every rank receives every expert's whole output in
:func:`combine`), so never time it as "strata".

Semantics (inside ``jax.shard_map`` over ``axis_name`` of size R):

* expert ``e`` lives on rank ``e // E_local`` with ``E_local = num_experts // R``;
* a token that names an expert several times in its top-k row occupies *one* row of that
  expert (and is counted once against its capacity); :func:`combine` gives it the sum of the
  weights of all its slots naming that expert;
* the rows of an expert are filled in (source rank, source token index) order over all source
  ranks; ``capacity`` C is per expert over all source ranks (``None``: ``R * T``, nothing is
  ever dropped); a (token, expert) pair whose position is ``>= C`` is dropped;
* ``-1`` in ``topk_idx`` means "no expert"; such slots and dropped pairs contribute zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

AxisName = Any

__all__ = ["DispatchLayout", "dispatch", "combine", "dispatch_layout"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """What :func:`dispatch` tells :func:`combine`, plus counts for the caller.

    The count fields have the names of ``strata_jax.moe.MoELayout``'s; the rest differ.

    Attributes:
      topk_idx: [T, K] int32, the routing given to dispatch.
      positions: [T, K] int32, row of slot (t, k) in its expert's buffer; -1 where the slot is
        -1 or the pair was dropped.
      recv_counts: [E_local] int32, rows filled in each local expert's buffer (<= capacity).
      recv_dropped: [E_local] int32, (token, expert) pairs routed to each local expert that
        did not fit in the capacity.
      dropped: [] int32, ``recv_dropped.sum()`` (psum it over the axis for the global count).
      num_experts, axis_name, capacity: static; ``capacity`` is the resolved C.
    """

    topk_idx: jax.Array
    positions: jax.Array
    recv_counts: jax.Array
    recv_dropped: jax.Array
    dropped: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    axis_name: AxisName = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))


def _check(
    x_shape: tuple[int, ...] | None, topk_idx: jax.Array, num_experts: int, nranks: int
) -> None:
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {topk_idx.shape}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must be an integer array, got {topk_idx.dtype}")
    if x_shape is not None and (len(x_shape) != 2 or x_shape[0] != topk_idx.shape[0]):
        raise ValueError(
            f"x must be [T, H] with T = topk_idx.shape[0] = {topk_idx.shape[0]}, got {x_shape}"
        )
    if num_experts <= 0 or num_experts % nranks:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the axis size {nranks}"
        )


def sanitize_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """[..., K] int32 expert ids: ids outside [0, num_experts) become -1.

    Compared in the ids' own integer dtype before the cast, so an int64 id such as 2**32 + 1
    (with jax_enable_x64) is "no expert", not expert 1 after wrapping to int32.
    """
    idx = jnp.asarray(topk_idx)
    info = jnp.iinfo(idx.dtype)
    valid = idx >= 0 if info.min < 0 else jnp.ones(idx.shape, bool)
    if num_experts <= info.max:  # else every non-negative id of this dtype is below it
        valid = valid & (idx < num_experts)
    return jnp.where(valid, idx.astype(jnp.int32), -1)


def _membership(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """[T, E] bool "token t routes to e" and [T, K] bool "slot k is e's first mention"."""
    idx = sanitize_ids(topk_idx, num_experts)
    k = idx.shape[1]
    member = (idx[:, :, None] == jnp.arange(num_experts, dtype=jnp.int32)).any(axis=1)
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # earlier[k, j]: j < k
    dup = ((idx[:, :, None] == idx[:, None, :]) & earlier).any(axis=2)
    return member, (idx >= 0) & ~dup


def dispatch_layout(topk_idx: jax.Array, num_experts: int, axis_name: AxisName):
    """Routing statistics (DeepEP's names), without moving any token.

    Args:
      topk_idx: [T, K] int global expert ids or -1.
      num_experts: E, a multiple of the axis size R.
      axis_name: the expert-parallel mesh axis.

    Returns:
      ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
      is_token_in_rank [T, R] bool)`` for this rank's tokens; duplicates count once.
    """
    nranks = jax.lax.axis_size(axis_name)
    _check(None, topk_idx, num_experts, nranks)
    member, _ = _membership(topk_idx, num_experts)
    per_expert = member.sum(0, dtype=jnp.int32)
    in_rank = member.reshape(member.shape[0], nranks, -1).any(axis=2)
    return in_rank.sum(0, dtype=jnp.int32), per_expert, in_rank


def dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    num_experts: int,
    axis_name: AxisName,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchLayout]:
    """Sends each token to the ranks of its experts (reference implementation).

    Args:
      x: [T, H] this rank's tokens, any float dtype.
      topk_idx: [T, K] int global expert ids in [0, num_experts) or -1.
      num_experts: E, a multiple of the axis size R.
      axis_name: the expert-parallel mesh axis (inside ``jax.shard_map``).
      capacity: rows per expert C (static, equal on all ranks); None = ``R * T``.

    Returns:
      ``recv_x`` [E_local, C, H] of x's dtype (rows in (source rank, token) order, unused
      rows zero) and a :class:`DispatchLayout`.

    Raises:
      ValueError / TypeError: bad shapes, dtypes, num_experts or capacity.
    """
    nranks = jax.lax.axis_size(axis_name)
    _check(x.shape, topk_idx, num_experts, nranks)
    t, h = x.shape
    e_local = num_experts // nranks
    cap = nranks * t if capacity is None else int(capacity)
    if cap < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    idx = sanitize_ids(topk_idx, num_experts)
    member, first = _membership(idx, num_experts)

    # Position of every (token, expert) pair in the expert's queue over all source ranks.
    every = jax.lax.all_gather(member.astype(jnp.int32), axis_name)  # [R, T, E]
    flat = every.reshape(nranks * t, num_experts)
    pos_all = jnp.cumsum(flat, axis=0, dtype=jnp.int32) - flat
    rank = jax.lax.axis_index(axis_name)
    my_pos = jax.lax.dynamic_slice_in_dim(pos_all, rank * t, t, axis=0)  # [T, E]
    keep = member & (my_pos < cap)

    safe = jnp.maximum(idx, 0)
    slot_pos = jnp.take_along_axis(my_pos, safe, axis=1)
    slot_keep = (idx >= 0) & jnp.take_along_axis(keep, safe, axis=1)
    positions = jnp.where(slot_keep, slot_pos, -1)

    # Scatter each kept pair once (first mention) into an [E, C, H] buffer, then reduce the
    # buffers of all ranks onto the experts' owners: rows are disjoint, so the sum is exact.
    dest = jnp.where(slot_keep & first, safe * cap + slot_pos, num_experts * cap)
    rows = jnp.broadcast_to(x[:, None, :], (t, idx.shape[1], h)).reshape(-1, h)
    if cap == 0:  # nothing fits (and the transpose of a scatter into 0 rows is a bad gather)
        recv = jnp.zeros((e_local, 0, h), x.dtype) + x[:0].sum(0)  # varying like x
    else:
        send = jnp.zeros((num_experts * cap, h), x.dtype)
        send = send.at[dest.reshape(-1)].add(rows, mode="drop")
        recv = jax.lax.psum_scatter(
            send.reshape(num_experts, cap, h), axis_name, scatter_dimension=0, tiled=True
        )

    counts = flat.sum(0)  # [E]
    mine = jax.lax.dynamic_slice_in_dim(counts, rank * e_local, e_local)
    layout = DispatchLayout(
        topk_idx=idx,
        positions=positions,
        recv_counts=jnp.minimum(mine, cap).astype(jnp.int32),
        recv_dropped=jnp.maximum(mine - cap, 0).astype(jnp.int32),
        dropped=jnp.maximum(mine - cap, 0).sum().astype(jnp.int32),
        num_experts=num_experts,
        axis_name=axis_name,
        capacity=cap,
    )
    return recv, layout


def combine(expert_y: jax.Array, layout: DispatchLayout, topk_weights: jax.Array) -> jax.Array:
    """Brings expert outputs back to their tokens and sums them with the top-k weights.

    Args:
      expert_y: [E_local, C, H] expert outputs, rows as :func:`dispatch` laid them out.
      layout: the :class:`DispatchLayout` of the matching dispatch.
      topk_weights: [T, K] float weights.

    Returns:
      y [T, H] of expert_y's dtype: ``y[t] = sum_k w[t, k] * row(t, topk_idx[t, k])``;
      -1 slots and dropped pairs contribute zero. Accumulates in float32 (or wider).

    Raises:
      ValueError: shapes inconsistent with the layout.
    """
    idx, pos = layout.topk_idx, layout.positions
    if topk_weights.shape != idx.shape:
        raise ValueError(f"topk_weights must be {idx.shape}, got {topk_weights.shape}")
    nranks = jax.lax.axis_size(layout.axis_name)
    e_local = layout.num_experts // nranks
    if expert_y.ndim != 3 or expert_y.shape[:2] != (e_local, layout.capacity):
        raise ValueError(
            f"expert_y must be [E_local={e_local}, C={layout.capacity}, H], got {expert_y.shape}"
        )
    full = jax.lax.all_gather(expert_y, layout.axis_name, axis=0, tiled=True)  # [E, C, H]
    # Row C of every expert is a zero row: -1 slots and dropped pairs read it (C may be 0).
    full = jnp.pad(full, ((0, 0), (0, 1), (0, 0)))
    cap = layout.capacity
    rows = full[jnp.maximum(idx, 0), jnp.where(pos >= 0, pos, cap)]  # [T, K, H]
    acc = jnp.promote_types(expert_y.dtype, jnp.float32)
    w = jnp.where(pos >= 0, topk_weights, 0).astype(acc)
    return jnp.einsum("tk,tkh->th", w, rows.astype(acc)).astype(expert_y.dtype)


def default_capacity(num_tokens: int, nranks: int) -> int:
    """The capacity :func:`dispatch` uses for ``capacity=None``: ``R * T``."""
    return nranks * num_tokens


def capacity_from_factor(
    factor: float, num_tokens: int, nranks: int, num_experts: int, top_k: int
) -> int:
    """``ceil(factor * R * T * K / E)``: rows per expert for a capacity factor."""
    return max(1, math.ceil(factor * nranks * num_tokens * top_k / num_experts))
