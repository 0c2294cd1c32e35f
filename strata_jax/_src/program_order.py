"""Calls in program order: every device starts its strata calls in the same order.

A strata call waits for its peers, so two devices that start independent calls in different
orders would each wait in one call for the other. XLA CPU orders custom calls only by the
buffers they share, so this module makes the order explicit while a program is lowered:

- op ids: :func:`next_op_id` numbers the strata calls of a program (the op id half of a
  call's rendezvous key); the branches of a ``cond`` restart from the id at the cond, so ranks
  that take different branches meet at the same id;
- the chain: each strata call takes the previous call's ``Done`` byte as one more operand
  (:func:`chained`, which ``lowering.lower_strata_call`` and the check across fabrics emit
  their calls with), and a ``cond`` or ``while`` loop holding strata calls joins the chain of
  the block around it;
- shard_map regions: consecutive regions of one block hand a token from one to the next;
- inline lowering: nested jits and other higher-order primitives whose bodies hold strata
  calls are lowered into the caller's block, so their calls get op ids of their own and join
  the chain.

JAX's lowerings of ``cond``, ``while``, ``jit``, ``shard_map`` and a few higher-order
primitives are wrapped (never replaced) at import; :func:`keep_program_order` says whether the
chain is on (``STRATA_PROGRAM_ORDER``). Imported by ``lowering.py``; imports nothing of the
package but ``jax_compat``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from strata_jax._src.jax_compat import (
    SPMDAxisContext,
    UnspecifiedValue,
    as_closed,
    cond_p,
    core,
    custom_jvp_call_p,
    ir,
    ir_consts,
    jit_p,
    load_optional_modules,
    lowering_rule,
    map_closed,
    mark_uncacheable,
    mlir,
    registered_primitives,
    remat_p,
    scan_p,
    shard_map_p,
    while_p,
)

_OP_COUNTER = ("strata_jax", "op_counter")


def next_op_id(ctx) -> int:
    """A per-program index of strata calls, the op id half of a call's rendezvous key.

    The key is (run id, op id, occurrence, group): the run id is unique per execution and equal
    on every device and process of it, so op ids only need to be unique within one program.
    Counting per lowered module (not per Python process) keeps them equal across processes
    even when the processes lower different numbers of other programs.
    """
    # Every strata primitive registers its lowering with cacheable=False: JAX otherwise lowers
    # equal applications (same primitive, params and avals, e.g. psum(v) and psum(sin v)) once
    # and reuses that lowering, so they would share one op id and be told apart only by their
    # run-time start order, which differs between devices: across processes psum(v) would pair
    # with psum(sin v) (tests/mp_scripts/call_matching.py checks it does not).
    # ModuleContext has slots; its primitive-lowering cache is one dict shared by every
    # context of the module, so it can hold the counter under a private key.
    cache = ctx.module_context.cached_primitive_lowerings
    cache[_OP_COUNTER] = cache.get(_OP_COUNTER, 0) + 1
    return cache[_OP_COUNTER]


def _number_branches_from_the_cond() -> None:
    """Op ids count strata calls in program order; the branches of a ``lax.cond``/``switch``
    are alternatives, so each branch restarts from the id at the cond and the cond ends at the
    largest. Ranks that take different branches then meet at the same op id, and
    equal calls in one branch still get ids of their own. Done by wrapping JAX's cond lowering
    and giving each branch a mark at both ends (``_branch_mark_p``), whose lowering moves the
    counter; the state stays in the module's cache (JAX's own functions are never swapped,
    which was not safe with several threads lowering at once)."""
    rule = lowering_rule(cond_p)

    def cond_lowering(ctx, *args, **params):
        ordered = (
            keep_program_order()
            and _in_manual_region(ctx)
            and any(_has_strata_call(b.jaxpr) for b in params["branches"])
        )
        if ordered:  # the branch index: a scalar, so handing it on costs nothing
            args = (_order_after_chain(ctx, args[0], ctx.avals_in[0]), *args[1:])
        elif _at_top(ctx):
            keys = {_top_region_key(b.jaxpr) for b in params["branches"]} - {None}
            if len(keys) == 1:  # shard_maps in the branches, outside any shard_map
                key = keys.pop()
                branches = tuple(_with_block_token(b, key) for b in params["branches"])
                return _thread_region_token(
                    ctx,
                    key,
                    args,
                    lambda sub, a: _numbered_cond(sub, *a, **{**params, "branches": branches}),
                )
        outs = _numbered_cond(ctx, *args, **params)
        if ordered:
            _chain_to_result(ctx, outs)
        return outs

    def _numbered_cond(ctx, *args, branches, **params):
        # Each branch starts with a mark that sets the counter back to the cond's and ends with
        # one that notes how far it went: the state lives in this module's cache, and nothing
        # of JAX is swapped, so several threads may lower at once.
        cache = ctx.module_context.cached_primitive_lowerings
        start = cache.get(_OP_COUNTER, 0)
        cond = cache[_COND_IDS] = cache.get(_COND_IDS, 0) + 1
        cache[(_COND_TOP, cond)] = start
        marked = tuple(_with_branch_marks(b, start, cond) for b in branches)
        try:
            return rule(ctx, *args, branches=marked, **params)
        finally:
            cache[_OP_COUNTER] = cache.pop((_COND_TOP, cond))

    # Not cacheable: JAX would lower two equal conds once and copy the ops, op ids included.
    mlir.register_lowering(cond_p, cond_lowering, cacheable=False)


_COND_IDS = ("strata_jax", "conds")
_COND_TOP = ("strata_jax", "cond_top")

# The two ends of a cond branch (``_number_branches_from_the_cond``): no operands, no results.
# Its name does not start with "strata_" (``_has_strata_call``).
_branch_mark_p = core.Primitive("branch_mark_of_strata_cond")
_branch_mark_p.multiple_results = True
_branch_mark_p.def_abstract_eval(lambda *, end, start, cond: [])


def _branch_mark_lowering(ctx, *, end, start, cond):
    cache = ctx.module_context.cached_primitive_lowerings
    if end == "in":
        cache[_OP_COUNTER] = start
    else:
        key = (_COND_TOP, cond)
        cache[key] = max(cache[key], cache.get(_OP_COUNTER, 0))
    return []


mlir.register_lowering(_branch_mark_p, _branch_mark_lowering, cacheable=False)


def _with_branch_marks(branch, start: int, cond: int):
    """``branch`` (a closed jaxpr) between the two marks of cond ``cond`` (op ids restart at
    ``start``)."""
    mark = lambda end: core.new_jaxpr_eqn(  # noqa: E731
        [], [], _branch_mark_p, {"end": end, "start": start, "cond": cond}, core.no_effects
    )
    return map_closed(branch, lambda j: j.replace(eqns=[mark("in"), *j.eqns, mark("out")]))


DONE_AVAL = core.ShapedArray((1,), np.uint8)

_CHAIN = ("strata_jax", "program_order_chain")


def chained(ctx, rule, operands, avals_in, **attrs) -> list:
    """Emits ``rule`` (a ``jax.ffi.ffi_lowering``) on ``operands`` (of ``avals_in``) giving
    ``ctx.avals_out`` as a link of its block's chain of strata calls: it takes the block's last
    strata call's Done as one more operand, and, with calls chained, has a Done of its own, one
    byte never written, for the next call to take (``chain``). Returns its real results.

    Every call takes the previous one's Done, also a call that reads the previous call's
    results: XLA's simplifier may remove that path (a p * 0 of integers, a full overwrite),
    leaving the two calls unordered in the compiled program. Its own Done is one byte, not a real
    result, whose buffer would then stay alive until the next call; it also orders a call whose
    results are all empty."""
    ordered = keep_program_order()
    links = chain(ctx) if ordered else {}
    block = ir.InsertionPoint.current.block
    after = links.get(block)
    extra = [after] if after is not None else []
    done = [DONE_AVAL] if ordered else []
    sub = ctx.replace(
        avals_in=[*avals_in, *(a for _, a in extra)], avals_out=[*ctx.avals_out, *done]
    )
    results = list(rule(sub, *operands, *(v for v, _ in extra), **attrs))
    if done:
        links[block] = (results.pop(), DONE_AVAL)
    return results


def keep_program_order() -> bool:
    """Whether strata calls are chained in program order (``chain``): yes,
    unless ``STRATA_PROGRAM_ORDER=0``.

    Free order deadlocks, in one process too. XLA CPU's thunk executor offloads a thunk to
    another thread only when XLA marks it as blocking (a custom call is not); otherwise it runs it
    on the current thread and keeps that thread's queue of other ready thunks for afterwards.
    A strata call waiting for its peers then holds back the device's other work, so when two
    independent calls are ready in different orders on different devices, each device waits in
    one call for the other devices' ready-but-held-back part of it, until the timeout. Seen in
    train_moe's ``strata_ragged`` under 4 in-process devices (3 of 47 runs; in one, ranks 0-2
    waited in one ``ragged_all_to_all``, rank 3 in another of the same program). Chained,
    every device starts its strata calls in the same total order, so the earliest unfinished
    call always has every member either in it or on its way there with no thread held."""
    forced = os.environ.get("STRATA_PROGRAM_ORDER", "").strip()
    if forced in ("", "1"):
        return True
    if forced == "0":
        return False
    raise ValueError(
        f"STRATA_PROGRAM_ORDER={forced!r}: use 1 or leave it unset (chain strata calls in "
        "program order, the default), or 0 (never: may deadlock, see docs/design.md, Calls in "
        "program order)."
    )


def chain(ctx) -> dict:
    """The last strata call's ``Done`` result and its aval, per MLIR block of the module.

    Each strata call takes the previous call's ``Done`` (one byte of result, never written) in
    the same block as one more operand (``After`` in native/ffi/common.h; the handler never
    reads it). XLA CPU's thunk executor orders thunks only by the buffers they share, so without
    that operand it starts independent calls in whatever order they become ready, differently on
    each rank: across processes two ranks of one fabric could each wait in a different call for
    the other until the timeout (measured: 3 of 3 runs of 24 independent collectives under
    ``launch -n 4 --hosts 2``). With it every device runs its strata calls in program order, and
    the XLA collectives between them in a hierarchical lowering (which read one call's result
    and feed the next) with them. Calls in different blocks (the branches of a cond, a loop
    body) chain inside their block, and the cond or loop itself joins the chain of the block
    around it (``_order_control_flow``). Used where ``keep_program_order`` says so.
    """
    cache = ctx.module_context.cached_primitive_lowerings
    return cache.setdefault(_CHAIN, {})


_number_branches_from_the_cond()


def _in_manual_region(ctx) -> bool:
    """Whether ``ctx`` lowers inside a shard_map whose mesh axes are all manual: the only place
    where strata calls, and the ops that order them, may go (XLA's SPMD partitioner rejects a
    side-effecting custom call without a sharding in the automatically partitioned part)."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return False
    manual = axis_ctx.manual_axes
    return not manual or frozenset(manual) == frozenset(axis_ctx.mesh.axis_names)


