"""The all-reduce combiner: runs of JAX's all-reduces become one strata call.

``jax.lax.psum`` of a pytree binds one psum per leaf, and autodiff under ``check_vma`` inserts
one ``psum_invariant`` per parameter, so a training step would make one strata call (one
rendezvous) per leaf. XLA's all-reduce combiner merges its own; here, when an all-manual
``shard_map`` body is lowered under ``use_for_jax_lax()`` (``lax_hooks.py``), runs of
all-reduces of one kind over the same axes with no other collective between them become one
equation of ``_combined_p``, lowered to one ``strata_all_reduce_list`` call. The jaxpr JAX
traced is not changed: the rewritten copy (``_combine_jaxpr``) exists only while the body is
lowered. ``STRATA_COMBINE_BYTES`` bounds one call (32 MiB; 0: no combining).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from strata_jax._src import coverage, hierarchy, lax_hooks, lowering, program_order, runtime
from strata_jax._src.jax_compat import (
    SPMDAxisContext,
    core,
    is_closed,
    is_jaxpr,
    lax_primitive,
    lowering_rule,
    map_closed,
    mlir,
    open_jaxpr,
    shard_map_p,
)

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
_COLLECTIVES = lax_hooks.hooked_primitives()


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
    why = lax_hooks.fallback_cause(ctx, axes) if lax_hooks.is_enabled() else lax_hooks.OFF
    if why is None and hierarchy.plan(ctx, axes) is None:
        wins = [lax_hooks.wide(a) for a in ctx.avals_in]
        wouts = [lax_hooks.wide(a) for a in ctx.avals_out]
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
            reduce=np.int32(lax_hooks.REDUCE_CODES[reduce]),
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
program_order.lowers_to_strata(_combined_p, lax_hooks.is_enabled)


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
    return int(np.prod(aval.shape, dtype=np.int64)) * lax_hooks.wide(aval).dtype.itemsize


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
        if lax_hooks.is_enabled():
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
