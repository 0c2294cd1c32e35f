"""Running existing JAX code's collectives on strata: ``use_for_jax_lax()``, ``enable()``,
``disable()``.

While enabled, every collective primitive of JAX that is lowered for the CPU inside an
all-manual ``jax.shard_map`` (``jax.pmap`` included) becomes strata's custom call, whoever
emitted it: the ``jax.lax`` functions (under any name they were bound to), and the collectives
JAX inserts itself (the ``psum_invariant`` that transposes the implicit ``pvary`` of a
replicated parameter under ``check_vma=True``, the transposes and batching rules of every
collective, ``all_gather_invariant``, ``reduce_scatter``...), Flax's and optax's calls.

How: a lowering rule for platform ``"cpu"`` is registered once, at import, for each of JAX's
collective primitives (``_HOOKS``). It reads a JAX config state (``strata_use_for_jax_lax``)
that is part of jit's cache key and thread-local like every ``jax.config`` context manager;
with the state off, or for a call strata cannot run, it hands the call to JAX's own rule, with
one RuntimeWarning per cause (``fallback_cause``). The jaxpr stays JAX's: autodiff, vmap and the
varying-axes types are JAX's own, only the lowering changes. Nothing of JAX is swapped at run
time. Each program's collectives and where they went are recorded (``coverage.py``).

The all-reduces JAX binds one per leaf (``jax.lax.psum`` of a pytree, the gradients' psums under
``check_vma``) are combined into one strata call per run, as XLA's combiner does for its own:
a CPU lowering rule of ``shard_map`` rewrites the body jaxpr being lowered (``_combine_jaxpr``,
``STRATA_COMBINE_BYTES``); the jaxpr JAX traced is not changed.

Why there and not in the ``jax.lax`` namespace (what ``use_for_jax_lax()`` did before): the
namespace misses every collective JAX emits itself and every name bound before ``enable()``;
measured on a Flax CNN trained data parallel with optax inside ``jax.shard_map``
(``check_vma=True``), 8 of the step's 17 all-reduces stayed on XLA that way (14 of 29 with
BatchNorm), and none do here.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import (
    collectives,
    coverage,
    hierarchy,
    lowering,
    program_order,
    ragged,
    runtime,
)
from strata_jax._src.jax_compat import (
    SPMDAxisContext,
    config,
    core,
    is_closed,
    is_jaxpr,
    jax_ppermute_order,
    lax_primitive,
    lowering_rule,
    map_closed,
    mlir,
    open_jaxpr,
    shard_map_p,
)

_state = config.bool_state(
    "strata_use_for_jax_lax",
    False,
    help="Lower JAX's collectives inside jax.shard_map to strata_jax (strata_jax.enable()).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)

_lock = threading.Lock()
_warned: set[str] = set()

OFF = "strata_jax.use_for_jax_lax() is off"
# Not a collective: a reduction over positional (vmapped) axes only, which JAX lowers as a
# local reduce. Neither recorded nor warned.
LOCAL = "a reduction over positional axes only (no communication)"


def fallback_cause(ctx, axes: tuple, axis_index_groups=None) -> str | None:
    """Why strata cannot run this collective of JAX at this lowering (the reason recorded and
    warned), or None when it can. ``axes`` are the primitive's axis names."""
    if axis_index_groups is not None:
        return "axis_index_groups is given (strata groups are mesh axes)"
    mc = ctx.module_context
    if tuple(mc.platforms) != ("cpu",):
        return f"the program is lowered for platforms {tuple(mc.platforms)}, not the CPU alone"
    if mc.lowering_parameters.for_export:
        return "the program is lowered for jax.export (strata's custom calls are not portable)"
    axis_ctx = mc.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext) or not axis_ctx.manual_axes:
        return "the collective is not inside jax.shard_map or jax.pmap"
    if frozenset(axis_ctx.manual_axes) != frozenset(axis_ctx.mesh.axis_names):
        return "the enclosing jax.shard_map is partly automatic (axis_names= a subset of the mesh)"
    return None


