"""Collectives as JAX primitives lowered to strata's XLA FFI custom calls.

Each operator is one primitive with its public function, abstract evaluation, lowering,
batching rule and transpose rule side by side (the layout of ``jax/_src/lax/parallel.py``).
The public functions have the names, signatures and semantics of ``jax.lax``: replacing
``jax.lax.X`` by ``strata_jax.X`` inside ``jax.shard_map`` changes nothing but speed.

The native handlers read and write the participants' own XLA buffers (zero-copy). Where a
rank sits in a collective is computed at run time from its partition id, an operand emitted
by the program itself, and the mesh shape, so groups over any subset of a multi-axis mesh work.
A group whose devices span several fabric domains (hosts) is lowered hierarchically instead:
strata inside each fabric, XLA's own collectives between (``hierarchy/``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import debug, hierarchy, lowering, operators, topology
from strata_jax._src.jax_compat import ad, core, mlir

AxisName = Any

# jax.lax's own collectives, bound before strata_jax.enable() can redirect the jax.lax names.
_LAX = {n: getattr(jax.lax, n) for n in ("psum", "pmax", "pmin", "all_gather")}


def _constant_pprod(v, axis_name):
    """pprod of a value that is the same on every rank (jax.lax has no pprod): its n-th power
    for a group of n, multiplied out in rank order as the kernels do."""
    n = lowering.axis_size(lowering.axis_tuple(axis_name))
    v = jnp.asarray(v)
    out = v
    for _ in range(n - 1):
        out = out * v
    return out


_LAX["pprod"] = _constant_pprod


# --------------------------------------------------------------------------------------
# Helpers of the collectives here (the ones every primitive shares: lowering.py)
# --------------------------------------------------------------------------------------


def _canon_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim - 0}.")
    return axis % ndim


def ffi_call_lowering(target: str, api: str):
    """Lowering over mesh axes: operands (x, partition_id), groups as jax.lax forms them."""

    def lower(ctx, x, *, axes, **attrs):
        # A group that spans fabric domains: strata inside each, XLA's collectives between.
        split = hierarchy.lower_across_fabrics(ctx, x, target, axes, attrs)
        if split is not None:
            return split
        return lowering.lower_strata_call(
            ctx, target, api, [x], lowering.mesh_groups(ctx, axes, api), **attrs
        )

    return lower


def _tree_map(f, x):
    return jax.tree_util.tree_map(f, x)


def _axis_arg(args, kwargs):
    return args[1] if len(args) > 1 else kwargs.get("axis_name")


def _scope(api: str, x) -> str:
    """``strata.<api>``; with several fabrics (hosts) and one array x, also x's dtype and shape
    as the user passed it (hierarchy.user_scope), which an error of the check across fabrics
    shows (the hierarchical form may move axes or widen the dtype first)."""
    if topology.num_fabrics() > 1 and hasattr(x, "shape") and hasattr(x, "dtype"):
        return hierarchy.user_scope(api, x)
    return f"strata.{api}"


def _profiled(api: str):
    """Names the ops of a public function ``strata.<api>`` (jax.named_scope): the name shows
    in the HLO's op_name metadata and in jax.profiler traces next to the compute."""

    def deco(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            if debug.level():
                debug.on_trace(api, args[0] if args else kwargs.get("x"), _axis_arg(args, kwargs))
            with jax.named_scope(_scope(api, args[0] if args else kwargs.get("x"))):
                return f(*args, **kwargs)

        return wrapped

    return deco


# Element types the native kernels move and reduce. Every other dtype jax.lax accepts (int2/int4,
# uint2/uint4, the float8 and float4 families) travels widened: floats as float32 (so sums
# accumulate in float32 and round once, like bfloat16), integers as int32/uint32 (sums wrap
# when cast back, as in jax.lax). Moving data widened is exact both ways.
NATIVE_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        jnp.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)


def widen(v, api: str):
    """Returns (v in a dtype the native kernels handle, the dtype to cast back to or None)."""
    dt = np.dtype(v.dtype)
    if dt in NATIVE_DTYPES:
        return v, None
    if jnp.issubdtype(dt, jnp.floating):
        wide = np.float32
    elif jnp.issubdtype(dt, jnp.signedinteger):
        wide = np.int32
    elif jnp.issubdtype(dt, jnp.unsignedinteger):
        wide = np.uint32
    else:
        names = ", ".join(sorted(str(d) for d in NATIVE_DTYPES))
        raise TypeError(
            f"strata_jax.{api} does not support dtype {dt}; supported: {names}, and the narrow "
            "int/uint/float types (int4, float8_e4m3fn, ...), which travel widened."
        )
    return v.astype(wide), dt


def _narrow(y, dt):
    return y if dt is None else y.astype(dt)


def _typed_unreduced_or_reduced(v) -> bool:
    if not isinstance(v, core.Tracer):
        return False
    mat = core.typeof(v).mat
    return bool(mat.unreduced or mat.reduced)


# --------------------------------------------------------------------------------------
# all-reduce: psum / pmax / pmin / pprod (and pmean)
# --------------------------------------------------------------------------------------

_REDUCE_CODES = operators.REDUCE_CODES_BY_KIND  # sum 0, max 1, min 2, mean 3, prod 4
# The dtypes whose pmean the native reduction divides itself (kernels.h ReduceOp::kMean); every
# other dtype is psum'd and then divided by XLA, as jax.lax.pmean does.
_MEAN_DTYPES = frozenset(np.dtype(t) for t in (np.float16, jnp.bfloat16, np.float32, np.float64))

# One primitive for a whole pytree (or any several operands of one op over one group):
# multiple_results, as jax.lax's psum_p. It lowers to one custom call with one rendezvous
# (strata_all_reduce_list), as XLA's combiner makes one all-reduce of a pytree's leaves.
all_reduce_p = core.Primitive("strata_all_reduce")
all_reduce_p.multiple_results = True


