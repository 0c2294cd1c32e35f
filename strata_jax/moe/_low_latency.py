"""MoE low-latency mode (DeepEP's ``low_latency_dispatch``/``low_latency_combine``): static
buffers, one arrival per phase, no planning collective, for decode where each rank moves 1-128
tokens per layer and round trips, not bandwidth, decide.

* :func:`low_latency_dispatch`: static shapes for any routing, ``recv_x`` [E_local, R * M, H]
  (M = ``max_tokens_per_rank``) plus ``recv_counts`` [E_local]. No planning collective: every
  rank publishes its x and its [T, K] ids in one arrival, and each rank derives from the
  published ids what it needs (its receive counts, and where each of its own choices lands),
  so the counts travel with the data. Then every destination reads its rows straight from the
  sources' x (pull, the default) or, ``algo="push"``, every source writes them into the
  destinations' ``recv_x``. The two measure the same on the in-process fabric here
  (``benchmarks/moe.py --mode low_latency``, 200 interleaved calls: whichever of the two is
  timed second is 2-12% ahead at every T, in both orders); pull is the default because it moves
  fewer bytes where the fabric stages small buffers (pull stages x in; push copies the whole
  staged ``recv_x`` back).
* :func:`low_latency_combine`: one arrival publishing the expert outputs; every token's rank
  pulls its K expert rows and applies its own weights (no partial-sum phase, no second barrier).

Per call that is one arrival plus the departure barrier every zero-copy operator needs (the
sources' buffers must outlive the peers' reads): 2 barriers for dispatch and 2 for combine,
against 4 (all_gather of the ids, then dispatch) and 3 in the normal mode. Arriving rows have
the normal mode's semantics (order, -1, repeats, weights once in combine; rows past the counts
zeroed); what the mode trades: memory for the static buffer (R * M rows per local expert, the
experts run over all of them) and no autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import lowering
from strata_jax._src.jax_compat import ad, batching, core, mlir
from strata_jax.moe._primitive import acc_dtype, check_combine, check_routing, lower, out_aval
from strata_jax.moe._reference import sanitize_ids

AxisName = Any

__all__ = ["LowLatencyHandle", "low_latency_combine", "low_latency_dispatch"]

_LL_ALGOS = ("pull", "push")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["topk_idx", "src_slots"],
    meta_fields=["num_experts", "max_tokens_per_rank", "axis_name"],
)
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """What :func:`low_latency_combine` needs about one :func:`low_latency_dispatch`.

    A registered pytree (crosses ``jax.jit``/``scan``); not differentiable.

    Shapes are per rank: T tokens, K choices.

    Attributes:
      topk_idx: [T, K] int32, this rank's choices (ids outside [0, E) replaced by -1).
      src_slots: [T, K] int32, row of choice k of token t in the expert's rank's ``recv_x``
        flattened to [E_local * R * M] (``e_local * R * M + position``), -1 for -1 choices; a
        repeated expert points at its first occurrence's row.
      num_experts: static, E.
      max_tokens_per_rank: static, M.
      axis_name: static, the expert-parallel mesh axis.
    """

    topk_idx: jax.Array
    src_slots: jax.Array
    num_experts: int
    max_tokens_per_rank: int
    axis_name: Any


# ll_dispatch_p(x [T, H], idx [T, K] i32) -> recv [E_local, R * M, H], counts [E_local] i32,
#   src_slots [T, K] i32
moe_low_latency_dispatch_p = core.Primitive("strata_moe_low_latency_dispatch")
moe_low_latency_dispatch_p.multiple_results = True


def _ll_dispatch_abstract_eval(x, idx, *, axes, ranks, local_experts, max_tokens, push):
    ops = (x, idx)
    recv = out_aval(x, (local_experts, ranks * max_tokens, x.shape[1]), x.dtype, ops, axes)
    counts = out_aval(idx, (local_experts,), jnp.int32, ops, axes)
    slots = out_aval(idx, idx.shape, jnp.int32, ops, axes)
    return [recv, counts, slots], lowering.effects(axes)


moe_low_latency_dispatch_p.def_effectful_abstract_eval(_ll_dispatch_abstract_eval)
mlir.register_lowering(
    moe_low_latency_dispatch_p,
    lambda ctx, x, idx, *, axes, ranks, local_experts, max_tokens, push: lower(
        "strata_moe_low_latency_dispatch", "moe.low_latency_dispatch"
    )(ctx, x, idx, axes=axes, max_tokens=np.int64(max_tokens), push=np.int64(push)),
    platform="cpu",
    cacheable=False,
)

# ll_combine_p(expert_y [E_local, R * M, H], w [T, K] acc dtype, idx [T, K], src_slots [T, K])
#   -> y [T, H]
moe_low_latency_combine_p = core.Primitive("strata_moe_low_latency_combine")


def _ll_combine_abstract_eval(ey, w, idx, slots, *, axes, max_tokens):
    return out_aval(
        ey, (w.shape[0], ey.shape[2]), ey.dtype, (ey, w, idx, slots), axes
    ), lowering.effects(axes)


moe_low_latency_combine_p.def_effectful_abstract_eval(_ll_combine_abstract_eval)
mlir.register_lowering(
    moe_low_latency_combine_p,
    lambda ctx, ey, w, idx, slots, *, axes, max_tokens: lower(
        "strata_moe_low_latency_combine", "moe.low_latency_combine"
    )(ctx, ey, w, idx, slots, axes=axes, max_tokens=np.int64(max_tokens)),
    platform="cpu",
    cacheable=False,
)


def _ll_unsupported(why: str):
    """A vmap or JVP rule for the low-latency primitives that raises ``why`` (formatted with
    the public function's name) instead of JAX's stock message naming the primitive."""

    def make(name: str):
        def rule(*args, **params):
            raise NotImplementedError(why.format(name=f"strata_jax.moe.{name}"))

        return rule

    return make


_ll_no_vmap = _ll_unsupported(
    "{name} has no jax.vmap rule (its static [E_local, R * max_tokens_per_rank, H] buffer would "
    "grow by the batch size squared); fold the batch into the tokens (x [B * T, H], "
    "max_tokens_per_rank >= B * T) or use the normal mode (dispatch/combine), which batches."
)
_ll_no_jvp = _ll_unsupported(
    "{name} is not differentiable (the low-latency mode is for inference: no jvp, grad or vjp). "
    "Train with the normal mode, strata_jax.moe.dispatch/combine, which has both; or, if no "
    "gradient should flow through this call, pass its inputs through jax.lax.stop_gradient."
)
for _p, _name in (
    (moe_low_latency_dispatch_p, "low_latency_dispatch"),
    (moe_low_latency_combine_p, "low_latency_combine"),
):
    batching.fancy_primitive_batchers[_p] = _ll_no_vmap(_name)
    ad.primitive_jvps[_p] = _ll_no_jvp(_name)


def low_latency_dispatch(
    x,
    topk_idx,
    *,
    num_experts: int,
    axis_name: AxisName,
    max_tokens_per_rank: int | None = None,
    algo: str = "pull",
):
    """Sends every token to the ranks of its experts with static shapes (DeepEP's
    ``low_latency_dispatch``), for decode-sized T.

    Call inside :func:`jax.shard_map` over ``axis_name`` (size R). Not differentiable.

    Args:
      x: [T, H] this rank's tokens; float32, float64, bfloat16 or float16; T <= M.
      topk_idx: [T, K] integer global expert ids; -1 (or any id outside [0, num_experts))
        means "no expert"; a token naming one expert twice is sent to it once.
      num_experts: E, divisible by R; expert e lives on rank e // (E // R).
      axis_name: the expert-parallel mesh axis (or tuple of axes; ranks in tuple order).
      max_tokens_per_rank: M, the static per-source block of the receive buffer (``None``: T).
        Every routing fits: a token goes to an expert at most once, so an expert receives at
        most R * M rows and nothing is ever dropped.
      algo: ``"pull"`` (destinations read the sources' x; the default) or ``"push"``
        (sources write into the destinations' ``recv_x``). Same results; same speed within
        noise here (``benchmarks/moe.py --mode low_latency``).

    Returns:
      ``(recv_x, recv_counts, handle)``: ``recv_x`` [E // R, R * M, H] in x's dtype, rows
      [0, recv_counts[e]) of local expert e hold its tokens in (source rank, source token)
      order (as :func:`dispatch`'s), rows past the count are zero. ``recv_counts`` [E // R]
      int32. ``handle``:
      the :class:`LowLatencyHandle` for :func:`low_latency_combine`. Typed varying over
      ``axis_name`` under check_vma.

    Raises:
      ValueError: E not divisible by R, M < T, unknown algo, bad shapes or dtypes.
      NameError: ``axis_name`` not bound by an enclosing shard_map.

    One arrival publishes x, the ids and the receive buffer (no all_gather of the ids first);
    each rank computes its receive counts and its choices' rows from the published ids.
    """
    axes = lowering.axis_tuple(axis_name)
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    r = check_routing("low_latency_dispatch", axes, num_experts, topk_idx, x)
    t = x.shape[0]
    m = t if max_tokens_per_rank is None else max_tokens_per_rank
    if not isinstance(m, (int, np.integer)) or m < t:
        raise ValueError(
            f"strata_jax.moe.low_latency_dispatch: max_tokens_per_rank must be an int >= "
            f"the {t} tokens of x, got {max_tokens_per_rank!r}."
        )
    if algo not in _LL_ALGOS:
        raise ValueError(
            f"strata_jax.moe.low_latency_dispatch: algo must be one of {_LL_ALGOS}, got {algo!r}."
        )
    idx = lowering.pvary_missing(sanitize_ids(topk_idx, num_experts), axes)
    recv, counts, slots = moe_low_latency_dispatch_p.bind(
        lowering.pvary_missing(x, axes),
        idx,
        axes=axes,
        ranks=r,
        local_experts=num_experts // r,
        max_tokens=int(m),
        push=algo == "push",
    )
    handle = LowLatencyHandle(
        topk_idx=idx,
        src_slots=slots,
        num_experts=int(num_experts),
        max_tokens_per_rank=int(m),
        axis_name=tuple(axis_name) if isinstance(axis_name, list) else axis_name,
    )
    return recv, counts, handle


def low_latency_combine(expert_y, handle: LowLatencyHandle, topk_weights):
    """Brings expert outputs back to their tokens, weighted and summed (DeepEP's
    ``low_latency_combine``). Not differentiable.

    Args:
      expert_y: [E // R, R * M, H] expert outputs in the row order of
        :func:`low_latency_dispatch`'s ``recv_x``; float32, float64, bfloat16 or float16.
      handle: the :class:`LowLatencyHandle` of the matching dispatch.
      topk_weights: [T, K] float weights of this rank's choices.

    Returns:
      y [T, H] in expert_y's dtype: ``y[t] = sum_k topk_weights[t, k] * expert_y[row of
      (t, topk_idx[t, k])]``, as :func:`combine`: weights applied here and only here, -1
      choices contribute 0, a repeated expert gets the sum of its weights. Accumulates in
      float32 (float64 for float64), a token's rows in :func:`combine`'s order (expert ranks
      in rank order, a rank's choices in k order): bitwise the same y as :func:`combine` of
      the same rows.

    Raises:
      ValueError: shapes or dtypes that do not match the handle.

    One arrival publishes expert_y; each token's rank pulls its K rows straight from the
    expert ranks' buffers and applies its own weights, so there is no partial-sum phase.
    """
    axes, expert_y, topk_weights = check_combine(
        "low_latency_combine",
        handle,
        LowLatencyHandle,
        "low_latency_dispatch",
        lambda r: r * handle.max_tokens_per_rank,
        "R * max_tokens_per_rank",
        expert_y,
        topk_weights,
    )
    ey, w, idx, slots = (
        lowering.pvary_missing(v, axes)
        for v in (
            expert_y,
            topk_weights.astype(acc_dtype(expert_y.dtype)),
            handle.topk_idx,
            handle.src_slots,
        )
    )
    return moe_low_latency_combine_p.bind(
        ey, w, idx, slots, axes=axes, max_tokens=handle.max_tokens_per_rank
    )