def _warn_once(op: str, cause: str) -> None:
    with _lock:
        if cause in _warned:
            return
        _warned.add(cause)
    warnings.warn(
        f"strata_jax.use_for_jax_lax: {op} stays on XLA because {cause}; this warning is "
        "shown once per cause (strata_jax.coverage() lists every such collective).",
        RuntimeWarning,
        stacklevel=2,
    )


def _hook(prim, strata_rule: Callable, cause: Callable, may_run: bool = True) -> None:
    """Registers the CPU lowering of JAX's ``prim``: ``strata_rule`` while enabled and
    ``cause(ctx, **params)`` finds nothing against it, else JAX's own rule."""
    jax_rule = lowering_rule(prim, "cpu")

    def rule(ctx, *args, **params):
        why = cause(ctx, **params)
        if why is LOCAL:
            return jax_rule(ctx, *args, **params)
        if not _state.value:
            why = OFF
        if why is None:
            try:
                out = strata_rule(ctx, *args, **params)
            except NotImplementedError as e:  # e.g. a group across fabrics with no split
                why = str(e)
            else:
                coverage.record(ctx, prim.name, None)
                return out
        if why is not OFF:
            _warn_once(prim.name, why)
        coverage.record(ctx, prim.name, why)
        if jax_rule is None:
            raise NotImplementedError(
                f"MLIR translation rule for primitive '{prim.name}' not found for platform cpu "
                "(JAX has none; strata_jax runs it inside jax.shard_map under "
                "strata_jax.use_for_jax_lax())."
            )
        return jax_rule(ctx, *args, **params)

    # Not cacheable: JAX would lower equal applications once and share one op id (program_order.py).
    mlir.register_lowering(prim, rule, platform="cpu", cacheable=False)
    if may_run:  # the program-order chain then counts it as a strata call (program_order.py)
        program_order.lowers_to_strata(prim, is_enabled)


# --------------------------------------------------------------------------------------
# From JAX's primitives to strata's calls (shapes moved with HLO ops, no new primitive)
# --------------------------------------------------------------------------------------


def _native(aval) -> bool:
    return np.dtype(aval.dtype) in collectives._NATIVE_DTYPES


def _wide(aval):
    """``aval`` in the dtype strata's kernels use for it (narrow types travel widened, as in
    ``collectives._widen``)."""
    if _native(aval):
        return aval
    dt = np.dtype(aval.dtype)
    if jnp.issubdtype(dt, jnp.floating):
        wide = np.float32
    elif jnp.issubdtype(dt, jnp.signedinteger):
        wide = np.int32
    else:
        wide = np.uint32
    return aval.update(dtype=np.dtype(wide), weak_type=False)


def _call(ctx, target: str, api: str, x, aval_in, aval_out, axes: tuple, **attrs):
    """strata's ``target`` on ``x`` (of ``aval_in``) giving ``aval_out``, narrow dtypes widened
    on the way in and narrowed on the way out (exact for data movement; sums round once)."""
    win, wout = _wide(aval_in), _wide(aval_out)
    if win is not aval_in:
        x = mlir.convert_hlo(ctx, x, aval_in, win)
    sub = ctx.replace(avals_in=[win], avals_out=[wout])
    (y,) = collectives._ffi_call_lowering(target, api)(sub, x, axes=axes, **attrs)
    if wout is not aval_out:
        y = mlir.convert_hlo(ctx, y, wout, aval_out)
    return y


def _axes(axis_name) -> tuple:
    return lowering.axis_tuple(axis_name)


_REDUCE = {"psum": 0, "pmax": 1, "pmin": 2}
_LOCAL = {"psum": jax.lax.reduce_sum, "pmax": jax.lax.reduce_max, "pmin": jax.lax.reduce_min}


