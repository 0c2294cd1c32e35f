"""An expert-parallel MoE MLP over strata's dispatch/combine, and its GShard-style twin.

:func:`moe_mlp` runs inside ``jax.shard_map`` over the expert-parallel axis. ``impl="strata"``
moves tokens with ``strata_jax.moe.dispatch`` / ``combine`` (zero-copy over the fabric);
``impl="xla"`` is the textbook GShard formulation (one-hot dispatch/combine tensors and
``jax.lax.all_to_all``); ``impl="reference"`` uses the pure-JAX oracle of
:mod:`strata_jax.moe._reference`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

AxisName = Any

__all__ = ["moe_mlp", "route", "IMPLS"]

IMPLS = ("strata", "xla", "reference")


def route(x: jax.Array, router_w: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing.

    Args:
      x: [T, H] tokens.
      router_w: [H, E] router weights.
      top_k: experts per token K (<= E).

    Returns:
      ``(topk_idx [T, K] int32, topk_weights [T, K])``: the K most probable experts
      (``jax.lax.top_k`` order, distinct) and their softmax probabilities renormalized to sum
      to one. Logits, softmax and weights are float32 (float64 for float64 x).
    """
    acc = jnp.promote_types(x.dtype, jnp.float32)
    logits = jnp.dot(x, router_w.astype(x.dtype), preferred_element_type=acc)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    return top_i.astype(jnp.int32), top_p / top_p.sum(axis=-1, keepdims=True)


