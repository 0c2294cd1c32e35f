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

The all-reduces JAX binds one per leaf are combined into one strata call per run by
``combiner.py``.

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
    lowering,
    operators,
    program_order,
    ragged,
)
from strata_jax._src.jax_compat import (
    SPMDAxisContext,
    config,
    jax_ppermute_order,
    lax_primitive,
    lowering_rule,
    mlir,
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
    return np.dtype(aval.dtype) in collectives.NATIVE_DTYPES


def wide(aval):
    """``aval`` in the dtype strata's kernels use for it (narrow types travel widened, as in
    ``collectives.widen``)."""
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
    win, wout = wide(aval_in), wide(aval_out)
    if win is not aval_in:
        x = mlir.convert_hlo(ctx, x, aval_in, win)
    sub = ctx.replace(avals_in=[win], avals_out=[wout])
    (y,) = collectives.ffi_call_lowering(target, api)(sub, x, axes=axes, **attrs)
    if wout is not aval_out:
        y = mlir.convert_hlo(ctx, y, wout, aval_out)
    return y


def _axes(axis_name) -> tuple:
    return lowering.axis_tuple(axis_name)


REDUCE_CODES = operators.REDUCE_CODES
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
        code = np.int32(REDUCE_CODES[reduce])
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
    """strata's all_gather / psum_scatter lowering (``collectives.all_gather_lowering``,
    ``psum_scatter_lowering``) over ``dimension``, in place: no transpose or reshape around
    it; narrow dtypes widened as in ``_call``."""
    (aval,), (out,) = ctx.avals_in, ctx.avals_out
    win, wout = wide(aval), wide(out)
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


def _rows_rule(lower, dimension_param: str):
    """The rule of jax.lax's all_gather (``dimension_param`` all_gather_dimension) or
    reduce_scatter (scatter_dimension): strata's ``lower`` over that dimension, in place."""

    def rule(ctx, x, *, axis_name, axis_size, tiled, **params):
        return _rows_call(
            ctx,
            lower,
            x,
            axis_name=axis_name,
            axis_size=axis_size,
            dimension=params[dimension_param],
            tiled=tiled,
        )

    return rule


_all_gather_rule = _rows_rule(collectives.all_gather_lowering, "all_gather_dimension")
_reduce_scatter_rule = _rows_rule(collectives.psum_scatter_lowering, "scatter_dimension")


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
    win = wide(aval)
    if win is not aval:
        x = mlir.convert_hlo(ctx, x, aval, win)
    (y,) = collectives.ppermute_lowering(
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
        ctx, "strata_pbroadcast", "pbroadcast", x, aval, aval, _axes(axis_name), root=int(source)
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


# The rule and the cause of each operator that runs jax.lax primitives, by its name in the
# operator table (operators.py); the table says which jax.lax primitives each one runs.
RULES = {
    "psum": (_all_reduce_rule("psum"), _all_reduce_cause("psum")),
    "pmax": (_all_reduce_rule("pmax"), _all_reduce_cause("pmax")),
    "pmin": (_all_reduce_rule("pmin"), _all_reduce_cause("pmin")),
    "all_gather": (_all_gather_rule, _group_cause),
    "psum_scatter": (_reduce_scatter_rule, _reduce_scatter_cause),
    "all_to_all": (_all_to_all_rule, _group_cause),
    "ppermute": (_ppermute_rule, _group_cause),
    "pbroadcast": (_pbroadcast_rule, _group_cause),
    "ragged_all_to_all": (_ragged_rule, _ragged_cause),
}
# jax.lax's collective primitives (by name: jax_compat.lax_primitive; a name the running JAX
# release lacks is skipped), each with its operator's rule and cause.
_HOOKS = [
    (prim, *RULES[op.id])
    for op in operators.OPERATORS
    for name in op.lax
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


def hooked_primitives() -> frozenset:
    """Every primitive of JAX whose CPU lowering is hooked here (run on strata, or refused with
    a cause): the collectives a combined run of all-reduces never crosses."""
    return (
        frozenset(p for p, _, _ in _HOOKS)
        | frozenset(_ASYNC)
        | frozenset(p for p, _ in _UNSUPPORTED)
    )