def _all_reduce_rule(reduce: str):
    def rule(ctx, x, *, axes, axis_index_groups=None):
        (aval,), (out,) = ctx.avals_in, ctx.avals_out
        named = tuple(a for a in axes if not isinstance(a, int))
        positional = tuple(a for a in axes if isinstance(a, int))
        if positional:  # reduced here first (as JAX does), then over the named axes
            local = mlir.lower_fun(lambda v: _LOCAL[reduce](v, positional), multiple_results=False)
            (x,) = local(ctx.replace(primitive=None, avals_out=[out]), x)
            aval = out
        code = np.int32(_REDUCE[reduce])
        return [_call(ctx, "strata_all_reduce", reduce, x, aval, out, named, reduce=code)]

    return rule


def _all_reduce_cause(reduce: str):
    def cause(ctx, *, axes, axis_index_groups=None):
        named = tuple(a for a in axes if not isinstance(a, int))
        if not named:
            return LOCAL  # a vmapped axis: JAX reduces it on the device
        why = fallback_cause(ctx, named, axis_index_groups)
        if why is None and reduce != "psum":
            dt = np.dtype(ctx.avals_in[0].dtype)
            if jnp.issubdtype(dt, jnp.complexfloating):
                why = f"{reduce} of a complex dtype ({dt}) has no order"
        return why

    return cause


def _rows_call(ctx, lower, x, *, axis_name, axis_size, dimension, tiled):
    """strata's all_gather / psum_scatter lowering (``collectives._all_gather_lowering``,
    ``_reduce_scatter_lowering``) over ``dimension``, in place: no transpose or reshape around
    it (issue 24 section 4); narrow dtypes widened as in ``_call``."""
    (aval,), (out,) = ctx.avals_in, ctx.avals_out
    win, wout = _wide(aval), _wide(out)
    if win is not aval:
        x = mlir.convert_hlo(ctx, x, aval, win)
    sub = ctx.replace(avals_in=[win], avals_out=[wout])
    (y,) = lower(
        sub,
        x,
        axes=_axes(axis_name),
        axis_size=int(axis_size),
        dimension=int(dimension),
        tiled=bool(tiled),
    )
    if wout is not out:
        y = mlir.convert_hlo(ctx, y, wout, out)
    return [y]


def _all_gather_rule(ctx, x, *, all_gather_dimension, axis_name, axis_size, tiled, **_):
    return _rows_call(
        ctx,
        collectives._all_gather_lowering,
        x,
        axis_name=axis_name,
        axis_size=axis_size,
        dimension=all_gather_dimension,
        tiled=tiled,
    )


def _reduce_scatter_rule(ctx, x, *, scatter_dimension, axis_name, axis_size, tiled, **_):
    return _rows_call(
        ctx,
        collectives._reduce_scatter_lowering,
        x,
        axis_name=axis_name,
        axis_size=axis_size,
        dimension=scatter_dimension,
        tiled=tiled,
    )


def _group_cause(ctx, *, axis_name, axis_index_groups=None, **_):
    return fallback_cause(ctx, _axes(axis_name), axis_index_groups)


def _reduce_scatter_cause(ctx, *, axis_name, axis_index_groups=None, **_):
    why = fallback_cause(ctx, _axes(axis_name), axis_index_groups)
    if why is None and np.dtype(ctx.avals_in[0].dtype) == np.bool_:
        why = "psum_scatter of bool (a logical or on XLA)"
    return why


def _all_to_all_rule(ctx, x, *, split_axis, concat_axis, axis_name, **_):
    (aval,), (out,) = ctx.avals_in, ctx.avals_out
    s, c = int(split_axis), int(concat_axis)
    y = _call(
        ctx, "strata_all_to_all", "all_to_all", x, aval, out, _axes(axis_name),
        split_axis=s, concat_axis=c,
    )  # fmt: skip
    return [y]