def _all_reduce(x, axis_name, axis_index_groups, reduce: str, api: str):
    axes = lowering.axis_tuple(axis_name)
    lowering.check_no_groups(axis_index_groups, api)
    if not axes:
        return x
    leaves, tree = jax.tree_util.tree_flatten(x)
    outs = list(leaves)
    operands = []  # (leaf index, operand, dtype to cast back to)
    for i, v in enumerate(leaves):
        if not isinstance(v, core.Tracer):
            # A constant has no per-device values: jax.lax computes the answer from the axis
            # size alone (e.g. psum(1, 'x') is the axis size); so do we.
            outs[i] = _LAX[api](v, axis_name)
            continue
        if _typed_unreduced_or_reduced(v):
            # jax.lax's types for sums left unreduced by the partitioner: only it lowers them.
            outs[i] = _LAX[api](v, axis_name)
            continue
        if reduce == "sum" and v.dtype == np.bool_:
            v = v.astype(np.int32)
        if jnp.issubdtype(v.dtype, jnp.complexfloating) and reduce == "prod":
            raise TypeError(
                f"strata_jax.pprod multiplies real numbers only; got {v.dtype}. Multiply complex "
                "numbers with jnp.prod(jax.lax.all_gather(x, axis_name), axis=0)."
            )
        if jnp.issubdtype(v.dtype, jnp.complexfloating) and reduce != "sum":
            raise TypeError(f"strata_jax.{api} does not order complex numbers; got {v.dtype}.")
        lowering.check_axis_names(axes, api)
        v, dt = widen(lowering.pvary_missing(v, axes), api)
        operands.append((i, v, dt))
    if operands:
        ys = all_reduce_p.bind(
            *(v for _, v, _ in operands), axes=axes, reduce=reduce, invariant=lowering.vma_on()
        )
        for (i, _, dt), y in zip(operands, ys, strict=True):
            outs[i] = _narrow(y, dt)
    return jax.tree_util.tree_unflatten(tree, outs)


@_profiled("psum")
def psum(x, axis_name: AxisName, *, axis_index_groups=None):
    """All-reduce sum of ``x`` over the mesh axis (or tuple of axes) ``axis_name``.

    Drop-in for :func:`jax.lax.psum` inside :func:`jax.shard_map`.

    Args:
      x: array or pytree of arrays, any shape (0-d and zero-size included) and any dtype
        jax.lax.psum accepts; bool is summed as int32 (as jax.lax does). Narrow types
        (int4/uint4/int2/uint2, float8_*, float4_*) are summed in int32/uint32/float32 and cast
        back once (integer sums wrap; float sums round once).
      axis_name: a mesh axis name or a tuple of them (any subset of a multi-axis mesh); the
        group is every device that shares the coordinates of the other mesh axes.
      axis_index_groups: not supported (raises NotImplementedError).

    Returns:
      The sum over the group, same shape and dtype as ``x`` (int32 for bool), bitwise
      identical on every rank. float16/bfloat16 accumulate in float32 and round once; integer
      sums wrap. With ``check_vma`` on the result is invariant over ``axis_name``.

    Raises:
      NameError: an axis name is not bound by an enclosing shard_map.
      NotImplementedError: ``axis_index_groups`` given, or not inside shard_map.

    Algorithm: one-shot (every rank reduces all peers' inputs) below the two-shot threshold,
    else two-shot (reduce-scatter into the own output, then gather the reduced chunks straight
    from the peers' outputs), chunks even and cache-line aligned (StrataCL, Hu et al. 2026).
    """
    return _all_reduce(x, axis_name, axis_index_groups, "sum", "psum")


@_profiled("pmax")
def pmax(x, axis_name: AxisName, *, axis_index_groups=None):
    """All-reduce maximum over ``axis_name``; drop-in for :func:`jax.lax.pmax`.

    Shapes, dtypes and errors as :func:`psum` (complex raises TypeError; bool is OR).
    Starts from the type's identity and propagates NaN whatever the rank order (IEEE-754
    maximum). This deliberately differs from jax.lax.pmax on XLA CPU, which can drop a NaN.
    """
    return _all_reduce(x, axis_name, axis_index_groups, "max", "pmax")


@_profiled("pmin")
def pmin(x, axis_name: AxisName, *, axis_index_groups=None):
    """All-reduce minimum over ``axis_name``; drop-in for :func:`jax.lax.pmin`.

    As :func:`pmax` with minimum (bool is AND); NaN propagates.
    """
    return _all_reduce(x, axis_name, axis_index_groups, "min", "pmin")


@_profiled("pmean")
def pmean(x, axis_name: AxisName, *, axis_index_groups=None):
    """All-reduce mean over ``axis_name``; drop-in for :func:`jax.lax.pmean`.

    Args and shapes as :func:`psum`; returns ``psum(x) / n`` with n the group size (integer
    inputs give floats, as jax.lax), bitwise as XLA CPU divides: the sum rounded to x's dtype,
    then multiplied by 1/n.
    Errors as :func:`psum`.

    float16, bfloat16, float32 and float64 leaves are divided inside strata's reduction, as
    it stores its result (one pass over the output, not one more after it); other dtypes, and
    groups that span fabrics (hosts), are psum'd and then divided by XLA.
    """
    lowering.check_no_groups(axis_index_groups, "pmean")
    axes = lowering.axis_tuple(axis_name)
    if not axes:
        return x
    leaves, tree = jax.tree_util.tree_flatten(x)
    outs = list(leaves)
    fused = [
        i
        for i, v in enumerate(leaves)
        if isinstance(v, core.Tracer)
        and np.dtype(v.dtype) in _MEAN_DTYPES
        and not _typed_unreduced_or_reduced(v)
    ]
    rest = [i for i in range(len(leaves)) if i not in set(fused)]
    if fused:
        lowering.check_axis_names(axes, "pmean")
        ys = all_reduce_p.bind(
            *(lowering.pvary_missing(leaves[i], axes) for i in fused),
            axes=axes,
            reduce="mean",
            invariant=lowering.vma_on(),
        )
        for i, y in zip(fused, ys, strict=True):
            outs[i] = y
    if rest:
        n = lowering.axis_size(axes)
        ys = psum([leaves[i] for i in rest], axis_name)
        for i, y in zip(rest, ys, strict=True):
            outs[i] = y / n
    return jax.tree_util.tree_unflatten(tree, outs)


