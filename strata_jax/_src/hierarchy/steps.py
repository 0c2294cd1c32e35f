"""One step of a hierarchical collective: a collective over explicit groups, run by strata (the
groups inside one fabric) or by XLA's own collective (the groups between fabrics, counted in
``comm_stats()["inter_fabric_bytes"]``), and the two-fabric forms of strata's calls that hand the
partner fabric's block to a result of its own (``divert``).
"""

from __future__ import annotations

import contextvars

import jax
import numpy as np

from strata_jax._src import lowering, operators, runtime
from strata_jax._src.jax_compat import core, hlo, ir, mlir

group_collective_p = core.Primitive("strata_group_collective")
KINDS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "permute",
    "all_gather_reduce",
    "all_gather_part",
)


# The check of the call being lowered hierarchically (checks.PendingCheck), until its first XLA
# step: the check's custom call is bound at the call's first step, after it when that step is
# strata's (a link of the program-order chain after that step), so that the fabrics' first
# steps need not wait for the descriptors' all_gather between fabrics. Placed first in the chain
# the check put its XLA round trip in front of every step: a 16 MiB psum over 2 simulated hosts
# of 2 processes took 11.5-13.6 ms against 9.9-10.5 ms unchecked; placed after the first step,
# 9.8-11.2 against 8.7-9.3 ms (3 alternated runs each, load 3). Inside a fabric strata's
# rendezvous compares the call itself. The first XLA step, the first byte that crosses
# fabrics, is made to read the check's result (strata_order: its operand, handed on, aliased),
# so XLA cannot start it before the check. (A step that consumes the program's own parameter
# then costs a copy of it; a value that later steps read too goes through gate() first.)
pending_check: contextvars.ContextVar = contextvars.ContextVar("strata_pending_check", default=None)


# strata_order(x, after) -> x (native/ffi/hier_handlers.h): x handed on after ``after`` exists,
# with no copy unless x is still read elsewhere or is a parameter of the program.
after_p = core.Primitive("strata_after")
after_p.def_abstract_eval(lambda x, after: x)
mlir.register_lowering(
    after_p,
    jax.ffi.ffi_lowering("strata_order", operand_output_aliases={0: 0}),
    platform="cpu",
    cacheable=False,
)


def step(
    x,
    kind: str,
    engine: str,
    groups,
    *,
    reduce: str = "sum",
    pairs=(),
    split: int = 0,
    concat: int = 0,
    z=None,
    z_first=(),
    placement=(),
    part=-1,
    x_from=(),
    counted=-1,
):
    """One collective over explicit groups; ``split``/``concat``: all_to_all's (tiled) axes.

    ``counted`` (engine ``xla_check`` only): the bytes to add to ``inter_fabric_bytes`` when
    the check's message carries a step's data (checks.PendingCheck.carry); -1: none.

    ``all_gather_reduce`` (strata only): the all_gather of ``x reduce z``, combined in the order
    ``z_first[partition]`` gives (1: z first); with ``x_from`` (per partition, -1: itself), the
    z of partition p pairs with the x of partition ``x_from[p]``, and the pair lands in that
    one's output block. ``all_gather_part`` (strata only): sub-block
    ``part`` of an all_gather with ``placement`` (x is that sub-block of every member; the
    output has all of them, the other sub-blocks left unwritten, or ``z``'s, which it
    aliases). ``placement`` (strata all_gather and
    reduce_scatter only): one row per group of ``groups`` (:func:`_per_intra_group`), each of
    n * parts entries (parts = ``len(placement) // (len(groups) * n)``): all_gather: each input
    is parts equal blocks, and block f of group rank j lands at output block ``row[j * parts +
    f]``; reduce_scatter: each output is parts equal blocks, and block f of group rank j sums
    input block ``row[j * parts + f]`` of every member.
    """
    if engine == "xla":  # between fabrics: after the call's check, if one is pending
        pending = pending_check.get()
        if pending is not None:  # a small first step crosses inside the check's own message
            out = pending.carry(
                x, kind, groups, reduce=reduce, pairs=pairs, split=split, concat=concat
            )
            if out is not None:
                pending_check.set(None)
                return out
        x = gate(x, carry=False)
    out = group_collective_p.bind(
        x,
        *(() if z is None else (z,)),
        kind=kind,
        engine=engine,
        groups=tuple(map(tuple, groups)),
        reduce=reduce,
        pairs=tuple(pairs),
        split=int(split),
        concat=int(concat),
        z_first=tuple(int(v) for v in z_first),
        placement=tuple(int(v) for v in placement),
        part=int(part),
        x_from=tuple(int(v) for v in x_from),
        counted=int(counted),
    )
    if engine == "strata":
        strata_step_done()
    return out