def _ppermute_rule(ctx, x, *, axis_name, perm):
    axes = _axes(axis_name)
    shape, idx = lowering.mesh_placement(ctx, axes, "ppermute")
    # As jax.lax.ppermute of the running release indexes a group named out of mesh order.
    order = jax_ppermute_order()
    if order == "raise" and list(idx) != sorted(idx):
        raise RuntimeError(
            "Make sure that the axis_name passed to jax.lax.ppermute is in the same order as "
            "the axis_names declared on the mesh (JAX's own rule, kept under "
            "strata_jax.use_for_jax_lax()). To allow a different order, turn the check off "
            "(jax.config.update('jax_raise_on_ppermute_sort_diff', False)), or call "
            "strata_jax.ppermute, which indexes the group in the order given."
        )
    n = int(np.prod(shape[idx]))
    perm = tuple((int(s) % n, int(d) % n) for s, d in perm)
    (aval,) = ctx.avals_in
    win = _wide(aval)
    if win is not aval:
        x = mlir.convert_hlo(ctx, x, aval, win)
    (y,) = collectives._ppermute_lowering(
        ctx.replace(avals_in=[win], avals_out=[win]),
        x,
        axes=axes,
        perm=perm,
        mesh_order=order == "mesh",
    )
    if win is not aval:
        y = mlir.convert_hlo(ctx, y, win, aval)
    return [y]


def _pbroadcast_rule(ctx, x, *, axis_name, source):
    (aval,) = ctx.avals_in
    y = _call(
        ctx, "strata_broadcast", "pbroadcast", x, aval, aval, _axes(axis_name), root=int(source)
    )
    return [y]


def _ragged_rule(ctx, *args, axis_name, axis_index_groups):
    return ragged._lowering(
        ctx,
        *args,
        axis_name=_axes(axis_name),
        axis_index_groups=axis_index_groups,
        bounds=None,  # jax.lax's own batching rule has merged no batch into the rows
    )


def _ragged_cause(ctx, *, axis_name, axis_index_groups=None):
    return fallback_cause(ctx, _axes(axis_name))  # strata's ragged takes index groups


def _async_cause(ctx, **_):
    return "it is the asynchronous (start/done) form, which strata does not split"


def _never(ctx, *args, **params):
    raise AssertionError("unreachable: _async_cause always names a cause")


def _unsupported_cause(what: str):
    def cause(ctx, **_):
        return what

    return cause


# jax.lax's collective primitives (by name: jax_compat.lax_primitive; a name the running JAX
# release lacks is skipped), each with its rule and cause.
_HOOKS = [
    (prim, rule, cause)
    for name, rule, cause in (
        ("psum", _all_reduce_rule("psum"), _all_reduce_cause("psum")),
        ("psum_invariant", _all_reduce_rule("psum"), _all_reduce_cause("psum")),
        ("unreduced_psum", _all_reduce_rule("psum"), _all_reduce_cause("psum")),
        ("pmax", _all_reduce_rule("pmax"), _all_reduce_cause("pmax")),
        ("pmin", _all_reduce_rule("pmin"), _all_reduce_cause("pmin")),
        ("all_gather", _all_gather_rule, _group_cause),
        ("all_gather_invariant", _all_gather_rule, _group_cause),
        ("all_gather_reduced", _all_gather_rule, _group_cause),
        ("reduce_scatter", _reduce_scatter_rule, _reduce_scatter_cause),
        ("unreduced_reduce_scatter", _reduce_scatter_rule, _reduce_scatter_cause),
        ("all_to_all", _all_to_all_rule, _group_cause),
        ("ppermute", _ppermute_rule, _group_cause),
        ("pbroadcast", _pbroadcast_rule, _group_cause),
        ("ragged_all_to_all", _ragged_rule, _ragged_cause),
    )
    if (prim := lax_primitive(name)) is not None
]
# Collectives strata does not run, each with the reason coverage() records (JAX 0.11+ adds
# the first five), and the asynchronous forms.
_UNSUPPORTED = [
    (prim, _unsupported_cause(why))
    for name, why in (
        ("pxor", "strata has no XOR reduction"),
        ("pmax_scatter", "strata's psum_scatter has no max reduction"),
        ("pmin_scatter", "strata's psum_scatter has no min reduction"),
        ("unreduced_pmax", "strata does not run unreduced pmax"),
        ("unreduced_pmin", "strata does not run unreduced pmin"),
        (
            "pbroadcast_dynamic",
            "its source is a traced array (strata's pbroadcast takes a Python int)",
        ),
    )
    if (prim := lax_primitive(name)) is not None
]
_ASYNC = [
    prim
    for name in (
        "psum_start",
        "psum_invariant_start",
        "unreduced_psum_start",
        "all_gather_start",
        "all_gather_reduced_start",
        "reduce_scatter_start",
        "unreduced_reduce_scatter_start",
        "all_to_all_start",
        "ppermute_start",
        "pbroadcast_start",
    )
    if (prim := lax_primitive(name)) is not None
]


