"""MoE expert-parallel dispatch and combine over strata's fabric (DeepEP's API, zero-copy).

Inside :func:`jax.shard_map` over an expert-parallel axis of size R, every rank holds T tokens
[T, H] and their top-k expert choices [T, K]; ``num_experts`` E experts live E // R per rank
(expert e on rank e // (E // R)).

* :func:`dispatch_layout`: DeepEP's ``get_dispatch_layout`` (tokens per rank / per expert,
  ``is_token_in_rank``), local and cheap.
* :func:`dispatch`: moves every token row to the ranks of its experts -> ``recv_x``
  [E_local, C, H] plus a :class:`MoELayout` (the plan).
* :func:`combine`: brings the expert outputs back, weighted by ``topk_weights`` and summed.

Algorithm (DeepEP, Zhao et al. 2025, adapted to a pull-style shared-memory fabric as in
StrataCL, Hu et al. 2026). The routing plan: one small ``all_gather`` of the [T, K] expert ids,
then on each destination rank one native pass over the global token order (source rank, source
token) assigns each (token, local expert) pair its slot; pairs past the capacity C are dropped
in that order. Native code then moves the rows:

* dispatch: each destination pulls a token's row straight from the source rank's XLA buffer
  once, into its first slot on that rank, and copies it locally into the token's other slots
  there: a row crosses the fabric at most once per destination rank.
* combine: every source rank pulls its tokens' expert rows straight from the expert ranks'
  buffers and sums them, weighted, expert ranks in rank order and choices in k order
  (deterministic), in one pass (native/moe/moe.h says why not DeepEP's two phases here).

Semantics fixed here (and tested): a token that names the same expert twice is dispatched to it
once and its combine weight is the sum of both weights (DeepEP); ``-1`` (or any id outside
[0, E)) means "no expert"; weights are applied exactly once, in :func:`combine`.

The low-latency mode (decode: static shapes, no planning collective) is in ``_low_latency.py``;
the pieces both modes share in ``py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import hierarchy, lowering, topology
from strata_jax._src.collectives import all_gather
from strata_jax._src.jax_compat import ad, batching, core, mlir
from strata_jax.moe._primitive import acc_dtype, check_combine, check_routing, lower, out_aval
from strata_jax.moe._reference import sanitize_ids

AxisName = Any

__all__ = [
    "MoELayout",
    "dispatch",
    "dispatch_layout",
    "combine",
]

# --------------------------------------------------------------------------------------
# The layout (plan) returned by dispatch
# --------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["recv_counts", "recv_dropped", "dropped", "slots", "rows", "topk_idx", "unique"],
    meta_fields=["num_experts", "capacity", "axis_name"],
)
@dataclasses.dataclass(frozen=True)
class MoELayout:
    """Everything :func:`combine` (and the backward passes) need about one dispatch.

    A registered pytree: it can cross ``jax.jit``/``scan``/``custom_vjp`` boundaries and several
    layouts may be alive at once (two dispatches in flight before their combines). To return
    it from ``jax.shard_map``, note that ``dropped`` is 0-d (give it its own out_spec or
    reshape it). Under ``jax.vmap`` its fields gain the batch axis like any pytree.

    Shapes are per rank: R ranks, T tokens, K choices, E experts, E_local = E // R, C slots.

    Attributes:
      recv_counts: [E_local] int32, rows in use per local expert (rows [0, count) of recv_x).
      recv_dropped: [E_local] int32, (token, expert) pairs routed to each local expert that did
        not fit in the capacity.
      dropped: [] int32, ``recv_dropped.sum()``: pairs this rank's experts dropped (psum it
        over the axis for the global count).
      slots: [R * T, K] int32, destination plan: for global token g = source_rank * T + t and
        choice k, the slot ``e_local * C + position`` on this rank, or -1.
      rows: [R * T] int32, destination plan: token g's row among the tokens with a kept
        slot on this rank (g order), -1 (kept for tools; the one-pass combine does not use it).
      topk_idx: [T, K] int32, this rank's choices (ids outside [0, E) replaced by -1).
      unique: [T, K] bool, choice k is the first occurrence of a valid expert in the token.
      num_experts: static, E.
      capacity: static, C.
      axis_name: static, the expert-parallel mesh axis.
    """

    recv_counts: jax.Array
    recv_dropped: jax.Array
    dropped: jax.Array
    slots: jax.Array
    rows: jax.Array
    topk_idx: jax.Array
    unique: jax.Array
    num_experts: int
    capacity: int
    axis_name: Any


# --------------------------------------------------------------------------------------
# Primitives: the native data phases
# --------------------------------------------------------------------------------------


def _native_operands(ctx, n: int):
    """The lowering context of a primitive whose operands after the first n are for its AD
    rules only (the layout arrays its transpose needs); the native call gets the first n."""
    return ctx.replace(avals_in=ctx.avals_in[:n])


# dispatch_p(x [T, H], weights [T, K] (accumulator dtype) or [0, K], slots [N, K], counts [E_local],
#   topk_idx [T, K] (AD only)) -> recv [E_local, C, H] (x's dtype)
moe_dispatch_p = core.Primitive("strata_moe_dispatch")


def _dispatch_abstract_eval(x, w, slots, counts, idx, *, axes, capacity, weighted):
    out = out_aval(x, (counts.shape[0], capacity, x.shape[1]), x.dtype, (x, w, slots, counts), axes)
    return out, lowering.effects(axes)


moe_dispatch_p.def_effectful_abstract_eval(_dispatch_abstract_eval)
mlir.register_lowering(
    moe_dispatch_p,
    lambda ctx, x, w, slots, counts, idx, *, axes, capacity, weighted: lower(
        "strata_moe_dispatch", "moe.dispatch"
    )(_native_operands(ctx, 4), x, w, slots, counts, axes=axes, weighted=np.int64(weighted)),
    platform="cpu",
    cacheable=False,
)

# combine_p(expert_y [E_local, C, H], weights [T, K] (accumulator dtype), slots [N, K], rows [N],
#   counts [E_local], topk_idx [T, K] (the last two for AD only))
#   -> (y [T, H], partials [J, H]); partials is an empty [0, H] placeholder (J = 0): the
#   one-pass combine needs no scratch.
moe_combine_p = core.Primitive("strata_moe_combine")
moe_combine_p.multiple_results = True


def _combine_abstract_eval(ey, w, slots, rows, counts, idx, *, axes, num_rows):
    ops = (ey, w, slots, rows)
    y = out_aval(ey, (w.shape[0], ey.shape[2]), ey.dtype, ops, axes)
    part = out_aval(ey, (num_rows, ey.shape[2]), ey.dtype, ops, axes)
    return [y, part], lowering.effects(axes)


moe_combine_p.def_effectful_abstract_eval(_combine_abstract_eval)
mlir.register_lowering(
    moe_combine_p,
    lambda ctx, ey, w, slots, rows, counts, idx, *, axes, num_rows: lower(
        "strata_moe_combine", "moe.combine"
    )(_native_operands(ctx, 4), ey, w, slots, rows, axes=axes),
    platform="cpu",
    cacheable=False,
)

# plan_p(g_idx [N, K] int32 (every rank's sanitized ids), base [] int32 (this rank's first expert))
#   -> counts [E_local], dropped [E_local], slots [N, K], rows [N] (int32): local, no communication
moe_plan_p = core.Primitive("strata_moe_plan")
moe_plan_p.multiple_results = True


def _plan_abstract_eval(g_idx, base, *, local_experts, capacity, axes):
    ops = (g_idx, base)
    el = (local_experts,)
    return [
        out_aval(g_idx, el, jnp.int32, ops, axes),
        out_aval(g_idx, el, jnp.int32, ops, axes),
        out_aval(g_idx, g_idx.shape, jnp.int32, ops, axes),
        out_aval(g_idx, g_idx.shape[:1], jnp.int32, ops, axes),
    ]


moe_plan_p.def_abstract_eval(_plan_abstract_eval)
mlir.register_lowering(
    moe_plan_p,
    lambda ctx, g_idx, base, *, local_experts, capacity, axes: jax.ffi.ffi_lowering(
        "strata_moe_plan"
    )(ctx, g_idx, base, capacity=np.int64(capacity)),
    platform="cpu",
)

# gather_p(values [E_local, C] f32/f64, slots [N, K], topk_idx [T, K], counts [E_local] (AD
#   only)) -> [T, K] values' dtype
moe_gather_p = core.Primitive("strata_moe_gather")


def _gather_abstract_eval(values, slots, idx, counts, *, axes):
    return out_aval(values, idx.shape, values.dtype, (values, slots, idx), axes), lowering.effects(
        axes
    )


moe_gather_p.def_effectful_abstract_eval(_gather_abstract_eval)
mlir.register_lowering(
    moe_gather_p,
    lambda ctx, values, slots, idx, counts, *, axes: lower("strata_moe_gather", "moe.combine")(
        _native_operands(ctx, 3), values, slots, idx, axes=axes
    ),
    platform="cpu",
    cacheable=False,
)


# --------------------------------------------------------------------------------------
# Batching (jax.vmap): B independent routings are one routing over B * E experts
# --------------------------------------------------------------------------------------
# Expert e of batch element b becomes expert (e // E_local) * B * E_local + b * E_local
# + e % E_local: it stays on rank e // E_local, as local expert b * E_local + e % E_local, so a
# batch takes one native call per phase and the receive buffer [B * E_local, C, H] is
# [B, E_local, C, H]. Tokens are ordered (source rank, b, t), so every folded expert sees its
# batch element's tokens in (source rank, t) order: the slots, drops and sums of B separate
# calls. jax.lax's collectives batch the same way (one collective over the batched operand).


def _vmap_check(axis_data, axes, name: str):
    if axis_data.name in axes:
        raise NotImplementedError(
            f"strata_jax.moe.{name}: the expert-parallel axis {axis_data.name!r} is bound by "
            "jax.vmap here (vmap(..., axis_name=...) names it, or hides a mesh axis of that "
            "name); MoE dispatch/combine run over mesh axes of jax.shard_map only: give the "
            "vmap axis another name or none."
        )


def _fold_ids(idx, el: int):
    """[B, ..., K] expert ids (-1 = none) -> ids of the folded B * E expert routing."""
    b = idx.shape[0]
    off = (jnp.arange(b, dtype=jnp.int32) * el).reshape((b,) + (1,) * (idx.ndim - 1))
    return jnp.where(idx >= 0, (idx // el) * (b * el) + off + idx % el, -1)


def _fold_slots(slots, r: int, el: int, cap: int):
    """Per-element slots [B, R * T, K] -> slots of the folded routing [R * B * T, K]."""
    b, n, k = slots.shape
    off = (jnp.arange(b, dtype=jnp.int32) * (el * cap))[:, None, None]
    s = jnp.where(slots >= 0, slots + off, -1)
    return s.reshape(b, r, n // r, k).transpose(1, 0, 2, 3).reshape(n * b, k)


def _unfold_slots(slots, b: int, r: int, n: int, el: int, cap: int):
    """Folded slots [R * B * T, K] -> per-element slots [B, N = R * T, K]."""
    k = slots.shape[1]
    s = slots.reshape(r, b, n // r, k).transpose(1, 0, 2, 3).reshape(b, n, k)
    off = (jnp.arange(b, dtype=jnp.int32) * (el * cap))[:, None, None]
    return jnp.where(s >= 0, s - off, -1)


def _empty(shape, dtype, axes):
    """A zero-size result of a batch of 0 (no call: the same on every rank), typed varying."""
    return lowering.pvary_missing(jnp.zeros(shape, dtype), axes)


def _rows_placeholder(slots, axes):
    """combine's ``rows`` operand where only its shape matters: the native one-pass combine and
    the hierarchical lowering never read it (rows [N] of the plan; -1 here), and recomputing
    it is a cumsum over N in every backward pass."""
    return lowering.pvary_missing(jnp.full(slots.shape[:1], -1, jnp.int32), axes)


def _rows_of(slots):
    """The plan's ``rows`` from its slots [..., N, K]: a token's rank among the tokens with a
    kept slot here, in token order, or -1."""
    has = jnp.any(slots >= 0, axis=-1)
    return jnp.where(has, jnp.cumsum(has, axis=-1, dtype=jnp.int32) - 1, -1).astype(jnp.int32)


def _plan_batcher(axis_data, vals_in, dims_in, *, local_experts, capacity, axes):
    _vmap_check(axis_data, axes, "dispatch")
    g_idx, base = vals_in
    if all(d is None for d in dims_in):
        out = moe_plan_p.bind(
            g_idx, base, local_experts=local_experts, capacity=capacity, axes=axes
        )
        return out, [None] * 4
    b, r, el = axis_data.size, lowering.axis_size(axes), local_experts
    g = batching.bdim_at_front(g_idx, dims_in[0], b)  # [B, R * T, K]
    n, k = g.shape[1:]
    if b == 0:  # nothing to route (static: the same on every rank)
        shapes = [(0, el), (0, el), (0, n, k), (0, n)]
        return [_empty(sh, jnp.int32, axes) for sh in shapes], [0] * 4
    g = _fold_ids(g, el).reshape(b, r, n // r, k).transpose(1, 0, 2, 3).reshape(n * b, k)
    # base (this rank's first expert) comes from axis_index: the same for every element
    base0 = base if dims_in[1] is None else batching.bdim_at_front(base, dims_in[1], b)[0]
    counts, dropped, slots, _ = moe_plan_p.bind(
        g, base0 * b, local_experts=b * el, capacity=capacity, axes=axes
    )
    slots = _unfold_slots(slots, b, r, n, el, capacity)
    out = [counts.reshape(b, el), dropped.reshape(b, el), slots, _rows_of(slots)]
    return out, [0] * 4


def _dispatch_batcher(axis_data, vals_in, dims_in, *, axes, capacity, weighted):
    _vmap_check(axis_data, axes, "dispatch")
    if all(d is None for d in dims_in):
        out = moe_dispatch_p.bind(*vals_in, axes=axes, capacity=capacity, weighted=weighted)
        return out, None
    b, r = axis_data.size, lowering.axis_size(axes)
    x, w, slots, counts, idx = vals_in
    xd, wd, sd, cd, idd = dims_in
    counts = batching.bdim_at_front(counts, cd, b)  # [B, E_local]
    el = counts.shape[1]
    x = batching.bdim_at_front(x, xd, b)  # [B, T, H]
    if b == 0:
        return _empty((0, el, capacity, x.shape[2]), x.dtype, axes), 0
    x = x.reshape(b * x.shape[1], x.shape[2])
    w = batching.bdim_at_front(w, wd, b)  # weighted: [B, T, K]; else [B, 0, K]
    w = w.reshape(b * w.shape[1], w.shape[2])
    slots = _fold_slots(batching.bdim_at_front(slots, sd, b), r, el, capacity)
    idx = _fold_ids(batching.bdim_at_front(idx, idd, b), el)
    idx = idx.reshape(b * idx.shape[1], idx.shape[2])
    counts = counts.reshape(b * el)
    out = moe_dispatch_p.bind(
        x, w, slots, counts, idx, axes=axes, capacity=capacity, weighted=weighted
    )
    return out.reshape(b, el, *out.shape[1:]), 0


def _combine_batcher(axis_data, vals_in, dims_in, *, axes, num_rows):
    _vmap_check(axis_data, axes, "combine")
    if all(d is None for d in dims_in):
        return moe_combine_p.bind(*vals_in, axes=axes, num_rows=num_rows), [None, None]
    b, r = axis_data.size, lowering.axis_size(axes)
    ey, w, slots, _, counts, idx = vals_in
    eyd, wd, sd, _, cd, idd = dims_in
    ey = batching.bdim_at_front(ey, eyd, b)  # [B, E_local, C, H]
    el, cap, h = ey.shape[1:]
    w = batching.bdim_at_front(w, wd, b)  # [B, T, K]
    t, k = w.shape[1:]
    if b == 0:
        return [_empty((0, t, h), ey.dtype, axes), _empty((num_rows, h), ey.dtype, axes)], [0, None]
    slots = _fold_slots(batching.bdim_at_front(slots, sd, b), r, el, cap)
    y, part = moe_combine_p.bind(
        ey.reshape(b * el, cap, h),
        w.reshape(b * t, k),
        slots,
        _rows_placeholder(slots, axes),
        batching.bdim_at_front(counts, cd, b).reshape(b * el),
        _fold_ids(batching.bdim_at_front(idx, idd, b), el).reshape(b * t, k),
        axes=axes,
        num_rows=num_rows,
    )
    return [y.reshape(b, t, h), part], [0, None]


def _gather_batcher(axis_data, vals_in, dims_in, *, axes):
    _vmap_check(axis_data, axes, "combine")
    if all(d is None for d in dims_in):
        return moe_gather_p.bind(*vals_in, axes=axes), None
    b, r = axis_data.size, lowering.axis_size(axes)
    values, slots, idx, counts = (
        batching.bdim_at_front(v, d, b) for v, d in zip(vals_in, dims_in, strict=True)
    )
    el, cap = values.shape[1], values.shape[2]
    t, k = idx.shape[1:]
    if b == 0:
        return _empty((0, t, k), values.dtype, axes), 0
    out = moe_gather_p.bind(
        values.reshape(b * el, cap),
        _fold_slots(slots, r, el, cap),
        _fold_ids(idx, el).reshape(b * t, k),
        counts.reshape(b * el),
        axes=axes,
    )
    return out.reshape(b, t, k), 0


batching.fancy_primitive_batchers[moe_plan_p] = _plan_batcher
batching.fancy_primitive_batchers[moe_dispatch_p] = _dispatch_batcher
batching.fancy_primitive_batchers[moe_combine_p] = _combine_batcher
batching.fancy_primitive_batchers[moe_gather_p] = _gather_batcher


def _bind_dispatch(x, w, layout: MoELayout, weighted: bool):
    axes = lowering.axis_tuple(layout.axis_name)
    ops = (x, w, layout.slots, layout.recv_counts, layout.topk_idx)
    return moe_dispatch_p.bind(
        *(lowering.pvary_missing(v, axes) for v in ops),
        axes=axes,
        capacity=layout.capacity,
        weighted=weighted,
    )


def _bind_combine(ey, w, layout: MoELayout):
    axes = lowering.axis_tuple(layout.axis_name)
    ops = (ey, w, layout.slots, layout.rows, layout.recv_counts, layout.topk_idx)
    # num_rows=0: the native combine is one pass and needs no partial rows (native/moe/moe.h)
    y, _ = moe_combine_p.bind(
        *(lowering.pvary_missing(v, axes) for v in ops), axes=axes, num_rows=0
    )
    return y


# --------------------------------------------------------------------------------------
# Autodiff: rules of the primitives, so jvp, vjp and their compositions (jacfwd, hessians)
# all work. dispatch is linear in x (and, weighted, in the weights); combine is bilinear in
# (expert_y, weights); gather is linear in its values. Each transpose is another of them:
#   dispatch^T (x)       = combine with the unit weights of each token's distinct experts
#                          (weighted: with the weights)
#   dispatch^T (weights) = gather of <ct row, x row> per slot (x dispatched to the slots)
#   combine^T (expert_y) = weighted dispatch of the cotangent rows
#   combine^T (weights)  = gather of <ct row, expert_y row> per slot (ct dispatched)
#   gather^T             = weighted dispatch of ones [T, 1] with the cotangent as weights
# --------------------------------------------------------------------------------------


def _zero_tangent(t) -> bool:
    return type(t) is ad.Zero


def _zero_like(v):
    return ad.Zero(core.typeof(v).to_tangent_aval())


def _dispatch_jvp(primals, tangents, *, axes, capacity, weighted):
    x, w, slots, counts, idx = primals
    tx, tw = tangents[:2]
    params = dict(axes=axes, capacity=capacity, weighted=weighted)
    out = moe_dispatch_p.bind(x, w, slots, counts, idx, **params)
    terms = []
    if not _zero_tangent(tx):
        terms.append(moe_dispatch_p.bind(tx, w, slots, counts, idx, **params))
    if weighted and not _zero_tangent(tw):
        terms.append(moe_dispatch_p.bind(x, tw, slots, counts, idx, **params))
    if not terms:
        return out, _zero_like(out)
    return out, functools.reduce(jnp.add, terms)


def _slot_dots(rows, other, acc):
    """<rows[e, c], other[e, c]> per slot, in the accumulator dtype: [E_local, C]."""
    return jnp.einsum("ech,ech->ec", rows.astype(acc), other.astype(acc))


def _dispatch_transpose(ct, x, w, slots, counts, idx, *, axes, capacity, weighted):
    if _zero_tangent(ct):
        return [None] * 5
    rows = _rows_placeholder(slots, axes)
    if ad.is_undefined_primal(x):
        acc = acc_dtype(x.aval.dtype)
        unit = w if weighted else _first_occurrence(idx).astype(acc)
        ct_x, _ = moe_combine_p.bind(ct, unit, slots, rows, counts, idx, axes=axes, num_rows=0)
        return [ct_x, None, None, None, None]
    # Linear in the weights (weighted dispatch): d w[t, k] = <ct[slot(t, k)], x[t]>.
    acc = w.aval.dtype  # w is the undefined primal here
    empty = _empty((0, idx.shape[1]), jnp.float32, axes)  # unweighted: no weights
    x_rows = moe_dispatch_p.bind(
        x, empty, slots, counts, idx, axes=axes, capacity=capacity, weighted=False
    )
    dots = _slot_dots(x_rows, ct, acc)
    return [None, moe_gather_p.bind(dots, slots, idx, counts, axes=axes), None, None, None]


def _combine_jvp(primals, tangents, *, axes, num_rows):
    ey, w, slots, rows, counts, idx = primals
    t_ey, t_w = tangents[:2]
    y, part = moe_combine_p.bind(*primals, axes=axes, num_rows=num_rows)
    terms = []
    if not _zero_tangent(t_ey):
        terms.append(moe_combine_p.bind(t_ey, w, *primals[2:], axes=axes, num_rows=num_rows)[0])
    if not _zero_tangent(t_w):
        terms.append(moe_combine_p.bind(ey, t_w, *primals[2:], axes=axes, num_rows=num_rows)[0])
    ty = functools.reduce(jnp.add, terms) if terms else _zero_like(y)
    return [y, part], [ty, _zero_like(part)]


def _combine_transpose(cts, ey, w, slots, rows, counts, idx, *, axes, num_rows):
    ct = cts[0]
    if _zero_tangent(ct):
        return [None] * 6
    if ad.is_undefined_primal(ey):
        cap = ey.aval.shape[1]
        ct_ey = moe_dispatch_p.bind(
            ct, w, slots, counts, idx, axes=axes, capacity=cap, weighted=True
        )
        return [ct_ey, None, None, None, None, None]
    # Linear in the weights: d w[t, k] = <ct[t], expert_y[slot(t, k)]>: dispatch ct, dot on
    # the expert rank, read each choice's scalar back from the expert's rank.
    empty = _empty((0, idx.shape[1]), jnp.float32, axes)  # unweighted: no weights
    ct_rows = moe_dispatch_p.bind(
        ct, empty, slots, counts, idx, axes=axes, capacity=ey.shape[1], weighted=False
    )
    dots = _slot_dots(ct_rows, ey, acc_dtype(ey.dtype))
    ct_w = moe_gather_p.bind(dots, slots, idx, counts, axes=axes).astype(w.aval.dtype)
    return [None, ct_w, None, None, None, None]


def _gather_jvp(primals, tangents, *, axes):
    out = moe_gather_p.bind(*primals, axes=axes)
    if _zero_tangent(tangents[0]):
        return out, _zero_like(out)
    return out, moe_gather_p.bind(tangents[0], *primals[1:], axes=axes)


def _gather_transpose(ct, values, slots, idx, counts, *, axes):
    if _zero_tangent(ct):
        return [None] * 4
    # values[e, c] collects the cotangent of every (token, choice) that reads slot (e, c):
    # a weighted dispatch of a one-element row per token with the cotangent as its weights.
    el, cap = values.aval.shape
    ones = jnp.ones((idx.shape[0], 1), values.aval.dtype)
    ct_v = moe_dispatch_p.bind(
        lowering.pvary_missing(ones, axes),
        ct.astype(values.aval.dtype),
        slots,
        counts,
        idx,
        axes=axes,
        capacity=cap,
        weighted=True,
    )
    return [ct_v.reshape(el, cap), None, None, None]


ad.primitive_jvps[moe_dispatch_p] = _dispatch_jvp
ad.primitive_transposes[moe_dispatch_p] = _dispatch_transpose
ad.primitive_jvps[moe_combine_p] = _combine_jvp
ad.primitive_transposes[moe_combine_p] = _combine_transpose
ad.primitive_jvps[moe_gather_p] = _gather_jvp
ad.primitive_transposes[moe_gather_p] = _gather_transpose


def _no_weights(layout: MoELayout):
    return jnp.zeros((0, layout.topk_idx.shape[1]), jnp.float32)


# --------------------------------------------------------------------------------------
# Routing plan (JAX)
# --------------------------------------------------------------------------------------


def _first_occurrence(idx):
    """[.., K] bool: idx[.., k] is valid and differs from every idx[.., j], j < k."""
    k = idx.shape[-1]
    same = idx[..., :, None] == idx[..., None, :]  # [.., K(k), K(j)]
    earlier = np.tril(np.ones((k, k), bool), -1)
    return (idx >= 0) & ~jnp.any(same & earlier, axis=-1)


def dispatch_layout(topk_idx, num_experts: int, axis_name: AxisName):
    """DeepEP's ``get_dispatch_layout`` for this rank's tokens (no communication).

    Args:
      topk_idx: [T, K] integer expert ids in [0, num_experts), -1 (or anything outside that
        range) for "no expert".
      num_experts: E, divisible by the size R of ``axis_name``.
      axis_name: the expert-parallel mesh axis (or tuple of axes).

    Returns:
      ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
      is_token_in_rank [T, R] bool)``: counts of this rank's tokens that name at least one
      expert on rank r, tokens naming expert e (a token naming e twice counts once), and
      which ranks each token goes to. Capacity is not applied here.

    Raises:
      ValueError: bad shapes/dtypes or E not divisible by R.
    """
    axes = lowering.axis_tuple(axis_name)
    r = check_routing("dispatch_layout", axes, num_experts, topk_idx)
    el = num_experts // r
    idx = sanitize_ids(topk_idx, num_experts)
    uniq = _first_occurrence(idx)
    per_expert = jax.nn.one_hot(jnp.where(uniq, idx, -1), num_experts, dtype=jnp.int32).sum(
        axis=(0, 1)
    )
    dest = jnp.where(idx >= 0, idx // el, -1)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(r, dtype=jnp.int32), axis=1)
    per_rank = in_rank.sum(0, dtype=jnp.int32)
    return per_rank, per_expert.astype(jnp.int32), in_rank


def _plan(idx, num_experts: int, capacity: int, axes: tuple):
    """Destination-side plan of this rank from the gathered routing of all ranks."""
    r = lowering.axis_size(axes)
    el = num_experts // r
    me = jax.lax.axis_index(axes).astype(jnp.int32)
    g_idx = all_gather(idx, axes, tiled=True)  # [N, K], N = R * T, (source rank, token) order
    if g_idx.size:
        # One native pass over the N x K ids (native/ffi/moe_handlers.cc, MoePlanImpl): the
        # XLA formulation below cost about 8 ms of CPU per call at N = 8192, K = 4.
        base = lowering.pvary_missing(me * el, axes)
        counts, dropped, slots, rows = moe_plan_p.bind(
            g_idx, base, local_experts=el, capacity=capacity, axes=axes
        )
        return counts, dropped, dropped.sum(dtype=jnp.int32), slots, rows
    # No tokens anywhere (static shapes): the same plan from XLA ops.
    g_uniq = _first_occurrence(g_idx)
    le = g_idx - me * el  # local expert id where the expert lives here
    here = (g_idx >= 0) & (le >= 0) & (le < el)  # includes repeated choices
    le_c = jnp.clip(le, 0, el - 1)
    onehot = (
        (le_c[:, :, None] == jnp.arange(el, dtype=jnp.int32)) & (here & g_uniq)[:, :, None]
    ).sum(1, dtype=jnp.int32)  # [N, E_local] 0/1
    pos = jnp.cumsum(onehot, axis=0, dtype=jnp.int32) - onehot  # exclusive count, g order
    total = onehot.sum(0, dtype=jnp.int32)
    recv_counts = jnp.minimum(total, capacity)
    recv_dropped = total - recv_counts
    p = jnp.take_along_axis(pos, le_c, axis=1)  # [N, K]; a repeat gets its first's position
    slots = jnp.where(here & (p < capacity), le_c * capacity + p, -1).astype(jnp.int32)
    has = jnp.any(slots >= 0, axis=1)
    rows = jnp.where(has, jnp.cumsum(has, dtype=jnp.int32) - 1, -1).astype(jnp.int32)
    return recv_counts, recv_dropped, recv_dropped.sum(dtype=jnp.int32), slots, rows


def _scoped(api: str, operands):
    """Names the ops of ``strata_jax.<api>`` (jax.named_scope ``strata.<api>``; with several
    fabrics, also the dtypes and shapes of ``operands(*args, **kwargs)`` as the user passed
    them): an error of a step inside (the check across fabrics of hierarchy/) then names this
    call, not the inner collective."""

    def deco(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            try:  # the shapes only matter to the check across fabrics (hosts)
                shown = (
                    ()
                    if topology.num_fabrics() == 1
                    else tuple(
                        v if hasattr(v, "shape") and hasattr(v, "dtype") else jnp.asarray(v)
                        for v in operands(*args, **kwargs)
                    )
                )
            except Exception:  # bad input: the function's own check says what is wrong
                shown = ()
            with jax.named_scope(hierarchy.user_scope(api, *shown)):
                return f(*args, **kwargs)

        return wrapped

    return deco


@_scoped("moe.dispatch", lambda x, topk_idx, **_: (x, topk_idx))
def dispatch(x, topk_idx, *, num_experts: int, axis_name: AxisName, capacity: int | None = None):
    """Sends every token to the ranks of its experts (DeepEP's ``dispatch``).

    Call inside :func:`jax.shard_map` over ``axis_name`` (size R); differentiable w.r.t. ``x``
    in both modes (``jax.grad``, ``jax.jvp`` and compositions such as ``jax.hessian``).

    Args:
      x: [T, H] this rank's tokens; float32, float64, bfloat16 or float16. T and H may be any
        size (0 included) but must be equal on every rank (shard_map).
      topk_idx: [T, K] int32 global expert ids in [0, num_experts); -1 (or any id outside the
        range) means "no expert". A token naming one expert twice is sent to it once.
      num_experts: E, divisible by R; expert e lives on rank e // (E // R).
      axis_name: the expert-parallel mesh axis (or a tuple of axes; ranks in tuple order).
      capacity: C, rows per local expert (static, the same on every rank). ``None`` = R * T,
        the tight worst case (every token of every rank picks one expert): nothing is dropped.
        Otherwise (token, expert) pairs past C are dropped in (source rank, source token)
        order and counted in the layout.

    Returns:
      ``(recv_x, layout)``: ``recv_x`` [E // R, C, H] in x's dtype; rows of local expert e
      hold its tokens ordered by (source rank, source token), rows past
      ``layout.recv_counts[e]`` are zero. ``layout`` is the :class:`MoELayout` to pass to
      :func:`combine`. With check_vma both are typed varying over ``axis_name``.

    Raises:
      ValueError: E not divisible by R, negative capacity, bad shapes or dtypes.
      NameError: ``axis_name`` not bound by an enclosing shard_map.

    A token's row crosses the fabric at most once per destination rank (pulled from x's own
    buffer by the destination, then copied locally to the token's other experts there).
    Under ``jax.vmap`` (x, topk_idx or both batched) the batch is one routing over B * E
    experts, one native call per phase, with each element's slots and drops unchanged.
    """
    axes = lowering.axis_tuple(axis_name)
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    r = check_routing("dispatch", axes, num_experts, topk_idx, x)
    t, _ = x.shape
    if capacity is None:
        capacity = r * t
    if not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(
            f"strata_jax.moe.dispatch: capacity must be a non-negative int or "
            f"None, got {capacity!r}."
        )
    capacity = int(capacity)
    idx = lowering.pvary_missing(sanitize_ids(topk_idx, num_experts), axes)
    recv_counts, recv_dropped, dropped, slots, rows = _plan(idx, num_experts, capacity, axes)
    layout = MoELayout(
        recv_counts=recv_counts,
        recv_dropped=recv_dropped,
        dropped=dropped,
        slots=slots,
        rows=rows,
        topk_idx=idx,
        unique=_first_occurrence(idx),
        num_experts=int(num_experts),
        capacity=capacity,
        axis_name=tuple(axis_name) if isinstance(axis_name, list) else axis_name,
    )
    return _bind_dispatch(
        lowering.pvary_missing(x, axes), _no_weights(layout), layout, False
    ), layout


@_scoped("moe.combine", lambda expert_y, layout, topk_weights: (expert_y, topk_weights))
def combine(expert_y, layout: MoELayout, topk_weights):
    """Brings expert outputs back to their tokens, weighted and summed (DeepEP's ``combine``).

    Args:
      expert_y: [E // R, C, H] expert outputs in the row order of ``dispatch``'s ``recv_x``;
        float32, float64, bfloat16 or float16.
      layout: the :class:`MoELayout` of the matching :func:`dispatch`.
      topk_weights: [T, K] float weights of this rank's choices.

    Returns:
      y [T, H] in expert_y's dtype: ``y[t] = sum_k topk_weights[t, k] * expert_y[slot of
      (t, topk_idx[t, k])]``. Weights are applied here and only here; -1 choices and dropped
      pairs contribute 0; a token naming one expert twice gets the sum of both weights times
      that expert's row. Accumulates in float32 (float64 for float64). Differentiable w.r.t.
      expert_y and topk_weights, in reverse and forward mode (bilinear in the two).

    Raises:
      ValueError: shapes or dtypes that do not match the layout.

    The token's rank pulls each kept choice's row straight from the expert rank's buffer and
    sums them in one pass (expert ranks in rank order, choices in k order).
    """
    axes, expert_y, topk_weights = check_combine(
        "combine",
        layout,
        MoELayout,
        "dispatch",
        lambda r: layout.capacity,
        "capacity",
        expert_y,
        topk_weights,
    )
    w_acc = lowering.pvary_missing(topk_weights, axes).astype(acc_dtype(expert_y.dtype))
    return _bind_combine(lowering.pvary_missing(expert_y, axes), w_acc, layout)