@_profiled("pprod")
def pprod(x, axis_name: AxisName, *, axis_index_groups=None):
    """All-reduce product of ``x`` over ``axis_name`` (jax.lax has no pprod).

    The all-reduce with NCCL's ``ncclProd`` and MPI's ``MPI_PROD``: every rank gets
    ``x_0 * x_1 * ... * x_{n-1}``, multiplied in rank order whatever the rank, so bitwise the
    same on every rank and equal to ``jnp.prod(jax.lax.all_gather(x, axis_name), axis=0)`` up to
    that order.

    Args:
      x: array or pytree of arrays, any shape (0-d and zero-size included); real dtypes
        (complex raises TypeError). bool multiplies as logical AND (numpy's ``np.multiply``)
        and stays bool. Narrow types (int4, float8_*, ...) multiply in int32/uint32/float32
        and are cast back once.
      axis_name: a mesh axis name or a tuple of them, as :func:`psum`.
      axis_index_groups: not supported (raises NotImplementedError).

    Returns:
      The product over the group, same shape and dtype as ``x``. Integer products wrap (as
      numpy's); float16/bfloat16 multiply in float32 and round once.

    Raises:
      NameError: an axis name is not bound by an enclosing shard_map.
      NotImplementedError: ``axis_index_groups`` given, or not inside shard_map; under
        differentiation (as mpi4jax's allreduce, only sums differentiate: differentiate
        ``jnp.prod(jax.lax.all_gather(x, axis_name), axis=0)`` instead).
      TypeError: a complex ``x``.

    Algorithm: the all-reduce of :func:`psum` (one-shot or two-shot, StrataCL, Hu et al. 2026)
    with multiplication as its reduction.
    """
    return _all_reduce(x, axis_name, axis_index_groups, "prod", "pprod")


def _all_reduce_abstract_eval(*avals, axes, reduce, invariant):
    api = "pmean" if reduce == "mean" else "psum"
    lowering.check_axis_names(axes, api)
    outs = []
    for aval in avals:
        if invariant:
            lowering.require_varying(api, aval, axes)
            aval = lowering.varying_out(aval, (a for a in aval.mat.varying if a not in axes))
        outs.append(aval)
    return outs, lowering.effects(axes)


def _all_reduce_transpose(cts, *xs, axes, reduce, invariant):
    if reduce not in ("sum", "mean"):
        raise NotImplementedError(f"p{reduce} is not linear")
    out = [ad.Zero(x.aval.to_ct_aval()) if ad.is_undefined_primal(x) else None for x in xs]
    live = [k for k, ct in enumerate(cts) if type(ct) is not ad.Zero]
    if invariant:
        # psum: varying -> invariant; its transpose only casts back to varying (pmean's then
        # divides by the group size, as the transpose of jax.lax.pmean's divide does).
        n = lowering.axis_size(axes) if reduce == "mean" else 1
        for k in live:
            ct = jax.lax.pcast(cts[k], axes, to="varying")
            out[k] = ct / np.asarray(n, ct.dtype) if reduce == "mean" else ct
    elif live:
        # Without vma, psum is psum + broadcast, so the transpose reduces again (as jax.lax),
        # all the nonzero cotangents in one call; pmean's transpose is pmean.
        ys = all_reduce_p.bind(*(cts[k] for k in live), axes=axes, reduce=reduce, invariant=False)
        for k, y in zip(live, ys, strict=True):
            out[k] = y
    return out


def _local_reduce(v, d, reduce):
    if reduce == "sum":
        return jax.lax.reduce(v, np.zeros((), v.dtype), jax.lax.add, (d,))
    if reduce == "prod":
        return jax.lax.reduce(v, np.ones((), v.dtype), jax.lax.mul, (d,))
    if reduce == "max":
        return jnp.max(v, axis=d)
    return jnp.min(v, axis=d)


def _all_reduce_batcher(axis_data, vals_in, dims_in, *, axes, reduce, invariant):
    if reduce == "mean" and axis_data.name in axes:
        # The sum over the batched axis and the rest, then one divide by the whole group's
        # size: bitwise what jax.lax.pmean (psum, then divide) gives under vmap.
        rest = tuple(a for a in axes if a != axis_data.name)
        n = axis_data.size * (lowering.axis_size(rest) if rest else 1)
        sums, dims = _all_reduce_batcher(
            axis_data, vals_in, dims_in, axes=axes, reduce="sum", invariant=invariant
        )
        return [s / np.asarray(n, s.dtype) for s in sums], dims
    if axis_data.name not in axes:
        return all_reduce_p.bind(*vals_in, axes=axes, reduce=reduce, invariant=invariant), list(
            dims_in
        )
    rest = tuple(a for a in axes if a != axis_data.name)
    outs = []
    for v, d in zip(vals_in, dims_in, strict=True):
        if d is None:
            if reduce == "sum":
                v = v * np.asarray(axis_data.size, v.dtype)
            elif reduce == "prod":  # the same value on each of the batched ranks
                v = functools.reduce(jax.lax.mul, [v] * axis_data.size)
            outs.append(v)
        else:
            outs.append(_local_reduce(v, d, reduce))
    if rest:
        outs = all_reduce_p.bind(*outs, axes=rest, reduce=reduce, invariant=invariant)
    return list(outs), [None] * len(outs)