def is_enabled() -> bool:
    """Whether JAX's collectives currently lower to strata (in this thread)."""
    return bool(_state.value)


for _prim, _rule, _cause in _HOOKS:
    _hook(_prim, _rule, _cause)
for _prim in _ASYNC:
    _hook(_prim, _never, _async_cause, may_run=False)
for _prim, _cause in _UNSUPPORTED:
    _hook(_prim, _never, _cause, may_run=False)


def enable() -> None:
    """Runs JAX's collectives inside ``jax.shard_map`` on strata from now on (process-wide).

    See :func:`use_for_jax_lax` for what is and is not redirected. Functions already traced
    are lowered again on their next call (the setting is part of jit's cache key).
    """
    jax.config.update("strata_use_for_jax_lax", True)


def disable() -> None:
    """Undoes :func:`enable`: JAX's collectives lower to XLA's again."""
    jax.config.update("strata_use_for_jax_lax", False)


@contextlib.contextmanager
def use_for_jax_lax(enabled: bool = True) -> Iterator[None]:
    """Context manager: the collectives of programs lowered inside it run on strata.

    Every collective JAX lowers for the CPU inside an all-manual ``jax.shard_map`` (``jax.pmap``
    included, which JAX runs as one) becomes strata's custom call, whoever emitted it:
    ``jax.lax.psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather`` (``to=`` included),
    ``all_gather_invariant``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pbroadcast``
    and ``ragged_all_to_all`` under whatever name they were imported, the collectives JAX
    inserts itself (the psum that transposes the implicit ``pvary`` of replicated parameters
    under ``check_vma=True``; every transpose and batching rule), and Flax's and optax's calls.
    The jaxpr is JAX's own; only its lowering changes. Runs of all-reduces over the same axes
    with no other collective between them (a pytree's leaves, a training step's gradients)
    become one strata call each, up to ``STRATA_COMBINE_BYTES`` (32 MiB; 0: one call per
    all-reduce), bitwise what one call per leaf gives. Stays on XLA, with one RuntimeWarning
    per cause: ``axis_index_groups`` (except ``ragged_all_to_all``), a partly
    automatic shard_map, collectives outside any shard_map, programs lowered for several
    platforms or for ``jax.export``, the asynchronous ``*_start`` forms, pmax/pmin of complex
    numbers and psum_scatter of bool. :func:`strata_jax.coverage` lists, per lowered program,
    which collectives went where and why. Thread-local; nests; ``use_for_jax_lax(False)`` turns
    it off inside an enabled region.

    Example::

        with strata_jax.use_for_jax_lax():
            state = train_step(state, batch)   # its gradient all-reduces run on strata

    The setting is part of jit's cache key: a function compiled outside is lowered again
    inside, and the other way round. It is read when the program is lowered, so a
    ``jax.jit(f).trace(x)`` made outside and ``.lower()`` inside runs on strata.
    """
    with _state(bool(enabled)):
        yield


