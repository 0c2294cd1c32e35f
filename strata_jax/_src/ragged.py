"""ragged_all_to_all: jax.lax.ragged_all_to_all as a strata primitive (XLA:CPU has none).

``jax.lax.ragged_all_to_all`` lowers to the HLO op ``ragged-all-to-all``, which XLA:CPU does
not implement ("HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), so
dropless MoE code written for TPU/GPU cannot run on CPU. This module gives the same function
(name, signature, semantics, errors of its abstract evaluation, JVP, transpose and batching
rule: ``jax/_src/lax/parallel.py`` of jax 0.10.2) over strata's fabric.

Algorithm: every rank publishes its operand and its plan (the four offset/size vectors as one
int64 [4, K] block) at the arrival barrier; each rank then *pulls* the slices destined to it
straight from the peers' operands into its own result, which XLA aliases to ``output`` (rows
nobody sends keep ``output``'s values). Zero-copy on the in-process and the shared-memory
fabric (Team interface, ``native/coll/ragged.cc``): one copy per row, by the receiver, and no
two ranks ever write the same buffer. A peer's ``send_sizes`` must equal the receiver's
``recv_sizes`` for that slice, and every slice must lie inside ``operand``/``output``: a
violation raises an error naming the slice (XLA leaves it undefined).

``axis_index_groups`` is supported (the native team is the index group); groups must cover
every axis index once and have equal sizes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import lowering
from strata_jax._src.jax_compat import ad, batching, core, hlo, ir

AxisName = Any

__all__ = ["empty", "ragged_all_to_all", "ragged_all_to_all_p"]

ragged_all_to_all_p = core.Primitive("strata_ragged_all_to_all")


def _canon_groups(axis_index_groups, n: int | None) -> tuple | None:
    if axis_index_groups is None:
        return None
    groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
    sizes = {len(g) for g in groups}
    flat = sorted(i for g in groups for i in g)
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"ragged_all_to_all: axis_index_groups {groups} must be non-empty groups of equal size."
        )
    if n is not None and flat != list(range(n)):
        raise ValueError(
            f"ragged_all_to_all: axis_index_groups {groups} must cover every index of the "
            f"axis (size {n}) exactly once."
        )
    return groups


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: AxisName,
    axis_index_groups=None,
) -> jax.Array:
    """Ragged all-to-all over ``axis_name``; drop-in for :func:`jax.lax.ragged_all_to_all`.

    Runs inside :func:`jax.shard_map`. With ``n`` ranks in the group and ``K`` slices (``K``
    divisible by ``n``, ``S = K // n`` slices per peer), rank ``r`` sends for every ``i``
    ``operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]`` to rank ``i // S``,
    which writes it at rows ``output_offsets[i] : output_offsets[i] + send_sizes[i]`` of its
    result. The result equals ``output`` except for the rows received: on rank ``r`` the
    slice from rank ``j`` number ``s`` lands at ``all_to_all(output_offsets)[j * S + s]``
    with size ``recv_sizes[j * S + s]``.

    Args:
      operand: [N, ...] rows to send, any dtype.
      output: [M, ...] (same trailing shape and dtype): the values of the rows not received.
        XLA aliases it to the result (no copy unless it is still used elsewhere).
      input_offsets, send_sizes, output_offsets, recv_sizes: [K] integer vectors (any integer
        dtypes), ``K >= 1`` a multiple of the group size. ``send_sizes`` on the sender must
        equal ``recv_sizes`` on the receiver for every slice.
      axis_name: mesh axis name or tuple of names.
      axis_index_groups: optional groups of axis indices (equal sizes, covering the axis
        once); the exchange then runs within each group, ranks numbered by position in it.

    Returns:
      [M, ...] array of ``output``'s dtype: ``output`` with the received rows written.

    Raises:
      ValueError: offsets/sizes not integer or not rank 1 with positive size (jax.lax's
        messages), mismatched operand/output shapes or dtypes, ``K`` not a multiple of the
        group size, bad ``axis_index_groups``; at run time, a slice out of bounds or a
        ``send_sizes``/``recv_sizes`` mismatch (an error naming the slice, never a value).
      NameError: ``axis_name`` not bound by an enclosing shard_map.

    Differentiable in ``operand`` and ``output`` (transpose: the reverse ragged exchange;
    the output's cotangent is zero on the received rows), batchable with ``jax.vmap``.
    Algorithm: receivers pull their slices straight from the peers' operands (module doc).
    """
    axes = lowering.axis_tuple(axis_name)
    groups = _canon_groups(axis_index_groups, None)
    args = [jnp.asarray(v) for v in (operand, output)] + [
        jnp.asarray(v) for v in (input_offsets, send_sizes, output_offsets, recv_sizes)
    ]
    if lowering.vma_on() and all(isinstance(v, core.Tracer) for v in args[:2]):
        vma = frozenset(axes).union(*(core.typeof(v).mat.varying for v in args))
        for k in (0, 1):
            missing = tuple(a for a in vma if a not in core.typeof(args[k]).mat.varying)
            if missing:
                args[k] = jax.lax.pcast(args[k], missing, to="varying")
    return ragged_all_to_all_p.bind(*args, axis_name=axes, axis_index_groups=groups, bounds=None)


# The four [K] operands after operand and output, in the primitive's order.
_SIZES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def _abstract_eval(operand, output, *sizes, axis_name, axis_index_groups, bounds):
    input_offsets, send_sizes, output_offsets, recv_sizes = sizes
    # The first checks and their messages are jax.lax.ragged_all_to_all's, in its order.
    for name, v in zip(_SIZES, sizes, strict=True):
        if not jnp.issubdtype(v.dtype, np.integer):
            raise ValueError(f"ragged_all_to_all {name} must be integer type.")
    for name, v in zip(_SIZES, sizes, strict=True):
        if len(v.shape) != 1 or v.shape[0] < 1:
            raise ValueError(
                f"ragged_all_to_all {name} must be rank 1 with positive dimension size, "
                f"but got shape {v.shape}"
            )
    lowering.check_axis_names(axis_name, "ragged_all_to_all")
    k = input_offsets.shape[0]
    if {send_sizes.shape[0], output_offsets.shape[0], recv_sizes.shape[0]} != {k}:
        raise ValueError(
            "ragged_all_to_all: input_offsets, send_sizes, output_offsets and recv_sizes must "
            f"have one length, got {input_offsets.shape}, {send_sizes.shape}, "
            f"{output_offsets.shape}, {recv_sizes.shape}"
        )
    if operand.ndim < 1 or operand.ndim != output.ndim or operand.shape[1:] != output.shape[1:]:
        raise ValueError(
            "ragged_all_to_all: operand and output must be [N, ...] and [M, ...] with the same "
            f"trailing shape, got {operand.shape} and {output.shape}"
        )
    if operand.dtype != output.dtype:
        raise ValueError(
            f"ragged_all_to_all: operand ({operand.dtype}) and output ({output.dtype}) must "
            "have one dtype"
        )
    n = lowering.axis_size(axis_name)
    groups = _canon_groups(axis_index_groups, n)
    g = len(groups[0]) if groups else n
    if k % g:
        raise ValueError(f"ragged_all_to_all: {k} slices is not a multiple of the group size {g}")
    out = output.update(shape=output.shape, weak_type=False)
    if lowering.vma_on():
        vma = frozenset(axis_name).union(operand.mat.varying, output.mat.varying)
        out = out.update(manual_axis_type=out.mat.update(varying=vma))
    return out, lowering.effects(axis_name)


def _lowering(ctx, operand, output, *sizes, axis_name, axis_index_groups, bounds):
    base = lowering.mesh_groups(ctx, axis_name, "ragged_all_to_all")  # [G, n]: the axis groups
    if axis_index_groups:
        # Each index group of each axis group is a team of its own: rank = position in it.
        groups = np.asarray([row[list(g)] for row in base for g in axis_index_groups], np.int64)
    else:
        groups = base
    # One int64 [4, K] plan (input_offsets, send_sizes, output_offsets, recv_sizes): the one
    # buffer a peer reads to find its slices, whatever integer types the caller used.
    i64 = ir.IntegerType.get_signless(64)
    rows = []
    for v, aval in zip(sizes, ctx.avals_in[2:], strict=True):
        k = aval.shape[0]
        conv = hlo.convert(ir.RankedTensorType.get([k], i64), v)
        rows.append(hlo.reshape(ir.RankedTensorType.get([1, k], i64), conv))
    plan = hlo.concatenate(rows, ir.IntegerAttr.get(i64, 0))
    k = ctx.avals_in[2].shape[0]
    sub = ctx.replace(
        avals_in=[ctx.avals_in[0], ctx.avals_in[1], core.ShapedArray((4, k), np.dtype(np.int64))]
    )
    return lowering.lower_strata_call(
        sub,
        "strata_ragged_all_to_all",
        "ragged_all_to_all",
        [operand, output, plan],
        groups,
        operand_output_aliases={1: 0},
        # Per-slice row bounds [4, K] set by the batching rule (each slice inside its own
        # batch element); [-1]: the whole operand and output.
        bounds=np.asarray(bounds if bounds is not None else (-1,), np.int64).ravel(),
    )


def _jvp(primals, tangents, **params):
    operand, output, *plan = primals
    operand_dot, output_dot, *_ = tangents
    result = ragged_all_to_all_p.bind(operand, output, *plan, **params)
    if type(operand_dot) is type(output_dot) is ad.Zero:
        return result, ad.p2tz(result)
    operand_dot = ad.instantiate_zeros(operand_dot)
    output_dot = ad.instantiate_zeros(output_dot)
    return result, ragged_all_to_all_p.bind(operand_dot, output_dot, *plan, **params)


def empty(shape: int | tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """An array of ``shape`` and ``dtype`` whose values are whatever its buffer held.

    :func:`jax.lax.empty` is a zero fill on XLA:CPU (a broadcast of 0 that XLA writes out);
    this is an XLA custom call that writes nothing. Its use: the ``output`` of
    :func:`ragged_all_to_all` when the rows nobody sends are never read, so that the exchange
    costs only the rows it moves (an 8 MiB zero fill took 0.7 ms on this project's machine,
    as long as copying 5.3 MiB: docs/guide/recsys.md).

    Works inside and outside ``jax.jit`` and :func:`jax.shard_map` (there it is the device's
    own, unvarying array, as ``jnp.zeros`` would be). The values are unspecified (left-over
    bytes: they may be NaN or infinite for floats); never read a row you did not write.

    Args:
      shape: int or tuple of non-negative ints.
      dtype: any dtype XLA:CPU supports (default float32).

    Returns:
      An array of ``shape`` and ``dtype`` with unspecified values.

    Raises:
      TypeError: a dimension that is not an integer (``2.5``, ``"3"``: jax's own message, as
        :func:`jax.numpy.zeros` gives).
      ValueError: a negative dimension.
    """
    from strata_jax._src import runtime

    shape = core.canonicalize_shape((shape,) if isinstance(shape, int | np.integer) else shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"strata_jax.empty: negative dimension in shape {shape}")
    runtime.native()  # the custom call's target is registered with the extension
    return jax.ffi.ffi_call("strata_empty", jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))()


def _exchange(v, axis_name, groups):
    """Tiled all_to_all of a [K] integer vector within the groups, as a ragged exchange."""
    k = v.shape[0]
    n = len(groups[0]) if groups else lowering.axis_size(axis_name)
    per = k // n
    me = jax.lax.axis_index(axis_name)
    if groups:
        pos = np.zeros(sum(len(g) for g in groups), np.int32)
        for g in groups:
            for p, i in enumerate(g):
                pos[i] = p
        me = jnp.asarray(pos)[me]
    i = jnp.arange(k, dtype=jnp.int32)
    ones = jnp.ones((k,), jnp.int32)
    return ragged_all_to_all_p.bind(
        v,
        jnp.zeros_like(v),
        i,
        ones,
        me.astype(jnp.int32) * per + i % per,
        ones,
        axis_name=axis_name,
        axis_index_groups=groups,
        bounds=None,
    )


def _transpose(
    t,
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    axis_index_groups,
    bounds,
):
    if type(t) is ad.Zero:
        operand_t = ad.Zero(operand.aval) if ad.is_undefined_primal(operand) else None
        output_t = ad.Zero(output.aval) if ad.is_undefined_primal(output) else None
        return [operand_t, output_t] + [None] * 4
    op_aval = operand.aval if ad.is_undefined_primal(operand) else core.typeof(operand)
    zero = jnp.zeros(op_aval.shape, op_aval.dtype)
    if lowering.vma_on():
        missing = tuple(
            a for a in core.typeof(t).mat.varying if a not in core.typeof(zero).mat.varying
        )
        if missing:
            zero = jax.lax.pcast(zero, missing, to="varying")
    # Where this rank's received rows sit (in its output) and where they came from (in the
    # sender's operand): the plan of the reverse exchange.
    out_off = _exchange(output_offsets, axis_name, axis_index_groups)
    in_off = _exchange(input_offsets, axis_name, axis_index_groups)
    operand_t = ragged_all_to_all_p.bind(
        t,
        zero,
        out_off,
        recv_sizes,
        in_off,
        send_sizes,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        # The reverse exchange keeps each slice's batch element; operand and output swap.
        bounds=None
        if bounds is None
        else (*bounds[len(bounds) // 2 :], *bounds[: len(bounds) // 2]),
    )
    # Rows of `output` that were overwritten get no cotangent. Boundary counts with adds (not
    # sets), so empty and adjacent slices are exact.
    m = t.shape[0]
    starts = out_off.astype(jnp.int32)
    ends = starts + recv_sizes.astype(jnp.int32)
    edges = (
        jnp.zeros((m + 1,), jnp.int32).at[starts].add(1, mode="drop").at[ends].add(-1, mode="drop")
    )
    covered = (jnp.cumsum(edges)[:m] > 0).reshape((m,) + (1,) * (t.ndim - 1))
    output_t = jnp.where(covered, jnp.zeros_like(t), t)
    return [
        operand_t if ad.is_undefined_primal(operand) else None,
        output_t if ad.is_undefined_primal(output) else None,
    ] + [None] * 4


def _batcher(axis_data, vals_in, dims_in, *, axis_name, axis_index_groups, bounds):
    if all(d is None for d in dims_in) and axis_data.name not in axis_name:
        out = ragged_all_to_all_p.bind(
            *vals_in, axis_name=axis_name, axis_index_groups=axis_index_groups, bounds=bounds
        )
        return out, None
    if axis_data.name in axis_name:
        raise NotImplementedError(
            "strata_jax.ragged_all_to_all over a vmapped axis name is not supported (neither "
            "is it in jax.lax); exchange over a mesh axis of jax.shard_map instead."
        )
    size = axis_data.size

    def bdim_at_second(x, d):
        # [K, B]: the merged [K * B] plan keeps the slices to one peer together, so slice
        # k * B + b still goes to peer k // S (groups are unaffected: one device's data).
        return batching.broadcast(x, size, 1, None) if d is None else jnp.moveaxis(x, d, 1)

    operand, output = (
        batching.bdim_at_front(v, d, size) for v, d in zip(vals_in[:2], dims_in[:2], strict=True)
    )
    n_rows, m_rows = operand.shape[1], output.shape[1]
    io, ss, oo, rs = (bdim_at_second(v, d) for v, d in zip(vals_in[2:], dims_in[2:], strict=True))
    io = io + (jnp.arange(size, dtype=io.dtype) * n_rows)[None, :]
    oo = oo + (jnp.arange(size, dtype=oo.dtype) * m_rows)[None, :]
    merged = [v.reshape(-1, *v.shape[2:]) for v in (operand, output, io, ss, oo, rs)]
    out = ragged_all_to_all_p.bind(
        *merged,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        bounds=_batched_bounds(bounds, io.shape[0], size, n_rows, m_rows),
    )
    return out.reshape(size, -1, *out.shape[1:]), 0


def _batched_bounds(bounds, k: int, size: int, n_rows: int, m_rows: int) -> tuple:
    """Row bounds of the merged slices (slice k' * size + b: batch element b): a slice must
    stay inside its own element's rows, not run into the next one's ([4 * K * size] ints:
    operand lo, operand hi, output lo, output hi; each over the merged slices)."""
    if bounds is None:
        inner = np.array([[0] * k, [n_rows] * k, [0] * k, [m_rows] * k], np.int64)
    else:
        inner = np.asarray(bounds, np.int64).reshape(4, k)
    b = np.arange(size, dtype=np.int64)
    shift = np.stack([b * n_rows, b * n_rows, b * m_rows, b * m_rows])  # [4, size]
    merged = inner[:, :, None] + shift[:, None, :]  # [4, K, size]
    return tuple(int(v) for v in merged.ravel())


def _impl(*args, **kwargs):
    raise RuntimeError(
        "ragged_all_to_all must be used within a mapped context like vmap or shard_map."
    )


ragged_all_to_all_p.def_impl(_impl)
lowering.register(
    ragged_all_to_all_p,
    _abstract_eval,
    _lowering,
    transpose=_transpose,
    jvp=_jvp,
    batcher=_batcher,
)