def _all_reduce_lowering(ctx, *xs, axes, reduce, invariant):
    code = np.int32(_REDUCE_CODES[reduce])
    if reduce == "mean" and hierarchy.plan(ctx, axes) is not None:
        # Across fabrics: the hierarchical psum, then XLA's divide (its steps reduce partial
        # sums, which no step can divide by the group size).
        n = int(lowering.mesh_groups(ctx, axes, "pmean").shape[1])

        def sum_then_divide(*vs):
            ys = all_reduce_p.bind(*vs, axes=axes, reduce="sum", invariant=invariant)
            return [y / np.asarray(n, y.dtype) for y in ys]

        return mlir.lower_fun(sum_then_divide, multiple_results=True)(ctx, *xs)
    if len(xs) == 1:
        # One result either way (the call's, or the hierarchical lowering's).
        api = "pmean" if reduce == "mean" else "psum"
        return ffi_call_lowering("strata_all_reduce", api)(ctx, xs[0], axes=axes, reduce=code)
    if hierarchy.plan(ctx, axes) is not None:
        # Across fabrics: the hierarchical all-reduce (hierarchy/) takes one operand; each
        # leaf is lowered as its own call there.
        def per_leaf(*vs):
            return [
                all_reduce_p.bind(v, axes=axes, reduce=reduce, invariant=invariant)[0] for v in vs
            ]

        return mlir.lower_fun(per_leaf, multiple_results=True)(ctx, *xs)
    return lowering.lower_strata_call(
        ctx,
        "strata_all_reduce_list",
        "pmean" if reduce == "mean" else "psum",
        list(xs),
        lowering.mesh_groups(ctx, axes, "psum"),
        reduce=code,
        num_operands=np.int64(len(xs)),
    )


def _all_reduce_jvp(primals, tangents, *, axes, reduce, invariant):
    if reduce == "prod":
        raise NotImplementedError(
            "Differentiation rule for strata_jax.pprod is not implemented; differentiate "
            "jnp.prod(jax.lax.all_gather(x, axis_name), axis=0) instead."
        )
    if reduce not in ("sum", "mean"):
        raise NotImplementedError(
            f"Differentiation rule for strata_jax.p{reduce} is not implemented (jax.lax.p{reduce} "
            f"has none either); differentiate p{reduce}(stop_gradient(x)) or write the "
            "selection with psum."
        )
    # The primals in one call, the nonzero tangents in another (linearization must be able to
    # tell the known primal results from the tangents).
    outs = all_reduce_p.bind(*primals, axes=axes, reduce=reduce, invariant=invariant)
    live = [k for k, t in enumerate(tangents) if type(t) is not ad.Zero]
    t_out = [ad.Zero(core.typeof(y).to_tangent_aval()) for y in outs]
    if live:
        touts = all_reduce_p.bind(
            *(tangents[k] for k in live), axes=axes, reduce=reduce, invariant=invariant
        )
        for k, t in zip(live, touts, strict=True):
            t_out[k] = t
    return outs, t_out


lowering.register(
    all_reduce_p,
    _all_reduce_abstract_eval,
    _all_reduce_lowering,
    linear_transpose=_all_reduce_transpose,
    jvp=_all_reduce_jvp,
    batcher=_all_reduce_batcher,
)


# --------------------------------------------------------------------------------------
# all_gather (primitive gathers along dimension 0, tiled)
# --------------------------------------------------------------------------------------

all_gather_p = core.Primitive("strata_all_gather")


@_profiled("all_gather")
def all_gather(
    x,
    axis_name: AxisName,
    *,
    axis_index_groups=None,
    axis: int = 0,
    tiled: bool = False,
    to: str = "varying",
):
    """Gathers ``x`` from every rank of ``axis_name``; drop-in for :func:`jax.lax.all_gather`.

    Args:
      x: array or pytree, any dtype. Untiled: shape ``s`` -> ``s`` with a new axis of size n
        inserted at ``axis`` (a 0-d x gives shape (n,)). Tiled: ``axis`` of size m becomes
        n*m, rank j's block at [j*m, (j+1)*m).
      axis_name: mesh axis name or tuple of names (ranks ordered as jax.lax.axis_index of
        the tuple).
      axis: where to gather (negative counts from the end).
      tiled: see above.
      to: the result's manual axis type, as jax.lax: ``"varying"`` (default), ``"invarying"``
        (invariant over ``axis_name``; jax.lax's all_gather_invariant, whose transpose is a
        slice) or ``"reduced"`` (typed reduced; this one runs on jax.lax).

    Raises:
      ValueError: tiled gather of a 0-d array, ``axis`` out of range, or an unknown ``to``.
      NameError / NotImplementedError: as :func:`psum`.

    Each rank copies every peer's input straight into its own output (one copy per byte).
    ``to="invarying"`` is a strata psum of the input placed in its block of a zero array (the
    one way to an invariant result without a cast JAX forbids): twice the bytes of a gather.
    """
    if to not in ("varying", "invarying", "reduced"):
        raise ValueError(
            f"all_gather: to={to!r}; expected 'varying', 'invarying' or 'reduced' (as jax.lax)."
        )
    axes = lowering.axis_tuple(axis_name)
    lowering.check_no_groups(axis_index_groups, "all_gather")
    if not axes:
        return x
    if to == "reduced":
        return _LAX["all_gather"](x, axis_name, axis=axis, tiled=tiled, to="reduced")
    if to == "invarying":
        return _tree_map(lambda v: _all_gather_invariant(v, axis_name, axes, axis, tiled), x)

    def leaf(v):
        v = jnp.asarray(v)
        if _typed_unreduced_or_reduced(v):
            return _LAX["all_gather"](v, axis_name, axis=axis, tiled=tiled)
        lowering.check_axis_names(axes, "all_gather")
        if tiled and v.ndim == 0:
            raise ValueError(
                "tiled all_gather of a 0-d array is undefined; use tiled=False "
                "or reshape x to (1,) first."
            )
        ax = _canon_axis(axis, v.ndim if tiled else v.ndim + 1, "axis")
        v, dt = widen(lowering.pvary_missing(v, axes), "all_gather")
        n = lowering.axis_size(axes)
        # Gathered in place along `ax` (untiled: the new axis is made by the call itself): no
        # transpose, reshape or copy before or after.
        y = all_gather_p.bind(v, axes=axes, axis_size=n, dimension=ax, tiled=tiled)
        return _narrow(y, dt)

    return _tree_map(leaf, x)