# --------------------------------------------------------------------------------------
# The all-reduce combiner: several of JAX's all-reduces in one strata call
# --------------------------------------------------------------------------------------
#
# jax.lax.psum of a pytree binds one psum per leaf, and autodiff under check_vma inserts one
# psum_invariant per parameter, so a training step would make one strata call (one rendezvous)
# per leaf. XLA's all-reduce combiner merges its own; here, when an all-manual shard_map body
# is lowered under use_for_jax_lax(), runs of all-reduces of one kind over the same axes with
# no other collective between them become one equation of ``_combined_p``, lowered to one
# ``strata_all_reduce_list`` call (collectives.py). The jaxpr JAX traced is not changed: the
# rewritten copy exists only while the body is lowered.

# Default size of one combined call (bytes of all its operands, per rank); STRATA_COMBINE_BYTES
# overrides it when a program is lowered (0: no combining).
COMBINE_BYTES = 32 * 1024 * 1024

_KIND = {
    lax_primitive("psum"): "psum",
    lax_primitive("psum_invariant"): "psum",
    lax_primitive("pmax"): "pmax",
    lax_primitive("pmin"): "pmin",
}
# Higher-order primitives whose jaxprs (params) are rewritten too: each body is combined on its
# own (a run never crosses into or out of a nested jaxpr).
_NESTED = frozenset(
    {"jit", "closed_call", "call", "custom_jvp_call", "custom_vjp_call", "remat2", "while",
     "cond", "scan"}
)  # fmt: skip
_COLLECTIVES = (
    frozenset(p for p, _, _ in _HOOKS) | frozenset(_ASYNC) | frozenset(p for p, _ in _UNSUPPORTED)
)


def combine_bytes() -> int:
    """The most bytes (per rank, all operands) one combined all-reduce call takes:
    ``STRATA_COMBINE_BYTES`` (K/M/G suffixes) or 32 MiB; 0 turns combining off."""
    return runtime.env_bytes(
        "STRATA_COMBINE_BYTES", COMBINE_BYTES, "33554432 or 32M; 0: one strata call per all-reduce"
    )


_combined_p = core.Primitive("combined_all_reduce")
_combined_p.multiple_results = True


def _members(members):
    """(primitive, params dict) of each combined all-reduce, one operand each."""
    return [(prim, dict(params)) for prim, params in members]


def _combined_abstract_eval(*avals, reduce, axes, members):
    outs, effs = [], set()
    for aval, (prim, params) in zip(avals, _members(members), strict=True):
        out, eff = prim.abstract_eval(aval, **params)
        outs.append(out)
        effs |= set(eff)
    return outs, effs


def _combined_lowering(ctx, *xs, reduce, axes, members):
    """One ``strata_all_reduce_list`` call for all operands (narrow dtypes widened as ``_call``
    does); each member on its own (its hook: strata or XLA, warned and recorded as ever)
    where that cannot be: a group across fabrics (the hierarchical all-reduce takes one
    operand), or a cause to stay on XLA."""
    why = fallback_cause(ctx, axes) if _state.value else OFF
    if why is None and hierarchy.plan(ctx, axes) is None:
        wins = [_wide(a) for a in ctx.avals_in]
        wouts = [_wide(a) for a in ctx.avals_out]
        ins = [
            x if w is a else mlir.convert_hlo(ctx, x, a, w)
            for x, a, w in zip(xs, ctx.avals_in, wins, strict=True)
        ]
        ys = lowering.lower_strata_call(
            ctx.replace(avals_in=wins, avals_out=wouts),
            "strata_all_reduce_list",
            reduce,
            ins,
            lowering.mesh_groups(ctx, axes, reduce),
            reduce=np.int32(_REDUCE[reduce]),
            num_operands=np.int64(len(ins)),
        )
        outs = [
            y if w is a else mlir.convert_hlo(ctx, y, w, a)
            for y, a, w in zip(ys, ctx.avals_out, wouts, strict=True)
        ]
        for k, (prim, _) in enumerate(members):
            coverage.record(ctx, prim.name, None, calls=int(k == 0))
        return outs
    outs = []
    for k, (prim, params) in enumerate(_members(members)):
        rule = lowering_rule(prim, "cpu")  # its _hook
        sub = ctx.replace(primitive=prim, avals_in=[ctx.avals_in[k]], avals_out=[ctx.avals_out[k]])
        outs.extend(rule(sub, xs[k], **params))
    return outs