# Primitives of JAX that lower to a strata call while their predicate holds (lax_hooks.py
# registers JAX's collectives, on while use_for_jax_lax() is): the chain counts them too.
_STRATA_WHEN: dict[core.Primitive, Any] = {}


def lowers_to_strata(prim: core.Primitive, when) -> None:
    """Counts ``prim`` (a primitive of JAX) as a strata call wherever ``when()`` is true at
    lowering, so the program-order chain and the shard_map region tokens include it."""
    _STRATA_WHEN[prim] = when


def _has_strata_call(jaxpr: core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("strata_"):
            return True
        when = _STRATA_WHEN.get(eqn.primitive)
        if when is not None and when():
            return True
        if any(_has_strata_call(sub) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _nothing_to_constrain(ctx, params) -> bool:
    """Whether a nested jit outside a manual region (at the top, or in a partly manual
    shard_map) sets nothing that inlining would drop: no shardings or layouts of its own."""
    shardings = (*params["in_shardings"], *params["out_shardings"])
    layouts = (*params["in_layouts"], *params["out_layouts"])
    return all(isinstance(s, UnspecifiedValue) for s in shardings) and all(
        lay is None for lay in layouts
    )


def _lower_inline(ctx, jaxpr, args, name: str | None = None):
    """Lowers ``jaxpr`` (a closed jaxpr) applied to ``args`` into the current block (not as a
    function)."""
    out, tokens = mlir.jaxpr_subcomp(
        ctx.module_context,
        jaxpr.jaxpr,
        ctx.name_stack.extend(name) if name else ctx.name_stack,
        ctx.tokens_in,
        ir_consts(ctx, jaxpr.consts, [v.aval for v in jaxpr.jaxpr.constvars]),
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        outer_traceback=ctx.traceback,
    )
    ctx.set_tokens_out(tokens)
    return out


def _inline_jits_holding_strata_calls() -> None:
    """A ``jax.jit`` nested in the program whose body holds a strata call is lowered inline,
    into the caller's block, instead of as a function that every call site calls.

    JAX lowers a nested jit once per module and calls that function from each site, so two
    calls of it would share their strata calls' op ids (after XLA inlines them, the devices
    would tell them apart only by the order they start them, which differs: wrong pairs), and
    its calls would sit outside the caller's program-order chain (``chain``).
    Inline, each site gets its own op ids and joins the chain. Inside a manual ``shard_map``
    region, where the nested jit's shardings are per-device anyway; outside (a jit around a
    shard_map), only when the jit sets no shardings or layouts (``_nothing_to_constrain``), so
    its shard_maps join the chain of the caller's regions (``_chain_shard_map_regions``).
    Jits without strata calls lower as JAX does. Done by wrapping JAX's jit lowering."""
    rule = lowering_rule(jit_p)

    def jit_lowering(ctx, *args, jaxpr, name, **params):
        if not (
            _has_strata_call(jaxpr.jaxpr)
            and (_in_manual_region(ctx) or _nothing_to_constrain(ctx, params))
        ):
            return rule(ctx, *args, jaxpr=jaxpr, name=name, **params)
        return _lower_inline(ctx, jaxpr, args, name)

    mlir.register_lowering(jit_p, jit_lowering)
    # A jax.custom_jvp function is lowered inline by the same rule as a custom_vjp one, but
    # cacheable: JAX then lowered it in a function of its own, outside the caller's chain.
    mark_uncacheable(custom_jvp_call_p)


_inline_jits_holding_strata_calls()


def _order_after_chain(ctx, value, aval):
    """``value`` handed on by a ``strata_order`` call that also takes the block's last strata
    call's Done, so what reads the result runs after that call; ``value`` itself if the block
    has no strata call yet."""
    after = chain(ctx).get(ir.InsertionPoint.current.block)
    if after is None:
        return value
    rule = jax.ffi.ffi_lowering("strata_order", has_side_effect=True, operand_output_aliases={0: 0})
    sub = ctx.replace(primitive=None, avals_in=[aval, after[1]], avals_out=[aval])
    (out,) = rule(sub, value, after[0])
    return out


def _is_value(v) -> bool:
    """One MLIR value (an OpResult or BlockArgument too: not always ``ir.Value`` instances in
    these bindings), not a tuple of them."""
    return not isinstance(v, (tuple, list)) and hasattr(v, "type") and hasattr(v, "owner")


def _chain_to_result(ctx, outs) -> None:
    """Makes the block's next strata call come after the op that produced ``outs`` (a cond or
    while loop holding strata calls): it takes the smallest non-empty result as its ``After``."""
    best = None
    for value, aval in zip(outs, ctx.avals_out, strict=False):
        if _is_value(value) and getattr(aval, "size", 0) > 0:
            if best is None or aval.size < best[1].size:
                best = (value, aval)
    if best is not None:
        chain(ctx)[ir.InsertionPoint.current.block] = best


def _order_control_flow() -> None:
    """Puts a ``while`` loop (``scan``, ``fori_loop``) whose body holds strata calls into the
    program-order chain of the block around it, as ``cond`` is (``_number_branches_from_the_
    cond``): its smallest carry goes through ``strata_order`` after the block's last strata
    call, and the block's next strata call takes its smallest result as ``After``. The calls
    inside chain in their own block. Without it the loop's calls and independent calls around
    it could start in different orders on different devices (``keep_program_order``). Also
    makes the lowerings of ``jax.checkpoint`` and ``scan`` uncacheable: JAX would lower two
    equal checkpointed calls once and copy the ops, op ids included, and lowers a cacheable
    primitive in a block of its own."""
    rule = lowering_rule(while_p)

    def while_lowering(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts, **params):
        ordered = (
            keep_program_order()
            and _in_manual_region(ctx)
            and (_has_strata_call(cond_jaxpr.jaxpr) or _has_strata_call(body_jaxpr.jaxpr))
        )
        if ordered:
            n0 = cond_nconsts + body_nconsts
            carry = [
                (k, a)
                for k, a in enumerate(ctx.avals_in[n0:], n0)
                if _is_value(args[k]) and getattr(a, "size", 0) > 0
            ]
            if carry:
                k, aval = min(carry, key=lambda ka: ka[1].size)
                args = (*args[:k], _order_after_chain(ctx, args[k], aval), *args[k + 1 :])
        # Not under a batched predicate (jax.vmap of a loop whose stop differs per example):
        # JAX then selects every carry by the predicate, which has no batch dimension in the
        # token.
        batched = cond_jaxpr.out_avals[0].shape != ()
        key = None if ordered or batched or not _at_top(ctx) else _top_region_key(body_jaxpr.jaxpr)
        if key is not None:  # shard_maps in the body, outside any shard_map: thread the token
            return _thread_region_token(
                ctx,
                key,
                args,
                lambda sub, a: rule(
                    sub,
                    *a,
                    cond_jaxpr=_with_block_token(cond_jaxpr, key, hand_on=False),
                    body_jaxpr=_with_block_token(body_jaxpr, key),
                    cond_nconsts=cond_nconsts,
                    body_nconsts=body_nconsts,
                    **params,
                ),
            )
        outs = rule(
            ctx,
            *args,
            cond_jaxpr=cond_jaxpr,
            body_jaxpr=body_jaxpr,
            cond_nconsts=cond_nconsts,
            body_nconsts=body_nconsts,
            **params,
        )
        if ordered:
            _chain_to_result(ctx, outs)
        return outs

    mlir.register_lowering(while_p, while_lowering, cacheable=False)
    mark_uncacheable(remat_p)
    # JAX lowers a cacheable primitive in a function of its own and inlines it, so a scan's
    # while loop would not see the block of the calls around it.
    mark_uncacheable(scan_p)


_order_control_flow()


_REGION_CHAIN = ("strata_jax", "region_chain")

# Marks the two ends of a shard_map body in ``_chain_shard_map_regions``: at the start the
# body's chain begins at the region's token; at the end the token is handed on after the body's
# last strata call. Its name does not start with "strata_" (``_has_strata_call``).
_region_end_p = core.Primitive("region_end_of_strata_chain")
_region_end_p.def_abstract_eval(lambda tok, *, end: tok)


def _region_end_lowering(ctx, tok, *, end):
    if end == "in":
        chain(ctx).setdefault(ir.InsertionPoint.current.block, (tok, ctx.avals_in[0]))
        return [tok]
    after = chain(ctx).get(ir.InsertionPoint.current.block)
    if after is not None and after[1].shape == (1,) and after[1].dtype == np.uint8:
        return [after[0]]  # the last call's Done: hand it on as it is
    return [_order_after_chain(ctx, tok, ctx.avals_in[0])]  # after a cond's or loop's result


mlir.register_lowering(_region_end_p, _region_end_lowering, cacheable=False)


def _chain_shard_map_regions() -> None:
    """Chains the strata calls of consecutive ``shard_map`` regions of one block (two layers in
    parallel, or a shard_map and its transpose under ``jax.grad``) in program order, as the
    calls inside one region are (``chain``).

    Without it each region's calls chain only among themselves, and independent calls of two
    regions deadlocked in one process (two towers of psums and all_to_alls over 8 devices: a
    timeout within the first 50 steps in 4 of 4 runs, "rank 2: waiting in psum (op 1), another
    call of this same program"). Each region holding strata calls gets one more input and
    output, a 1-byte token per device sharded over its manual axes: its first strata call takes
    the token as ``After``, its last call's Done (or, after a cond or loop, the token handed on
    by ``strata_order``) leaves as the token and enters the next
    region over the same mesh in the same block. Also makes shard_map's lowering uncacheable:
    JAX lowered two equal shard_map calls once, as one function with shared op ids.

    A shard_map inside a partly manual one (over the remaining axes) chains with the other such
    regions of its block the same way. Left as JAX lowers them: shard_maps whose body is not
    all manual, or over one device (no manual computation), and the bodies of two partly manual
    shard_maps. A loop or cond outside any shard_map whose body holds regions hands the token
    through (``_thread_region_token``)."""
    from jax.sharding import PartitionSpec

    rule = lowering_rule(shard_map_p)

    def shard_map_lowering(ctx, *in_nodes, jaxpr, mesh, in_specs, out_specs, **params):
        names, axes, n = region = _region_key(mesh, params["newly_manual_axes"])
        axis_ctx = ctx.module_context.axis_context
        outer = set(axis_ctx.manual_axes) if isinstance(axis_ctx, SPMDAxisContext) else set()
        if (
            not keep_program_order()
            or set(axes) | outer != set(names)  # the body would not be all manual
            or n == 1
            or not _has_strata_call(jaxpr)
        ):
            return rule(
                ctx,
                *in_nodes,
                jaxpr=jaxpr,
                mesh=mesh,
                in_specs=in_specs,
                out_specs=out_specs,
                **params,
            )
        tok_in, key = _block_region_token(ctx, region)
        # per device: one byte (only lowered, never type-checked)
        body = _with_token_ends(jaxpr, DONE_AVAL, _region_end_p, {})
        token = core.ShapedArray((n,), np.uint8)
        spec = PartitionSpec(axes)
        sub = ctx.replace(avals_in=[*ctx.avals_in, token], avals_out=[*ctx.avals_out, token])
        outs = list(
            rule(
                sub,
                *in_nodes,
                tok_in,
                jaxpr=body,
                mesh=mesh,
                in_specs=(*in_specs, spec),
                out_specs=(*out_specs, spec),
                **params,
            )
        )
        if sub.tokens_out is not None:
            ctx.set_tokens_out(sub.tokens_out)
        _region_chains(ctx)[key] = outs.pop()
        return outs

    mlir.register_lowering(shard_map_p, shard_map_lowering, cacheable=False)


def _region_chains(ctx) -> dict:
    """The last shard_map region's token per (block, mesh axis names, manual axes, devices)."""
    return ctx.module_context.cached_primitive_lowerings.setdefault(_REGION_CHAIN, {})


def _block_region_token(ctx, key: tuple):
    """The current block's region token for ``key`` (a constant before its first region) and
    its entry in ``_region_chains``."""
    entry = (ir.InsertionPoint.current.block, *key)
    tok = _region_chains(ctx).get(entry)
    if tok is None:
        tok = mlir.ir_constant(np.zeros((key[2],), np.uint8))
    return tok, entry


# Marks the two ends of a loop body or cond branch outside any shard_map that holds strata
# shard_map regions: at the start the body's region chain begins at the token it was given, at
# the end it hands on its last region's token (``_thread_region_token``).
_block_token_p = core.Primitive("block_end_of_strata_regions")
_block_token_p.def_abstract_eval(lambda tok, *, end, key: tok)


def _block_token_lowering(ctx, tok, *, end, key):
    entry = (ir.InsertionPoint.current.block, *key)
    if end == "in":
        _region_chains(ctx)[entry] = tok
        return [tok]
    return [_region_chains(ctx).get(entry, tok)]


mlir.register_lowering(_block_token_p, _block_token_lowering, cacheable=False)


def _top_region_key(jaxpr: core.Jaxpr) -> tuple | None:
    """The (mesh axis names, manual axes, devices) of the all-manual shard_map regions holding
    strata calls in ``jaxpr`` (outside shard_map bodies), if they all share one; else None."""
    keys = set()

    def visit(j: core.Jaxpr) -> None:
        for e in j.eqns:
            if e.primitive.name == "shard_map":
                names, axes, n = key = _region_key(e.params["mesh"], e.params["newly_manual_axes"])
                if set(axes) == set(names) and n > 1 and _has_strata_call(e.params["jaxpr"]):
                    keys.add(key)
                continue
            for sub in core.jaxprs_in_params(e.params):
                visit(sub)

    visit(jaxpr)
    return keys.pop() if len(keys) == 1 else None


def _region_key(mesh, manual) -> tuple:
    """(mesh axis names, manual axes in mesh order, devices along them) of a shard_map."""
    axes = tuple(a for a in mesh.axis_names if a in manual)
    return tuple(mesh.axis_names), axes, math.prod(int(mesh.shape[a]) for a in axes)


def _with_token_ends(j: core.Jaxpr, aval, prim, params: dict, hand_on: bool = True):
    """``j`` taking a token of ``aval`` as one more (last) input, marked at the start by
    ``prim`` (``end="in"``), and, with ``hand_on``, returning it as one more (last) output,
    marked at the end (``end="out"``)."""
    first = core.Var(aval)
    outvars, eqns = list(j.outvars), list(j.eqns)
    if hand_on:
        mid, last = core.Var(aval), core.Var(aval)
        eqns = [
            core.new_jaxpr_eqn([first], [mid], prim, {**params, "end": "in"}, core.no_effects),
            *eqns,
            core.new_jaxpr_eqn([mid], [last], prim, {**params, "end": "out"}, core.no_effects),
        ]
        outvars.append(last)
    return j.replace(invars=[*j.invars, first], outvars=outvars, eqns=eqns)


def _with_block_token(jaxpr, key: tuple, hand_on: bool = True):
    """A loop body or cond branch ``jaxpr`` (closed) taking the block's region token for
    ``key`` as one more input, and, with ``hand_on``, returning it after its last region."""
    aval = core.ShapedArray((key[2],), np.uint8)
    return map_closed(
        jaxpr, lambda j: _with_token_ends(j, aval, _block_token_p, {"key": key}, hand_on)
    )


def _at_top(ctx) -> bool:
    """Whether ``ctx`` lowers outside every shard_map (where regions are chained by token)."""
    axis_ctx = ctx.module_context.axis_context
    return keep_program_order() and not (
        isinstance(axis_ctx, SPMDAxisContext) and axis_ctx.manual_axes
    )


def _thread_region_token(ctx, key, args, lower):
    """Lowers a while loop or cond outside any shard_map whose body holds strata shard_map
    regions with the block's region token as one more (last) operand and result: ``lower(sub,
    args)`` emits it with jaxprs from ``_with_block_token``. The regions inside then come
    after the regions before it, and the regions after it after them."""
    tok, entry = _block_region_token(ctx, key)
    aval = core.ShapedArray((key[2],), np.uint8)
    sub = ctx.replace(avals_in=[*ctx.avals_in, aval], avals_out=[*ctx.avals_out, aval])
    outs = list(lower(sub, (*args, tok)))
    if sub.tokens_out is not None:
        ctx.set_tokens_out(sub.tokens_out)
    _region_chains(ctx)[entry] = outs.pop()
    return outs


_chain_shard_map_regions()


# Other higher-order primitives that JAX lowers cacheably, as a function of its own, which would
# leave the strata calls inside custom_vmap, custom_linear_solve and
# custom_vjp(optimize_remat=True) outside the chain: lowered inline instead, so their calls join
# the chain of the block around them. By name, since some live in modules that ``import jax``
# need not load.
_INLINE_HIGHER_ORDER = (
    "custom_linear_solve",
    "custom_vmap_call",
    "linear_call",
    "remat_opt",
    "run_state",
)


def _lower_higher_order_primitives_inline() -> None:
    load_optional_modules()
    for prim in registered_primitives():
        if prim.name in _INLINE_HIGHER_ORDER:
            mark_uncacheable(prim)
    # closed_call (custom_vjp's forward with optimize_remat, named_call) and call always lower
    # as a function: inline them when they hold strata calls.
    for prim in (core.closed_call_p, core.call_p):
        rule = lowering_rule(prim)

        def call_lowering(ctx, *args, call_jaxpr, rule=rule, **params):
            closed = as_closed(call_jaxpr)
            if not _has_strata_call(closed.jaxpr):
                return rule(ctx, *args, call_jaxpr=call_jaxpr, **params)
            return _lower_inline(ctx, closed, args)

        mlir.register_lowering(prim, call_lowering, cacheable=False)


_lower_higher_order_primitives_inline()