def _all_gather_invariant(v, axis_name, axes: tuple, axis: int, tiled: bool):
    v = jnp.asarray(v)
    lowering.check_axis_names(axes, "all_gather")
    if tiled and v.ndim == 0:
        raise ValueError("tiled all_gather of a 0-d array is undefined; use tiled=False.")
    ax = _canon_axis(axis, v.ndim if tiled else v.ndim + 1, "axis")
    if not tiled:
        v = jnp.expand_dims(v, ax)
    n = lowering.axis_size(axes)
    m = v.shape[ax]
    shape = (*v.shape[:ax], n * m, *v.shape[ax + 1 :])
    # Rank i's block at [i*m, (i+1)*m) of a zero array, summed over the group: the gather, typed
    # invariant by the psum. Index in mesh order, as jax.lax.axis_index of the tuple.
    placed = jax.lax.dynamic_update_slice_in_dim(
        lowering.pvary_missing(jnp.zeros(shape, v.dtype), axes),
        lowering.pvary_missing(v, axes),
        jax.lax.axis_index(axis_name) * m,
        ax,
    )
    return psum(placed, axis_name)


def _all_gather_abstract_eval(aval, *, axes, axis_size, dimension, tiled):
    lowering.check_axis_names(axes, "all_gather")
    lowering.require_varying("all_gather", aval, axes)
    shape = list(aval.shape)
    if tiled:
        shape[dimension] *= axis_size
    else:
        shape.insert(dimension, axis_size)
    return aval.update(shape=tuple(shape)), lowering.effects(axes)


def _all_gather_transpose(ct, x, *, axes, axis_size, dimension, tiled):
    return [
        psum_scatter_p.bind(ct, axes=axes, axis_size=axis_size, dimension=dimension, tiled=tiled)
    ]


def _batched_dimension(d: int, dimension: int, tiled: bool, inserts: int) -> tuple[int, int]:
    """(the operated dimension, the result's batch dimension) when the batch dimension of the
    operand is ``d`` and the per-example operated dimension is ``dimension``. ``inserts``: +1
    when the untiled operation inserts that dimension (all_gather), -1 when it removes it
    (psum_scatter), 0 when tiled (sizes change in place)."""
    if d <= dimension:
        return dimension + 1, d
    return dimension, d + (0 if tiled else inserts)


def _all_gather_batcher(axis_data, vals_in, dims_in, *, axes, axis_size, dimension, tiled):
    (v,), (d,) = vals_in, dims_in
    if axis_data.name in axes:
        if axes != (axis_data.name,):
            raise NotImplementedError(
                "strata_jax.all_gather over a vmapped axis together with mesh axes is not "
                "supported; gather the vmapped axis with jnp first."
            )
        if d is None:
            v = jnp.broadcast_to(v[None], (axis_size, *v.shape))
            d = 0
        parts = list(jnp.moveaxis(v, d, 0))
        out = jnp.concatenate(parts, dimension) if tiled else jnp.stack(parts, dimension)
        return jnp.broadcast_to(out[None], (axis_size, *out.shape)), 0
    if d is None:
        return all_gather_p.bind(
            v, axes=axes, axis_size=axis_size, dimension=dimension, tiled=tiled
        ), None
    # The batch dimension stays in place (no transpose); the gathered one shifts past it.
    dim, out_d = _batched_dimension(d, dimension, tiled, +1)
    return all_gather_p.bind(v, axes=axes, axis_size=axis_size, dimension=dim, tiled=tiled), out_d


def _rows_lowering(target: str, api: str, dim0_target: str):
    """Lowering of all_gather_p / psum_scatter_p over ``dimension``. In one fabric, a
    non-leading dimension goes to ``target``, which works in place with strided rows
    (collectives.h: all_gather_rows, reduce_scatter_rows), and the leading one to
    ``dim0_target``: no transpose, reshape or copy in the program either way (an untiled call
    inserts or drops the axis itself). Across fabrics the hierarchical form (hierarchy/)
    takes the tiled form over the leading dimension, so the dimension is moved to the front
    around it there."""

    gather = target == "strata_all_gather_rows"

    def lower(ctx, x, *, axes, axis_size, dimension, tiled, **attrs):
        if hierarchy.plan(ctx, axes) is not None:
            if dimension == 0 and tiled:
                return ffi_call_lowering(dim0_target, api)(ctx, x, axes=axes, **attrs)
            prim = all_gather_p if gather else psum_scatter_p

            def moved(v):
                if gather and not tiled:
                    v = jnp.expand_dims(v, dimension)
                y = prim.bind(
                    jnp.moveaxis(v, dimension, 0),
                    axes=axes,
                    axis_size=axis_size,
                    dimension=0,
                    tiled=True,
                )
                y = jnp.moveaxis(y, 0, dimension)
                return y if gather or tiled else jnp.squeeze(y, dimension)

            return mlir.lower_fun(moved, multiple_results=False)(ctx, x)
        if dimension == 0:
            return lowering.lower_strata_call(
                ctx, dim0_target, api, [x], lowering.mesh_groups(ctx, axes, api), **attrs
            )
        return lowering.lower_strata_call(
            ctx,
            target,
            api,
            [x],
            lowering.mesh_groups(ctx, axes, api),
            dimension=np.int64(dimension),
            **attrs,
        )

    return lower