_combined_p.def_effectful_abstract_eval(_combined_abstract_eval)
mlir.register_lowering(_combined_p, _combined_lowering, platform="cpu", cacheable=False)
program_order.lowers_to_strata(_combined_p, is_enabled)


def _combine_key(eqn) -> tuple | None:
    """(kind, axes) of an all-reduce that may join a combined call; None for any other
    equation, and for those left as they are: axis_index_groups, positional (vmapped) axes,
    several operands, pmax/pmin of complex numbers, types that are not plain numbers."""
    kind = _KIND.get(eqn.primitive)
    if kind is None or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return None
    axes = eqn.params.get("axes")
    if eqn.params.get("axis_index_groups") is not None or not isinstance(axes, tuple):
        return None
    if not axes or any(isinstance(a, int) for a in axes):
        return None
    aval = eqn.invars[0].aval
    try:
        dt = np.dtype(aval.dtype)
    except TypeError:  # an extended dtype (PRNG keys...)
        return None
    if not (jnp.issubdtype(dt, np.number) or dt == np.bool_):
        return None
    if kind != "psum" and jnp.issubdtype(dt, jnp.complexfloating):
        return None
    if kind == "psum" and dt == np.bool_:
        return None  # JAX sums bool as int32 before binding psum; not seen here
    return kind, axes


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * _wide(aval).dtype.itemsize