def strata_step_done() -> None:
    """After a strata step of a checked call: its check is bound now if it was not yet
    (chained after this step; the descriptors' all_gather runs meanwhile), unless the check
    waits to carry the call's first step between fabrics (checks.PendingCheck.carry)."""
    pending = pending_check.get()
    if pending is not None and not pending.deferred:
        pending.result()


def gate(x, carry: bool = True):
    """``x`` as the first step between fabrics may read it: handed on after the call's check
    (which is bound here if no strata step bound it), or ``x`` itself when no check is pending.
    Pass every later reader of ``x`` the returned value, not ``x``: the hand-on aliases its
    operand, and XLA copies an operand that is read again afterwards. With ``carry`` (the next
    step between fabrics is one step over ``x``), ``x`` itself when that step may cross inside
    the check's message (checks.PendingCheck.carry; step() then does)."""
    pending = pending_check.get()
    if pending is None or (carry and pending.may_carry(x)):  # step() carries x
        return x
    pending_check.set(None)
    return after_p.bind(x, pending.result())


def _step_abstract_eval(
    aval,
    *z,
    kind,
    engine,
    groups,
    reduce,
    pairs,
    split,
    concat,
    z_first,
    placement,
    part=-1,
    x_from=(),
    counted=-1,
):
    n = len(groups[0])
    if kind == "all_gather_part":
        parts = len(placement) // (len(groups) * n)
        return aval.update(shape=(aval.shape[0] * n * parts, *aval.shape[1:]))
    if kind == "reduce_scatter":
        return aval.update(shape=(aval.shape[0] // n, *aval.shape[1:]))
    if kind in ("all_gather", "all_gather_reduce"):
        return aval.update(shape=(aval.shape[0] * n, *aval.shape[1:]))
    if kind == "all_to_all":
        shape = list(aval.shape)
        shape[split] //= n
        shape[concat] *= n
        return aval.update(shape=tuple(shape))
    return aval


group_collective_p.def_abstract_eval(_step_abstract_eval)


def _groups_attr(groups) -> ir.DenseElementsAttr:
    return ir.DenseIntElementsAttr.get(np.ascontiguousarray(np.asarray(groups, np.int64)))


def _channel():
    return hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID, mlir.DEVICE_TO_DEVICE_TYPE)


# The element operation of each reduction (jax.lax.add_p for "sum"...), from the operator table.
REDUCERS = {kind: getattr(jax.lax, f"{e}_p") for kind, e in operators.ELEMENT_OPS.items()}


def _add_reducer(ctx, op, dtype, reduce: str) -> None:
    scalar = core.ShapedArray((), dtype)
    t = mlir.aval_to_ir_type(ctx.module_context, scalar)
    block = op.regions[0].blocks.append(t, t)
    with ir.InsertionPoint(block):
        lower = mlir.lower_fun(REDUCERS[reduce].bind, multiple_results=False)
        sub = ctx.replace(primitive=None, avals_in=[scalar] * 2, avals_out=[scalar])
        out = lower(sub, *block.arguments)
        flat, _ = mlir.ir_tree_registry.flatten(out)
        hlo.return_(flat)


def _xla_lowering(ctx, x, *, kind, groups, reduce, pairs, split=0, concat=0):
    (aval_in,), (aval_out,) = ctx.avals_in, ctx.avals_out
    rg = _groups_attr(groups)
    gids = ir.BoolAttr.get(True)
    if kind == "all_reduce":
        op = hlo.AllReduceOp(
            [x.type], [x], replica_groups=rg, channel_handle=_channel(), use_global_device_ids=gids
        )
        _add_reducer(ctx, op, aval_in.dtype, reduce)
        return op.result
    if kind == "reduce_scatter":
        op = hlo.ReduceScatterOp(
            mlir.aval_to_ir_type(ctx.module_context, aval_out),
            x,
            scatter_dimension=mlir.i64_attr(0),
            replica_groups=rg,
            channel_handle=_channel(),
            use_global_device_ids=gids,
        )
        _add_reducer(ctx, op, aval_in.dtype, reduce)
        return op.result
    if kind == "all_gather":
        return hlo.AllGatherOp(
            [mlir.aval_to_ir_type(ctx.module_context, aval_out)],
            [x],
            all_gather_dim=mlir.i64_attr(0),
            replica_groups=rg,
            channel_handle=_channel(),
            use_global_device_ids=gids,
        ).results[0]
    if kind == "all_to_all":
        return hlo.AllToAllOp(
            [x],
            split_dimension=mlir.i64_attr(split),
            concat_dimension=mlir.i64_attr(concat),
            split_count=mlir.i64_attr(len(groups[0])),
            replica_groups=rg,
            channel_handle=_channel(),
        ).results[0]
    if kind == "permute":
        return hlo.CollectivePermuteOp(
            x,
            mlir.dense_int_elements(np.asarray(pairs, np.int64).reshape(-1, 2)),
            channel_handle=_channel(),
        ).results[0]
    raise AssertionError(kind)


_STRATA_TARGETS = {
    "reduce_scatter": "strata_psum_scatter",
    "all_gather": "strata_all_gather",
    "all_gather_reduce": "strata_all_gather_reduce",
    "all_gather_part": "strata_all_gather_part",
    "all_to_all": "strata_all_to_all",
    "permute": "strata_ppermute",
}
_REDUCE_CODES = operators.REDUCE_CODES_BY_KIND


def _strata_lowering(
    ctx,
    x,
    *z,
    kind,
    groups,
    reduce,
    pairs,
    split=0,
    concat=0,
    z_first=(),
    placement=(),
    part=-1,
    x_from=(),
):
    """One strata call over explicit intra-fabric groups (``lowering.lower_strata_call``)."""
    if kind not in _STRATA_TARGETS:
        return _xla_lowering(ctx, x, kind=kind, groups=groups, reduce=reduce, pairs=pairs)
    attrs: dict = {}
    if kind in ("reduce_scatter", "all_gather_reduce"):
        attrs["reduce"] = np.int32(_REDUCE_CODES[reduce])
    if kind == "all_gather_reduce":
        attrs["z_first"] = np.asarray(z_first, np.int64)
        attrs["x_from"] = np.asarray(x_from or [-1] * len(z_first), np.int64)
    elif kind == "all_to_all":
        attrs.update(split_axis=np.int64(split), concat_axis=np.int64(concat))
    elif kind == "permute":
        # The same local pattern in every group (checked by the caller): take the first's.
        first = {pid: r for r, pid in enumerate(groups[0])}
        sources = np.full(len(groups[0]), -1, np.int64)
        for s, d in pairs:
            if s in first:
                sources[first[d]] = first[s]
        attrs["sources"] = sources
    target = _STRATA_TARGETS[kind]
    aliases = None
    if kind == "all_gather_part":
        attrs.update(placement=np.asarray(placement, np.int64), part=np.int64(part))
        if z:  # the output is z's buffer, with this sub-block written into it
            target += "_into"
            aliases = {1: 0}
    elif placement:
        attrs["placement"] = np.asarray(placement, np.int64)
        target += "_placed"  # strata_all_gather_placed, strata_psum_scatter_placed
    (out,) = lowering.lower_strata_call(
        ctx,
        target,
        kind,
        [x, *z],
        np.asarray(groups, np.int64),
        operand_output_aliases=aliases,
        **attrs,
    )
    return out


def _count_inter(ctx, x, nbytes: int) -> None:
    """Custom call that adds nbytes to comm_stats()['inter_fabric_bytes'] when it runs."""
    # Registers the FFI targets: this may be the program's only strata call (a group handed
    # to XLA whole), which would otherwise fail to compile ("No FFI handler registered").
    runtime.native()
    rule = jax.ffi.ffi_lowering("strata_count_inter_fabric", has_side_effect=True)
    sub = ctx.replace(primitive=None, avals_out=[core.ShapedArray((), np.uint8)])
    rule(sub, x, bytes=np.int64(nbytes))


def inter_bytes(kind: str, nbytes: int, groups, pairs) -> int:
    """The bytes a step between fabrics adds to ``inter_fabric_bytes`` per rank: its input's,
    or for a permute the senders' share of the members' (on average)."""
    if kind == "permute":
        members = len({int(v) for g in groups for v in g})
        return nbytes * len({a for a, _ in pairs}) // max(1, members)
    return nbytes


def _step_lowering(ctx, x, *z, engine, counted=-1, **params):
    """``params``: the step's (kind, groups, ...); ``counted`` only for ``xla_check``."""
    kw = {k: params[k] for k in ("kind", "groups", "reduce", "pairs", "split", "concat")}
    if engine == "strata":
        extra = {k: params[k] for k in ("z_first", "placement", "part", "x_from")}
        out = _strata_lowering(ctx, x, *z, **extra, **kw)
    elif engine == "xla_check":  # the check's message: counted only for the data it carries
        if counted >= 0:
            _count_inter(ctx, x, counted)
        out = _xla_lowering(ctx, x, **kw)
    else:
        (aval_in,) = ctx.avals_in
        nbytes = int(aval_in.size) * aval_in.dtype.itemsize
        _count_inter(ctx, x, inter_bytes(kw["kind"], nbytes, kw["groups"], kw["pairs"]))
        out = _xla_lowering(ctx, x, **kw)
    return [out]


mlir.register_lowering(group_collective_p, _step_lowering, platform="cpu", cacheable=False)

# The intra-fabric all_to_all of the two-fabric exchange, with the partner fabric's aggregate
# (index divert[partition] of axis divert_axis) in a second result of its own
# (native/coll/collectives.h: Divert): that result crosses as it is, and what comes back goes in
# place of the index left unwritten in the first, with no copy of either half.
a2a_divert_p = core.Primitive("strata_all_to_all_divert")
a2a_divert_p.multiple_results = True


def _a2a_divert_abstract_eval(
    aval, *, groups, split, concat, divert_axis, divert, move_to, divert_dest
):
    """The first result is laid out with divert_axis moved to ``move_to`` and merged with the
    axis after it there (the two-fabric all_to_all's final layout; the same bytes as strata
    writes them); the second has divert_axis of size 1."""
    out = _step_abstract_eval(
        aval,
        kind="all_to_all",
        engine="strata",
        groups=groups,
        reduce="sum",
        pairs=(),
        split=split,
        concat=concat,
        z_first=(),
        placement=(),
    )
    shape2 = list(out.shape)
    shape2[divert_axis] = 1
    sh = list(out.shape)
    sh.insert(move_to, sh.pop(divert_axis))
    first = (*sh[:move_to], sh[move_to] * sh[move_to + 1], *sh[move_to + 2 :])
    return [out.update(shape=first), out.update(shape=tuple(shape2))]


def _a2a_divert_lowering(
    ctx, x, *, groups, split, concat, divert_axis, divert, move_to, divert_dest
):
    return lowering.lower_strata_call(
        ctx,
        "strata_all_to_all_divert",
        "all_to_all",
        [x],
        np.asarray(groups, np.int64),
        split_axis=np.int64(split),
        concat_axis=np.int64(concat),
        divert_axis=np.int64(divert_axis),
        move_to=np.int64(move_to),
        divert=np.asarray(divert, np.int64),
        divert_dest=np.asarray(divert_dest, np.int64),
    )


a2a_divert_p.def_abstract_eval(_a2a_divert_abstract_eval)
mlir.register_lowering(a2a_divert_p, _a2a_divert_lowering, platform="cpu", cacheable=False)

# The intra-fabric reduce-scatter of the two-fabric psum_scatter, with the partner fabric's
# block (sub-block divert[partition] of the output's two) in a second result of its own, left
# unwritten in the first (native/coll/collectives.h: reduce_scatter): it crosses as it is.
rs_divert_p = core.Primitive("strata_psum_scatter_placed_divert")
rs_divert_p.multiple_results = True


def _rs_divert_abstract_eval(aval, *, groups, reduce, placement, divert):
    n = len(groups[0])
    out = aval.update(shape=(aval.shape[0] // n, *aval.shape[1:]))
    return [out, aval.update(shape=(out.shape[0] // 2, *aval.shape[1:]))]


def _rs_divert_lowering(ctx, x, *, groups, reduce, placement, divert):
    return lowering.lower_strata_call(
        ctx,
        "strata_psum_scatter_placed_divert",
        "psum_scatter" if reduce == "sum" else operators.REDUCTIONS[_REDUCE_CODES[reduce]],
        [x],
        np.asarray(groups, np.int64),
        reduce=np.int32(_REDUCE_CODES[reduce]),
        placement=np.asarray(placement, np.int64),
        divert=np.asarray(divert, np.int64),
    )


rs_divert_p.def_abstract_eval(_rs_divert_abstract_eval)
mlir.register_lowering(rs_divert_p, _rs_divert_lowering, platform="cpu", cacheable=False)

# This partition's id (u32), for the rank-dependent halves of the two-fabric exchanges below.
partition_id_p = core.Primitive("strata_partition_id")
partition_id_p.def_abstract_eval(lambda: core.ShapedArray((), np.uint32))
mlir.register_lowering(partition_id_p, lambda ctx: [hlo.partition_id()], platform="cpu")