all_gather_lowering = _rows_lowering("strata_all_gather_rows", "all_gather", "strata_all_gather")
lowering.register(
    all_gather_p,
    _all_gather_abstract_eval,
    all_gather_lowering,
    linear_transpose=_all_gather_transpose,
    batcher=_all_gather_batcher,
)


# --------------------------------------------------------------------------------------
# psum_scatter (primitive scatters dimension 0, tiled)
# --------------------------------------------------------------------------------------

psum_scatter_p = core.Primitive("strata_psum_scatter")


@_profiled("psum_scatter")
def psum_scatter(
    x,
    axis_name: AxisName,
    *,
    scatter_dimension: int = 0,
    axis_index_groups=None,
    tiled: bool = False,
):
    """Sum over ``axis_name`` and scatter; drop-in for :func:`jax.lax.psum_scatter`.

    Args:
      x: array or pytree, numeric dtype (bool is summed as int32). Untiled: dimension
        ``scatter_dimension`` must have size n and is removed; rank i gets the sum of block i.
        Tiled: that dimension must be divisible by n and shrinks n-fold.
      axis_name: mesh axis name or tuple of names.
      scatter_dimension: dimension to scatter (negative counts from the end).
      tiled: see above.

    Raises:
      ValueError: 0-d input, out-of-range dimension, or a size not divisible by n.
      NameError / NotImplementedError: as :func:`psum`.

    Each rank reduces its own block from every peer's input into its own output (the balanced
    first half of a two-shot all-reduce). float16/bfloat16 accumulate in float32.
    """
    axes = lowering.axis_tuple(axis_name)
    lowering.check_no_groups(axis_index_groups, "psum_scatter")
    if not axes:
        return x

    def leaf(v):
        v = jnp.asarray(v)
        lowering.check_axis_names(axes, "psum_scatter")
        if v.ndim == 0:
            raise ValueError("psum_scatter of a 0-d array is undefined; reshape x to (n,).")
        if v.dtype == np.bool_:
            v = v.astype(np.int32)
        d = _canon_axis(scatter_dimension, v.ndim, "scatter_dimension")
        n = lowering.axis_size(axes)
        if tiled and v.shape[d] % n:
            raise ValueError(
                f"psum_scatter(tiled=True): dimension {d} of size {v.shape[d]} "
                f"is not divisible by the axis size {n}."
            )
        if not tiled and v.shape[d] != n:
            raise ValueError(
                f"psum_scatter(tiled=False): dimension {d} has size "
                f"{v.shape[d]} but must equal the axis size {n}; pass "
                "tiled=True to scatter blocks."
            )
        v, dt = widen(lowering.pvary_missing(v, axes), "psum_scatter")
        # Scattered in place along `d` (untiled: the call itself drops it): no transpose,
        # reshape or copy before or after.
        y = psum_scatter_p.bind(v, axes=axes, axis_size=n, dimension=d, tiled=tiled)
        return _narrow(y, dt)

    return _tree_map(leaf, x)


def _reduce_scatter_abstract_eval(aval, *, axes, axis_size, dimension, tiled):
    lowering.check_axis_names(axes, "psum_scatter")
    lowering.require_varying("psum_scatter", aval, axes)
    shape = list(aval.shape)
    if shape[dimension] % axis_size or (not tiled and shape[dimension] != axis_size):
        raise ValueError(
            f"psum_scatter: dimension {dimension} of size {shape[dimension]} does not fit the "
            f"axis size {axis_size} (tiled={tiled})"
        )
    if tiled:
        shape[dimension] //= axis_size
    else:
        del shape[dimension]
    return aval.update(shape=tuple(shape)), lowering.effects(axes)


def _reduce_scatter_transpose(ct, x, *, axes, axis_size, dimension, tiled):
    return [all_gather_p.bind(ct, axes=axes, axis_size=axis_size, dimension=dimension, tiled=tiled)]


def _reduce_scatter_batcher(axis_data, vals_in, dims_in, *, axes, axis_size, dimension, tiled):
    (v,), (d,) = vals_in, dims_in
    if axis_data.name in axes:
        raise NotImplementedError(
            "strata_jax.psum_scatter over a vmapped axis name is not supported; use jnp on "
            "the batch dimension."
        )
    if d is None:
        return psum_scatter_p.bind(
            v, axes=axes, axis_size=axis_size, dimension=dimension, tiled=tiled
        ), None
    # The batch dimension stays in place (no transpose); the scattered one shifts past it.
    dim, out_d = _batched_dimension(d, dimension, tiled, -1)
    y = psum_scatter_p.bind(v, axes=axes, axis_size=axis_size, dimension=dim, tiled=tiled)
    return y, out_d


psum_scatter_lowering = functools.partial(
    _rows_lowering("strata_psum_scatter_rows", "psum_scatter", "strata_psum_scatter"),
    reduce=np.int32(0),
)
lowering.register(
    psum_scatter_p,
    _reduce_scatter_abstract_eval,
    psum_scatter_lowering,
    linear_transpose=_reduce_scatter_transpose,
    batcher=_reduce_scatter_batcher,
)


# --------------------------------------------------------------------------------------
# all_to_all (primitive is the tiled form; strided blocks handled natively, no transposes)
# --------------------------------------------------------------------------------------

all_to_all_p = core.Primitive("strata_all_to_all")