def _holds_collective(jaxpr: core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive in _COLLECTIVES or eqn.primitive.name.startswith("strata_"):
            return True
        if eqn.primitive is _combined_p:
            return True
        if any(_holds_collective(sub) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _rewrite_param(v, limit: int):
    if is_jaxpr(v):
        inner = open_jaxpr(v)
        j = _combine_jaxpr(inner, limit)
        if j is inner:
            return v
        return map_closed(v, lambda _: j) if is_closed(v) else j
    if isinstance(v, tuple) and v and all(is_jaxpr(b) for b in v):
        new = tuple(_rewrite_param(b, limit) for b in v)
        return v if all(a is b for a, b in zip(new, v, strict=True)) else new
    return v


def _rewrite_nested(eqn, limit: int):
    if eqn.primitive.name not in _NESTED:
        return eqn
    params = {k: _rewrite_param(v, limit) for k, v in eqn.params.items()}
    if all(params[k] is v for k, v in eqn.params.items()):
        return eqn
    return eqn.replace(params=params)


def _is_barrier(eqn) -> bool:
    """Whether ``eqn`` is a collective, or holds one: a run never crosses it."""
    if eqn.primitive in _COLLECTIVES or eqn.primitive.name.startswith("strata_"):
        return True
    if eqn.primitive is _combined_p:
        return True
    return any(_holds_collective(sub) for sub in core.jaxprs_in_params(eqn.params))


def _combine_jaxpr(jaxpr: core.Jaxpr, limit: int) -> core.Jaxpr:
    """``jaxpr`` with its runs of all-reduces combined (the same object if none is).

    A run: all-reduces with one ``_combine_key`` and, between its first and its last, no
    other collective (nor an equation holding one), no member that depends on an earlier
    member's result (directly or through other equations: ``psum(f(psum(a)))`` stays two
    calls), and at most ``limit`` bytes of operands (widened). It becomes one ``_combined_p``
    equation with the members' own output variables (so their types, varying axes included,
    stay JAX's) at the place of its last member, where every operand is computed; the
    equations between that use an earlier member's result (a reshape of a gradient, the
    optimizer's arithmetic) move right after it, in their order. Such an equation with an
    effect (a callback) ends the run instead. Collectives keep their relative order (calls
    across processes meet by their order on a communicator).
    """
    eqns = [_rewrite_nested(e, limit) for e in jaxpr.eqns]
    runs: list[tuple[list[int], list[int]]] = []  # (members, dependent equations between)
    cur: list[int] = []
    after: list[int] = []
    key, tainted, size, sealed = None, set(), 0, False

    def close():
        if len(cur) > 1:
            runs.append((cur, [j for j in after if j < cur[-1]]))

    for i, eqn in enumerate(eqns):
        uses = any(isinstance(v, core.Var) and v in tainted for v in eqn.invars)
        k = _combine_key(eqn)
        if k is not None:
            nb = _nbytes(eqn.invars[0].aval)
            if cur and k == key and not sealed and not uses and size + nb <= limit:
                cur.append(i)
                size += nb
            else:
                close()
                cur, after, key, size, sealed = [i], [], k, nb, False
                tainted = set()
            tainted.update(eqn.outvars)
            continue
        if not cur:
            continue
        if _is_barrier(eqn):
            close()
            cur, after, key, tainted = [], [], None, set()
        elif uses:
            if eqn.effects:
                sealed = True  # it stays where it is: the run ends before it
            else:
                after.append(i)
                tainted.update(eqn.outvars)
    close()
    if not runs and all(a is b for a, b in zip(eqns, jaxpr.eqns, strict=True)):
        return jaxpr
    skip, at = set(), {}
    for members, moved in runs:
        skip.update(members[:-1])
        skip.update(moved)
        at[members[-1]] = (members, moved)
    new_eqns = []
    for i, eqn in enumerate(eqns):
        if i in skip:
            continue
        if i not in at:
            new_eqns.append(eqn)
            continue
        members, moved = at[i]
        group = [eqns[j] for j in members]
        kind, axes = _combine_key(eqn)
        effects = set()
        for m in group:
            effects |= set(m.effects)
        params = {
            "reduce": kind,
            "axes": axes,
            "members": tuple((m.primitive, tuple(sorted(m.params.items()))) for m in group),
        }
        new_eqns.append(
            core.new_jaxpr_eqn(
                [m.invars[0] for m in group],
                [m.outvars[0] for m in group],
                _combined_p,
                params,
                effects,
                eqn.source_info,
                eqn.ctx,
            )
        )
        new_eqns.extend(eqns[j] for j in moved)
    return jaxpr.replace(eqns=new_eqns)


def _combine_in_shard_map() -> None:
    """Registers the CPU lowering of ``shard_map`` that combines the all-reduces of an
    all-manual body (``_combine_jaxpr``) under use_for_jax_lax(), then lowers it with the rule
    registered before (program_order.py's, which chains the regions, around JAX's)."""
    rule = lowering_rule(shard_map_p, "cpu")

    def shard_map_lowering(ctx, *in_nodes, jaxpr, mesh, **params):
        if _state.value:
            mc = ctx.module_context
            axis_ctx = mc.axis_context
            outer = set(axis_ctx.manual_axes) if isinstance(axis_ctx, SPMDAxisContext) else set()
            limit = combine_bytes()
            if (
                limit > 0
                and tuple(mc.platforms) == ("cpu",)
                and not mc.lowering_parameters.for_export
                and set(params["newly_manual_axes"]) | outer == set(mesh.axis_names)
            ):
                jaxpr = _combine_jaxpr(jaxpr, limit)
        return rule(ctx, *in_nodes, jaxpr=jaxpr, mesh=mesh, **params)

    mlir.register_lowering(shard_map_p, shard_map_lowering, platform="cpu", cacheable=False)


_combine_in_shard_map()