def _experts(
    h: jax.Array, w1: jax.Array, w2: jax.Array, activation: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """[E_local, N, H] -> [E_local, N, H]: one two-layer MLP per local expert, batched."""
    a = activation(jnp.einsum("enh,ehf->enf", h, w1.astype(h.dtype)))
    return jnp.einsum("enf,efh->enh", a, w2.astype(h.dtype))


def _native_ops():
    try:
        from strata_jax.moe import combine, dispatch  # noqa: PLC0415 (lazy: optional module)
    except ImportError as e:
        raise NotImplementedError(
            "moe_mlp(impl='strata') needs strata_jax.moe.dispatch and strata_jax.moe.combine, "
            "which this build does not have. Use impl='reference' (the pure-JAX oracle with "
            "the same semantics) or impl='xla'."
        ) from e
    return dispatch, combine


def moe_mlp(
    x: jax.Array,
    router_w: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: AxisName,
    capacity: int | None = None,
    impl: str = "strata",
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> jax.Array:
    """Expert-parallel mixture-of-experts MLP; call inside ``jax.shard_map``.

    ``y[t] = sum_k g[t, k] * W2_e act(W1_e x[t])`` over the top-k experts ``e = i[t, k]`` of
    the softmax router, with ``g`` the top-k probabilities renormalized to sum to one.
    Experts are sharded along ``axis_name`` (size R): expert ``e`` lives on rank
    ``e // E_local``. Tokens are per rank (data parallel over the same axis).

    Args:
      x: [T, H] this rank's tokens, float dtype (the expert MLP runs in x's dtype).
      router_w: [H, E] router weights (replicated).
      w1: [E_local, H, F] this rank's experts' first layer, ``E_local = num_experts // R``.
      w2: [E_local, F, H] their second layer.
      num_experts: E, a multiple of R.
      top_k: K experts per token, ``1 <= K <= E``.
      axis_name: the expert-parallel mesh axis.
      capacity: rows per expert C over *all* source ranks, filled in (source rank, token)
        order; ``None`` = ``R * T`` (nothing dropped). Dropped (token, expert) pairs
        contribute zero, so ``y`` then sums fewer than K experts (weights not renormalized).
      impl: ``"strata"`` (``strata_jax.moe.dispatch``/``combine``), ``"xla"`` (GShard:
        one-hot dispatch tensor ``[T, E, C_src]``, ``jax.lax.all_to_all`` there and back,
        combine einsum) or ``"reference"`` (pure-JAX oracle of dispatch/combine).
      activation: elementwise activation with ``activation(0) == 0`` (unused capacity rows
        are zero and must stay zero only for speed, not correctness).

    Returns:
      y [T, H] in x's dtype. Differentiable with respect to x, router_w, w1 and w2.

    Raises:
      ValueError: bad shapes, ``num_experts`` not a multiple of R, bad ``top_k``/``impl``.
      NotImplementedError: ``impl="strata"`` when ``strata_jax.moe.dispatch`` is missing.

    Capacity and drops, strata versus xla: GShard allots each *source rank* ``C_src =
    ceil(C / R)`` rows per expert (so both run the expert MLP on about C rows per expert)
    and drops a source's tokens past ``C_src``; strata drops the pairs past C over all
    sources. With ``capacity=None`` neither drops anything (``C_src = T``) and the two give
    the same output up to float round-off; with a smaller capacity they agree as long as no
    source sends more than ``C_src`` tokens to one expert.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    t, h = x.shape
    nranks = jax.lax.axis_size(axis_name)
    if num_experts <= 0 or num_experts % nranks:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the size "
            f"{nranks} of axis {axis_name!r}"
        )
    e_local = num_experts // nranks
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if router_w.shape != (h, num_experts):
        raise ValueError(f"router_w must be [H={h}, E={num_experts}], got {router_w.shape}")
    if w1.ndim != 3 or w1.shape[:2] != (e_local, h):
        raise ValueError(f"w1 must be [E_local={e_local}, H={h}, F], got {w1.shape}")
    if w2.shape != (e_local, w1.shape[2], h):
        raise ValueError(f"w2 must be [E_local={e_local}, F={w1.shape[2]}, H={h}], got {w2.shape}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None, got {capacity}")

    topk_idx, topk_w = route(x, router_w, top_k)

    if impl == "xla":
        return _gshard(
            x,
            topk_idx,
            topk_w,
            w1,
            w2,
            num_experts=num_experts,
            axis_name=axis_name,
            capacity=capacity,
            activation=activation,
        )

    if impl == "strata":
        dispatch, combine = _native_ops()
    else:
        from strata_jax.moe._reference import combine, dispatch  # noqa: PLC0415
    recv, layout = dispatch(
        x, topk_idx, num_experts=num_experts, axis_name=axis_name, capacity=capacity
    )
    expert_y = _experts(recv, w1, w2, activation)
    return combine(expert_y, layout, topk_w).astype(x.dtype)


def _gshard(x, topk_idx, topk_w, w1, w2, *, num_experts, axis_name, capacity, activation):
    """GShard (Lepikhin et al. 2020) with per-source capacity ``C_src = ceil(C / R)``."""
    t, h = x.shape
    nranks = jax.lax.axis_size(axis_name)
    e_local = num_experts // nranks
    c_src = t if capacity is None else min(t, math.ceil(capacity / nranks))

    onehot = jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.int32)  # [T, K, E]
    mask = jnp.minimum(onehot.sum(axis=1), 1)  # [T, E]; top_k indices are distinct
    pos = jnp.cumsum(mask, axis=0) - mask  # position among this rank's tokens for e
    keep = mask * (pos < c_src)
    dispatch_t = keep[:, :, None] * jax.nn.one_hot(pos, c_src, dtype=jnp.int32)  # [T, E, C]
    gates = jnp.einsum("tke,tk->te", onehot.astype(topk_w.dtype), topk_w)  # [T, E]
    combine_t = dispatch_t.astype(topk_w.dtype) * gates[:, :, None]  # [T, E, C]

    send = jnp.einsum("tec,th->ech", dispatch_t.astype(x.dtype), x)  # [E, C, H]
    send = send.reshape(nranks, e_local, c_src, h)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [R(source), E_local, C, H]
    recv = recv.transpose(1, 0, 2, 3).reshape(e_local, nranks * c_src, h)
    out = _experts(recv, w1, w2, activation)
    out = out.reshape(e_local, nranks, c_src, h).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(out, axis_name, 0, 0)  # [R(expert rank), E_local, C, H]
    back = back.reshape(num_experts, c_src, h)
    return jnp.einsum("tec,ech->th", combine_t.astype(x.dtype), back).astype(x.dtype)