@_profiled("all_to_all")
def all_to_all(
    x,
    axis_name: AxisName,
    split_axis: int,
    concat_axis: int,
    *,
    axis_index_groups=None,
    tiled: bool = False,
):
    """All-to-all over ``axis_name``; drop-in for :func:`jax.lax.all_to_all`.

    Args:
      x: array or pytree, any dtype. ``split_axis`` is cut into n blocks; block i goes to
        rank i, which concatenates the blocks it receives (in rank order) along
        ``concat_axis``. Untiled: ``x.shape[split_axis]`` must equal n; the result has shape
        ``np.insert(np.delete(x.shape, split_axis), concat_axis, n)``. Tiled: split_axis
        shrinks n-fold and concat_axis grows n-fold.
      axis_name: mesh axis name or tuple of names.
      split_axis, concat_axis: dimensions (negative counts from the end).

    Raises:
      ValueError: out-of-range axes, 0-d input, or a split size not divisible by n.
      NameError / NotImplementedError: as :func:`psum`.

    Each rank copies block i of every peer's input straight into its output with strided
    copies: no transpose before or after, whatever the axes.
    """
    axes = lowering.axis_tuple(axis_name)
    lowering.check_no_groups(axis_index_groups, "all_to_all")
    if not axes:
        return x

    def leaf(v):
        v = jnp.asarray(v)
        lowering.check_axis_names(axes, "all_to_all")
        if v.ndim == 0:
            raise ValueError("all_to_all of a 0-d array is undefined.")
        n = lowering.axis_size(axes)
        s = _canon_axis(split_axis, v.ndim, "split_axis")
        c = _canon_axis(concat_axis, v.ndim, "concat_axis")
        if tiled:
            if v.shape[s] % n:
                raise ValueError(
                    f"all_to_all: split_axis {s} of size {v.shape[s]} is not "
                    f"divisible by the axis size {n}."
                )
            v, dt = widen(lowering.pvary_missing(v, axes), "all_to_all")
            y = all_to_all_p.bind(v, axes=axes, split_axis=s, concat_axis=c, axis_size=n)
            return _narrow(y, dt)
        if v.shape[s] != n:
            raise ValueError(
                f"all_to_all(tiled=False): split_axis {s} has size {v.shape[s]} "
                f"but must equal the axis size {n}."
            )
        # Untiled = tiled on x with a unit axis inserted where the new axis will appear.
        ins = c if c <= s else c + 1
        s2 = s + 1 if c <= s else s
        v, dt = widen(lowering.pvary_missing(jnp.expand_dims(v, ins), axes), "all_to_all")
        y = all_to_all_p.bind(v, axes=axes, split_axis=s2, concat_axis=ins, axis_size=n)
        return _narrow(jnp.squeeze(y, s2), dt)

    return _tree_map(leaf, x)


def _all_to_all_abstract_eval(aval, *, axes, split_axis, concat_axis, axis_size):
    lowering.check_axis_names(axes, "all_to_all")
    lowering.require_varying("all_to_all", aval, axes)
    shape = list(aval.shape)
    if shape[split_axis] % axis_size:
        raise ValueError(
            f"all_to_all: split_axis size {shape[split_axis]} not divisible by {axis_size}"
        )
    shape[split_axis] //= axis_size
    shape[concat_axis] *= axis_size
    return aval.update(shape=tuple(shape)), lowering.effects(axes)


def _all_to_all_transpose(ct, x, *, axes, split_axis, concat_axis, axis_size):
    return [
        all_to_all_p.bind(
            ct, axes=axes, split_axis=concat_axis, concat_axis=split_axis, axis_size=axis_size
        )
    ]


def _all_to_all_batcher(axis_data, vals_in, dims_in, *, axes, split_axis, concat_axis, axis_size):
    (v,), (d,) = vals_in, dims_in
    if axis_data.name in axes:
        raise NotImplementedError(
            "strata_jax.all_to_all over a vmapped axis name is not supported."
        )
    if d is None:
        return all_to_all_p.bind(
            v, axes=axes, split_axis=split_axis, concat_axis=concat_axis, axis_size=axis_size
        ), None
    v = jnp.moveaxis(v, d, 0)
    return all_to_all_p.bind(
        v, axes=axes, split_axis=split_axis + 1, concat_axis=concat_axis + 1, axis_size=axis_size
    ), 0


lowering.register(
    all_to_all_p,
    _all_to_all_abstract_eval,
    lambda ctx, x, *, axes, split_axis, concat_axis, axis_size: ffi_call_lowering(
        "strata_all_to_all", "all_to_all"
    )(ctx, x, axes=axes, split_axis=int(split_axis), concat_axis=int(concat_axis)),
    linear_transpose=_all_to_all_transpose,
    batcher=_all_to_all_batcher,
)


# --------------------------------------------------------------------------------------
# ppermute
# --------------------------------------------------------------------------------------

ppermute_p = core.Primitive("strata_ppermute")


