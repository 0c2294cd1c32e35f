"""The sort/gather MoE pipeline over ``jax.lax.all_to_all`` ("xla-gather", "xla_sort").

What JAX MoE code does on hardware without ragged collectives: every (token, expert) pair gets
a slot in a capacity-padded block ``[E, C_src, H]`` per source rank (its position among this
rank's tokens routed to that expert, in token order; pairs past ``C_src`` are dropped, the
GShard per-source rule), the rows are *gathered* into the blocks by index (no one-hot einsum),
``jax.lax.all_to_all`` moves block ``[E_local, C_src, H]`` of every destination rank there,
and back after the experts, and each token gathers its K expert rows and sums them with its
routing weights. Shared by ``moe_mlp(impl="xla_sort")`` and ``benchmarks/moe.py``'s
``xla-gather`` pipeline, so the benchmark and the training baseline are one code.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

AxisName = Any

__all__ = [
    "slots",
    "gather_blocks",
    "to_experts",
    "from_experts",
    "combine_rows",
    "counts_to_experts",
]


def slots(topk_idx: jax.Array, num_experts: int, c_src: int) -> tuple[jax.Array, jax.Array]:
    """Slot plan of one source rank.

    Args:
      topk_idx: [T, K] int expert ids, distinct per token (a softmax top-k).
      num_experts: E.
      c_src: slots per expert in this rank's block.

    Returns:
      ``(flat, src)``: flat [T, K] int32, the slot ``e * c_src + position`` of each pair or
      -1 when dropped (position >= c_src); src [E * c_src] int32, the token in each slot, or
      T for an empty slot.
    """
    t = topk_idx.shape[0]
    onehot = jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.int32).sum(1)  # [T, E]
    pos = jnp.cumsum(onehot, axis=0) - onehot
    keep = (onehot > 0) & (pos < c_src)
    slot = jnp.where(keep, jnp.arange(num_experts) * c_src + pos, -1)
    flat = jnp.take_along_axis(slot, topk_idx, axis=1).astype(jnp.int32)
    tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], flat.shape)
    src = jnp.full((num_experts * c_src,), t, jnp.int32)
    src = src.at[jnp.where(flat >= 0, flat, num_experts * c_src)].set(tok, mode="drop")
    return flat, src


def gather_blocks(x: jax.Array, src: jax.Array, num_experts: int, c_src: int) -> jax.Array:
    """[T, H] tokens -> [E, c_src, H] blocks (zero rows in empty slots), by index gather."""
    xp = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return xp[src].reshape(num_experts, c_src, x.shape[1])


def to_experts(blocks: jax.Array, axis_name: AxisName, nranks: int) -> jax.Array:
    """[E, c_src, H] per source -> [E_local, R * c_src, H] per expert rank (jax.lax.all_to_all)."""
    e, cs, h = blocks.shape
    el = e // nranks
    y = jax.lax.all_to_all(blocks.reshape(nranks, el, cs, h), axis_name, 0, 0, tiled=True)
    return y.transpose(1, 0, 2, 3).reshape(el, nranks * cs, h)


def counts_to_experts(sent: jax.Array, axis_name: AxisName, nranks: int) -> jax.Array:
    """[E] int32 rows this source put in each expert's block -> [E_local, R] int32 on the expert
    rank: the rows in use in each source's block of :func:`to_experts`' output."""
    y = jax.lax.all_to_all(sent.reshape(nranks, -1), axis_name, 0, 0, tiled=True)  # [R, E_local]
    return y.T


def from_experts(rows: jax.Array, axis_name: AxisName, nranks: int) -> jax.Array:
    """[E_local, R * c_src, H] on the expert rank -> [E, c_src, H] back at the source."""
    el, rcs, h = rows.shape
    cs = rcs // nranks
    y = rows.reshape(el, nranks, cs, h).transpose(1, 0, 2, 3)
    return jax.lax.all_to_all(y, axis_name, 0, 0, tiled=True).reshape(nranks * el, cs, h)


def combine_rows(back: jax.Array, flat: jax.Array, weights: jax.Array) -> jax.Array:
    """[E, c_src, H] expert outputs, [T, K] slots, [T, K] weights -> [T, H] weighted sums.

    Dropped pairs (slot -1) read a zero row. The weights are not rounded to the rows' dtype:
    the sum runs in float32 (float64 for float64 rows or weights) and is rounded once to the
    rows' dtype, as :func:`strata_jax.moe.combine` does.
    """
    e, cs, h = back.shape
    rows = jnp.concatenate([back.reshape(e * cs, h), jnp.zeros((1, h), back.dtype)])
    picked = rows[jnp.where(flat >= 0, flat, e * cs)]  # [T, K, H]
    acc = jnp.promote_types(jnp.promote_types(back.dtype, weights.dtype), jnp.float32)
    y = jnp.einsum("tk,tkh->th", weights.astype(acc), picked.astype(acc))
    return y.astype(back.dtype)