def _check_perm(perm, n: int) -> tuple:
    perm = tuple((int(s), int(d)) for s, d in perm)
    bad = [i for pair in perm for i in pair if not -n <= i < n]
    if bad:
        raise ValueError(
            f"ppermute: perm {perm} has indices {bad} outside [-{n}, {n}) for an axis of size {n}."
        )
    # Negative indices count from the end, as jax.lax.ppermute does.
    perm = tuple((s % n, d % n) for s, d in perm)
    srcs = [s for s, _ in perm]
    dsts = [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute: perm {perm} repeats a source or a destination.")
    return perm


@_profiled("ppermute")
def ppermute(x, axis_name: AxisName, perm: Sequence[tuple[int, int]]):
    """Collective permutation; drop-in for :func:`jax.lax.ppermute`.

    Args:
      x: array or pytree, any shape and dtype.
      axis_name: mesh axis name or tuple of names.
      perm: pairs ``(source, destination)`` of indices along ``axis_name`` (modulo the group
        size; a group over several axes is indexed in the order they are named, the first
        one major, as ``jax.lax.axis_index`` counts, whatever the mesh's order); no source or
        destination may repeat. A rank that is no destination gets zeros. (jax.lax.ppermute
        of JAX 0.10 indexed such a group in the mesh's order; from 0.11.1 it refuses an order
        other than the mesh's.)

    Raises:
      ValueError: a source or destination repeated.
      NameError / NotImplementedError: as :func:`psum`.

    Each destination copies its source's buffer straight into its own output.
    """
    axes = lowering.axis_tuple(axis_name)
    if not axes:
        return x

    def leaf(v):
        v = jnp.asarray(v)
        lowering.check_axis_names(axes, "ppermute")
        p = _check_perm(perm, lowering.axis_size(axes))
        v, dt = widen(lowering.pvary_missing(v, axes), "ppermute")
        return _narrow(ppermute_p.bind(v, axes=axes, perm=p), dt)

    return _tree_map(leaf, x)


def _ppermute_abstract_eval(aval, *, axes, perm):
    lowering.check_axis_names(axes, "ppermute")
    lowering.require_varying("ppermute", aval, axes)
    return aval, lowering.effects(axes)


def _ppermute_transpose(ct, x, *, axes, perm):
    return [ppermute_p.bind(ct, axes=axes, perm=tuple((d, s) for s, d in perm))]


def _ppermute_batcher(axis_data, vals_in, dims_in, *, axes, perm):
    (v,), (d,) = vals_in, dims_in
    if axis_data.name not in axes:
        return ppermute_p.bind(v, axes=axes, perm=perm), d
    if axes != (axis_data.name,):
        raise NotImplementedError(
            "strata_jax.ppermute over a vmapped axis together with mesh axes is not supported."
        )
    if d is None:
        v = jnp.broadcast_to(v[None], (axis_data.size, *v.shape))
        d = 0
    src = np.full(axis_data.size, -1)
    for s, t in perm:
        src[t] = s
    taken = jnp.take(v, np.maximum(src, 0), axis=d)
    mask = (src >= 0).reshape([-1 if i == d else 1 for i in range(v.ndim)])
    return jnp.where(mask, taken, jnp.zeros_like(taken)), d


def ppermute_lowering(ctx, x, *, axes, perm, mesh_order=False):
    # A multi-axis group is indexed in the order of ``axes`` (as axis_index counts), or, with
    # ``mesh_order``, in the mesh's order (what jax.lax.ppermute of JAX 0.10 does: the hook).
    mesh_shape, idx = lowering.mesh_placement(ctx, axes, "ppermute")
    if mesh_order:
        names = ctx.module_context.axis_context.mesh.axis_names
        axes = tuple(sorted(axes, key=names.index))
    sources = np.full(int(np.prod(mesh_shape[idx])), -1, np.int64)
    for s, d in perm:
        sources[d] = s
    return ffi_call_lowering("strata_ppermute", "ppermute")(ctx, x, axes=axes, sources=sources)


lowering.register(
    ppermute_p,
    _ppermute_abstract_eval,
    ppermute_lowering,
    linear_transpose=_ppermute_transpose,
    batcher=_ppermute_batcher,
)


# --------------------------------------------------------------------------------------
# pbroadcast
# --------------------------------------------------------------------------------------

pbroadcast_p = core.Primitive("strata_pbroadcast")


@_profiled("pbroadcast")
def pbroadcast(x, axis_name: AxisName, source: int):
    """Broadcast from rank ``source`` of ``axis_name``; drop-in for :func:`jax.lax.pbroadcast`.

    Args:
      x: array or pytree, any shape and dtype.
      axis_name: mesh axis name or tuple of names.
      source: index along ``axis_name`` whose ``x`` every rank receives.

    Returns:
      ``x`` of rank ``source`` on every rank (varying type, as jax.lax).

    Raises:
      ValueError: ``source`` outside [0, n).
      NameError / NotImplementedError: as :func:`psum`.

    Every rank copies the source's buffer straight into its own output. (jax.lax.pbroadcast
    has no CPU lowering; its documented equivalent is psum of x masked to the source.)
    """
    axes = lowering.axis_tuple(axis_name)
    if not axes:
        return x

    def leaf(v):
        v = jnp.asarray(v)
        lowering.check_axis_names(axes, "pbroadcast")
        n = lowering.axis_size(axes)
        if not 0 <= int(source) < n:
            raise ValueError(f"pbroadcast: source {source} is outside [0, {n}).")
        v, dt = widen(lowering.pvary_missing(v, axes), "pbroadcast")
        return _narrow(pbroadcast_p.bind(v, axes=axes, source=int(source)), dt)

    return _tree_map(leaf, x)


def _pbroadcast_abstract_eval(aval, *, axes, source):
    lowering.check_axis_names(axes, "pbroadcast")
    lowering.require_varying("pbroadcast", aval, axes)
    return aval, lowering.effects(axes)


def _pbroadcast_transpose(ct, x, *, axes, source):
    is_source = jax.lax.axis_index(axes) == source
    total = psum(ct, axes)
    if lowering.vma_on():
        total = lowering.pvary_missing(total, axes)
    return [jnp.where(is_source, total, jnp.zeros_like(total))]


def _pbroadcast_batcher(axis_data, vals_in, dims_in, *, axes, source):
    (v,), (d,) = vals_in, dims_in
    if axis_data.name not in axes:
        return pbroadcast_p.bind(v, axes=axes, source=source), d
    if axes != (axis_data.name,):
        raise NotImplementedError(
            "strata_jax.pbroadcast over a vmapped axis together with mesh axes is not supported."
        )
    if d is None:
        return v, None
    return jnp.take(v, np.full(axis_data.size, source), axis=d), d


lowering.register(
    pbroadcast_p,
    _pbroadcast_abstract_eval,
    lambda ctx, x, *, axes, source: ffi_call_lowering("strata_pbroadcast", "pbroadcast")(
        ctx, x, axes=axes, root=int(source)
    ),
    linear_transpose=_pbroadcast_transpose,
    batcher=_pbroadcast_batcher,
)
