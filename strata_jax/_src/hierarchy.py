"""Collectives whose group spans fabrics: strata inside each fabric, XLA's collectives between.

A group of a mesh axis (or tuple of axes) whose devices live in several fabric domains (see
``topology.py``) cannot meet in one shared-memory rendezvous: no fabric can map another's
memory. The split is decided at lowering time from the mesh's device assignment
(``device.process_index``) and the job's fabric map, so the program stays SPMD and the
primitives' autodiff/vmap rules are untouched (they live above the lowering).

Layout. Every group is cut by fabric into F *fabric slots* (ordered by first appearance in the
group) of L members each (ordered as in the group): group rank g sits at (f(g), l(g)). The
*intra* groups are one fabric slot of one group (L devices, one fabric: strata's path); the
*inter* groups are the members with equal l across the slots (F devices, one per fabric: XLA's
collective, gloo or MPI, over explicit replica groups with global device ids, as
``jax/_src/lax/parallel.py`` lowers ``psum``). A group whose fabrics hold different numbers of
its members, or whose layout differs between groups, and a group with one device per fabric,
lower straight to XLA's collective for the whole op.

Algorithms (NCCL's intra-node/inter-node split; DeepEP's NVLink aggregation before RDMA;
StrataCL's supernode/scale-out, Hu et al. 2026). Inter-fabric bytes are per device:
- all-reduce (psum/pmax/pmin): reduce-scatter inside the fabric (padded to a multiple of L) ->
  all-reduce of the 1/L shard across fabrics -> all-gather inside. Crosses S/L. With F = 2
  the all-reduce is one collective-permute of the shard with the partner (gloo's ring takes
  two rounds for the same bytes; measured faster, most below 4 MiB), then reduced with the
  own one inside the intra all_gather (strata's all_gather_reduce: above 512 KiB every
  member writes its reduced block straight into every peer's output; below, each reduces
  every member's published pair into its own output, which the low-latency path can run).
  From ONE_WAY_BYTES the shards cross along the two-fabric ring instead (one
  collective-permute, every connection one way), and a member's received shard is paired with
  the own fabric's shard of the same index, which another member may hold (x_from).
- all_gather: all-gather across fabrics of the own block first (F-1 blocks cross, not
  (F-1)*L), then inside the fabric, where each block is written straight to its place in
  group order (strata_all_gather_placed; no reorder pass). F = 2 from ONE_WAY_BYTES: the own
  fabric's blocks are gathered first, the own block crosses along the ring, and the blocks
  that crossed are gathered into the same output (strata_all_gather_part[_into]).
- psum_scatter: reduce-scatter inside, each member summing the F blocks of its local index
  where they lie (strata_reduce_scatter_placed; no reorder pass), then reduce-scatter across
  fabrics (F = 2: the partner's block, which strata writes to a result of its own, by one
  collective-permute, reduced on arrival).
  Crosses (F-1)/F of S/L.
- all_to_all: the split axis viewed as [F, L*b] (free); all-to-all inside the fabric splitting
  the L*b part (a strided copy in strata, no transpose in XLA), so that each member holds
  everything its fabric sends to local index l, one aggregate per destination fabric; then
  one all-to-all across fabrics of those aggregates (F = 2: strata writes the partner fabric's
  aggregate to a buffer of its own, which crosses by one collective-permute; what comes back is
  written in place of it, S/2 copied once). Crosses (F-1)/F of S.
- ppermute: pairs inside a fabric through strata, pairs across through XLA's
  collective-permute; each destination takes the one that wrote it.
- pbroadcast: all-gather across fabrics among the source's local index, keep the source's
  fabric, then broadcast inside the fabric from the source's local index. Exact bits.

The intra steps run through :data:`group_collective_p` with ``engine="strata"``; the inter
steps with ``engine="xla"``, next to a custom call that counts the bytes handed over
(``comm_stats()["inter_fabric_bytes"]``).
"""

from __future__ import annotations

import contextvars
import math
import os
import re
import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import lowering, mpi_engine, program_order, runtime, topology
from strata_jax._src.jax_compat import SPMDAxisContext, core, hlo, ir, mlir

# --------------------------------------------------------------------------------------
# The plan: groups of the collective and how fabrics cut them
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    groups: np.ndarray  # [G, n] partition ids, rank order
    uniform: bool  # every group cut into F slots of L in the same layout
    F: int = 1
    L: int = 1
    f: np.ndarray | None = None  # [n] fabric slot of each group rank
    loc: np.ndarray | None = None  # [n] local index of each group rank
    intra: tuple = ()  # [G*F][L] partition ids
    inter: tuple = ()  # [G*L][F] partition ids
    who: np.ndarray | None = None  # [num partitions, 3]: global device id, process, fabric

    def rank_of(self, slot: int, k: int) -> int:
        return int(np.flatnonzero((self.f == slot) & (self.loc == k))[0])

    def perm_lf(self) -> np.ndarray:
        """Group ranks in (l, f) order (l major)."""
        return np.array([self.rank_of(s, k) for k in range(self.L) for s in range(self.F)])

    def perm_fl(self) -> np.ndarray:
        """Group ranks in (f, l) order (f major)."""
        return np.array([self.rank_of(s, k) for s in range(self.F) for k in range(self.L)])


def _layout(fabrics: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order: dict[int, int] = {}
    f = np.empty(len(fabrics), np.int64)
    loc = np.empty(len(fabrics), np.int64)
    count: dict[int, int] = {}
    for j, fab in enumerate(fabrics.tolist()):
        f[j] = order.setdefault(fab, len(order))
        loc[j] = count.get(fab, 0)
        count[fab] = loc[j] + 1
    return f, loc


def plan(ctx, axes: tuple) -> Plan | None:
    """How the groups of a collective over ``axes`` cross fabrics; None when none does."""
    if topology.num_fabrics() == 1:
        return None
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return None
    mesh = axis_ctx.mesh
    names = tuple(mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    idx = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in idx]
    n = math.prod(sizes[i] for i in idx)
    groups = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + idx).reshape(-1, n)
    fab = np.array([topology.fabric_of_device(d) for d in np.asarray(mesh.devices).flat])
    gf = fab[groups]
    if all(len(set(row.tolist())) == 1 for row in gf):
        return None
    who = np.array(
        [
            (d.id, d.process_index, f)
            for d, f in zip(np.asarray(mesh.devices).flat, fab, strict=True)
        ],
        np.int64,
    )
    layouts = [_layout(row) for row in gf]
    f0, l0 = layouts[0]
    F = int(f0.max()) + 1
    L = n // F
    uniform = (
        n % F == 0
        and all(np.array_equal(f, f0) and np.array_equal(lo, l0) for f, lo in layouts)
        and all(int((f0 == s).sum()) == L for s in range(F))
    )
    if not uniform:
        return Plan(groups, False, who=who)
    intra = tuple(
        tuple(int(groups[g, np.flatnonzero((f0 == s) & (l0 == k))[0]]) for k in range(L))
        for g in range(len(groups))
        for s in range(F)
    )
    inter = tuple(
        tuple(int(groups[g, np.flatnonzero((f0 == s) & (l0 == k))[0]]) for s in range(F))
        for g in range(len(groups))
        for k in range(L)
    )
    return Plan(groups, True, F, L, f0, l0, intra, inter, who)


# --------------------------------------------------------------------------------------
# One collective over explicit groups, by strata or by XLA
# --------------------------------------------------------------------------------------

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


# The check's result while a call is lowered hierarchically, until its first step: a strata
# step is ordered after the check by the program-order chain; an XLA step between fabrics is
# made to read it (strata_order: its operand, handed on, aliased), so XLA cannot start it before
# the check. (A step that consumes the program's own parameter then costs a copy of it.)
_pending_check: contextvars.ContextVar = contextvars.ContextVar(
    "strata_pending_check", default=None
)


ENV_CHECK = "STRATA_CHECK_ACROSS_FABRICS"


def _check_on() -> bool:
    """``STRATA_CHECK_ACROSS_FABRICS=0`` (read when a call is lowered) leaves the descriptor
    check out (one small XLA all_gather less per call; ranks that disagree then get gloo's
    abort or wrong values, as before the check existed)."""
    return os.environ.get(ENV_CHECK, "1") != "0"


def _lower_checked(fn, ctx, args, multiple_results: bool, p: Plan, op: str, extra, aval):
    """Lowers ``fn`` (a hierarchical algorithm) with the call checked across fabrics first."""
    if not _check_on():
        return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)

    def checked(*a):
        token = _pending_check.set(_check_across(p, op, extra, aval, ctx))
        try:
            return fn(*a)
        finally:
            _pending_check.reset(token)

    return mlir.lower_fun(checked, multiple_results=multiple_results)(ctx, *args)


def _gc(
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
):
    """One collective over explicit groups; ``split``/``concat``: all_to_all's (tiled) axes.

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
    pending = _pending_check.get()
    if pending is not None and engine in ("xla", "strata"):
        # The first step of the call: a strata step is chained after the check already; an
        # XLA step (between fabrics) is made to read the check's result.
        _pending_check.set(None)
        if engine == "xla":
            x = _after_p.bind(x, pending)
    return group_collective_p.bind(
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
    )


def _gc_abstract_eval(
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


group_collective_p.def_abstract_eval(_gc_abstract_eval)


def _groups_attr(groups) -> ir.DenseElementsAttr:
    return ir.DenseIntElementsAttr.get(np.ascontiguousarray(np.asarray(groups, np.int64)))


def _channel():
    return hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID, mlir.DEVICE_TO_DEVICE_TYPE)


_REDUCERS = {"sum": jax.lax.add_p, "max": jax.lax.max_p, "min": jax.lax.min_p}


def _add_reducer(ctx, op, dtype, reduce: str) -> None:
    scalar = core.ShapedArray((), dtype)
    t = mlir.aval_to_ir_type(ctx.module_context, scalar)
    block = op.regions[0].blocks.append(t, t)
    with ir.InsertionPoint(block):
        lower = mlir.lower_fun(_REDUCERS[reduce].bind, multiple_results=False)
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
    "reduce_scatter": "strata_reduce_scatter",
    "all_gather": "strata_all_gather",
    "all_gather_reduce": "strata_all_gather_reduce",
    "all_gather_part": "strata_all_gather_part",
    "all_to_all": "strata_all_to_all",
    "permute": "strata_permute",
}
_REDUCE_CODES = {"sum": 0, "max": 1, "min": 2}


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
        target += "_placed"  # strata_all_gather_placed, strata_reduce_scatter_placed
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


def _gc_lowering(
    ctx, x, *z, kind, engine, groups, reduce, pairs, split, concat, z_first, placement, part, x_from
):
    kw = dict(kind=kind, groups=groups, reduce=reduce, pairs=pairs, split=split, concat=concat)
    if engine == "strata":
        out = _strata_lowering(
            ctx, x, *z, z_first=z_first, placement=placement, part=part, x_from=x_from, **kw
        )
    elif engine == "xla_check":  # the descriptors of _check_across: not counted as data
        out = _xla_lowering(ctx, x, **kw)
    else:
        (aval_in,) = ctx.avals_in
        nbytes = int(aval_in.size) * aval_in.dtype.itemsize
        if kind == "permute":  # per rank on average: the share of the members that send
            members = len({int(v) for g in groups for v in g})
            nbytes = nbytes * len({a for a, _ in pairs}) // max(1, members)
        _count_inter(ctx, x, nbytes)
        out = _xla_lowering(ctx, x, **kw)
    return [out]


mlir.register_lowering(group_collective_p, _gc_lowering, platform="cpu", cacheable=False)

# The intra-fabric all_to_all of the two-fabric exchange, with the partner fabric's aggregate
# (index divert[partition] of axis divert_axis) in a second result of its own
# (native/coll/collectives.h: Divert): that result crosses as it is, and what comes back goes in
# place of the index left unwritten in the first, with no copy of either half.
_a2a_divert_p = core.Primitive("strata_all_to_all_divert")
_a2a_divert_p.multiple_results = True


def _a2a_divert_abstract_eval(
    aval, *, groups, split, concat, divert_axis, divert, move_to, divert_dest
):
    """The first result is laid out with divert_axis moved to ``move_to`` and merged with the
    axis after it there (the two-fabric all_to_all's final layout; the same bytes as strata
    writes them); the second has divert_axis of size 1."""
    out = _gc_abstract_eval(
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


_a2a_divert_p.def_abstract_eval(_a2a_divert_abstract_eval)
mlir.register_lowering(_a2a_divert_p, _a2a_divert_lowering, platform="cpu", cacheable=False)

# The intra-fabric reduce-scatter of the two-fabric psum_scatter, with the partner fabric's
# block (sub-block divert[partition] of the output's two) in a second result of its own, left
# unwritten in the first (native/coll/collectives.h: reduce_scatter): it crosses as it is.
_rs_divert_p = core.Primitive("strata_reduce_scatter_placed_divert")
_rs_divert_p.multiple_results = True


def _rs_divert_abstract_eval(aval, *, groups, reduce, placement, divert):
    n = len(groups[0])
    out = aval.update(shape=(aval.shape[0] // n, *aval.shape[1:]))
    return [out, aval.update(shape=(out.shape[0] // 2, *aval.shape[1:]))]


def _rs_divert_lowering(ctx, x, *, groups, reduce, placement, divert):
    return lowering.lower_strata_call(
        ctx,
        "strata_reduce_scatter_placed_divert",
        {"sum": "psum_scatter", "max": "pmax", "min": "pmin"}[reduce],
        [x],
        np.asarray(groups, np.int64),
        reduce=np.int32(_REDUCE_CODES[reduce]),
        placement=np.asarray(placement, np.int64),
        divert=np.asarray(divert, np.int64),
    )


_rs_divert_p.def_abstract_eval(_rs_divert_abstract_eval)
mlir.register_lowering(_rs_divert_p, _rs_divert_lowering, platform="cpu", cacheable=False)

# This partition's id (u32), for the rank-dependent halves of the two-fabric exchanges below.
_partition_id_p = core.Primitive("strata_partition_id")
_partition_id_p.def_abstract_eval(lambda: core.ShapedArray((), np.uint32))
mlir.register_lowering(_partition_id_p, lambda ctx: [hlo.partition_id()], platform="cpu")


# --------------------------------------------------------------------------------------
# Ranks on different fabrics that disagree on a call: an error, not wrong values or a hang
# --------------------------------------------------------------------------------------
# Inside a fabric, strata compares every call's descriptor at the rendezvous. Between fabrics
# the bytes cross through XLA's collective, which compares nothing: ranks that disagree on a
# shape would get wrong values (equal byte counts) or wait out gloo's own timeout. So every
# hierarchical call first gathers a fixed-size descriptor of the call (op, dtype, shape and a
# checksum of the rest: 96 bytes, whatever the call) across fabrics with XLA's all_gather over
# the groups that cross (NCCL and gloo compare descriptors the same way, on arrival), and a
# custom call (native/ffi/hier_handlers.cc) fails on every member alike, naming each member's
# call, before any byte of the call moves. The descriptor is a constant of the program.

_DESC_WORDS = 24
_DESC_MAGIC = 0x53545231  # "STR1"; word layout in native/ffi/hier_handlers.cc


def _pack(text: str, words: int) -> np.ndarray:
    return np.frombuffer(text.encode()[: 4 * words].ljust(4 * words, b"\0"), "<i4")


def _descriptor(op: str, operands, extra) -> np.ndarray:
    """int32 [24]: magic, ndim, 8 dims, dtype name (8 chars), op name (16 chars), crc32 of
    the full shapes and ``extra`` (parameters, other operands' shapes), then a second operand:
    ndim (0: none), 4 dims, dtype name (8 chars). ``operands``: [(dtype name, shape)], the
    first one or two as the user passed them (see :func:`user_scope`)."""
    w = np.zeros(_DESC_WORDS, np.int32)
    (dt, shape), *rest = operands
    w[0], w[1] = _DESC_MAGIC, len(shape)
    for i, d in enumerate(shape[:8]):
        w[2 + i] = min(int(d), 2**31 - 1)
    w[10:12] = _pack(dt, 2)
    w[12:16] = _pack(op, 4)
    w[16] = np.uint32(zlib.crc32(repr((tuple(operands), extra)).encode())).view(np.int32)
    if rest:
        dt2, shape2 = rest[0]
        w[17] = len(shape2)
        for i, d in enumerate(shape2[:4]):
            w[18 + i] = min(int(d), 2**31 - 1)
        w[22:24] = _pack(dt2, 2)
    return w


# The user's call, as the public functions name their ops (jax.named_scope): a hierarchical
# lowering is built from inner collectives (moe.dispatch gathers its expert ids first, for
# example), and an error must name the call the user made, with its shapes, not an inner step.
_SCOPE_RE = re.compile(r"strata\.([A-Za-z_][\w.]*?)(?:\((.*)\))?")
_OPERAND_RE = re.compile(r"(\w+)\[([\d,]*)\]")


def user_scope(api: str, *operands) -> str:
    """The ``jax.named_scope`` name of a call of ``strata_jax.<api>``: ``strata.<api>``, with
    the dtypes and shapes of ``operands`` (at most two shown in errors) when given, e.g.
    ``strata.moe.dispatch(float32[4,8];int32[4,2])``."""
    text = ";".join(
        f"{np.dtype(v.dtype)}[{','.join(str(int(d)) for d in v.shape)}]" for v in operands
    )
    return f"strata.{api}({text})" if operands else f"strata.{api}"


def _user_call(ctx):
    """(api, [(dtype, shape)]) of the outermost ``strata.*`` scope around the op being
    lowered (the call the user made), or None."""
    stack = getattr(getattr(ctx, "name_stack", None), "stack", ())
    for elem in stack:
        m = _SCOPE_RE.fullmatch(getattr(elem, "name", "") or "")
        if m:
            ops = [
                (dt, tuple(int(d) for d in dims.split(",") if d))
                for dt, dims in _OPERAND_RE.findall(m.group(2) or "")
            ]
            return m.group(1), ops
    return None


def _call_of(ctx, op: str, aval, extra) -> tuple[str, np.ndarray]:
    """The name and descriptor of the call being checked: the user's call (its name and its
    operands' shapes) when a public function's scope encloses the op, else ``op`` on ``aval``.
    The crc covers the inner step's shape and ``extra`` too."""
    inner = (str(np.dtype(aval.dtype)), tuple(int(d) for d in aval.shape))
    user = _user_call(ctx)
    if user is None:
        return op, _descriptor(op, [inner], extra)
    api, operands = user
    return api, _descriptor(api, [*operands[:2]] or [inner], (inner, tuple(operands), op, extra))


_check_p = core.Primitive("strata_check_across_fabrics")
_check_p.def_abstract_eval(lambda x, descs, pid, **_: x)


def _check_lowering(ctx, x, descs, pid, *, op, groups, who):
    """The check as a link of the program-order chain of strata calls (program_order.py): it takes
    the previous call's ``Done`` and gives its own, so the next strata call starts after it."""
    runtime.native()  # registers the FFI targets (this may be the program's first strata call)
    g = np.asarray(groups, np.int64)
    rule = jax.ffi.ffi_lowering("strata_check_across_fabrics", has_side_effect=True)
    w = np.asarray(who, np.int64)[g.ravel()]
    ordered = program_order.keep_program_order()
    chain = program_order.chain(ctx) if ordered else {}
    block = ir.InsertionPoint.current.block
    after = chain.get(block)
    extra = [after] if after is not None else []
    done = [program_order.DONE_AVAL] if ordered else []
    sub = ctx.replace(
        avals_in=[*ctx.avals_in, *(a for _, a in extra)], avals_out=[*ctx.avals_out, *done]
    )
    results = list(
        rule(
            sub,
            x,
            descs,
            pid,
            *(v for v, _ in extra),
            op=op,
            groups=g.ravel(),
            group_size=np.int64(g.shape[1]),
            devices=w[:, 0].copy(),
            procs=w[:, 1].copy(),
            fabrics=w[:, 2].copy(),
        )
    )
    if done:
        chain[block] = (results.pop(), program_order.DONE_AVAL)
    return results


mlir.register_lowering(_check_p, _check_lowering, platform="cpu", cacheable=False)

# strata_order(x, after) -> x (native/ffi/hier_handlers.h): x handed on after ``after`` exists,
# with no copy unless x is still read elsewhere or is a parameter of the program.
_after_p = core.Primitive("strata_after")
_after_p.def_abstract_eval(lambda x, after: x)
mlir.register_lowering(
    _after_p,
    jax.ffi.ffi_lowering("strata_order", operand_output_aliases={0: 0}),
    platform="cpu",
    cacheable=False,
)


def _check_across(p: Plan, op: str, extra, aval, ctx):
    """Compares this call (``op`` on ``aval``, with ``extra``; named as the user's call around
    it, see :func:`_call_of`) across the members of each group that crosses fabrics; returns a
    small array that exists only once they agreed. Strata calls after it in the program start
    after it (program-order chain)."""
    groups = p.inter if p.uniform and p.L > 1 else p.groups
    name, d = _call_of(ctx, op, aval, extra)
    desc = jnp.asarray(d[None])
    descs = _gc(desc, "all_gather", "xla_check", groups)  # [F or n, 24]
    return _check_p.bind(
        descs,
        descs,
        _partition_id_p.bind(),
        op=name,
        groups=tuple(map(tuple, groups)),
        who=tuple(map(tuple, p.who.tolist())),
    )


def _slot_table(p: Plan) -> np.ndarray:
    """The fabric slot of every partition in its group ([num partitions] int32)."""
    table = np.zeros(p.groups.size, np.int32)
    for row in p.groups:
        table[row] = p.f
    return table


def _my_slot(p: Plan):
    """This partition's fabric slot in its group (int32 scalar, from the partition id)."""
    return jnp.asarray(_slot_table(p))[_partition_id_p.bind().astype(jnp.int32)]


def _pairs(groups) -> list[tuple[int, int]]:
    """Both directions of every two-member group: the exchange of a two-fabric inter step."""
    return [(int(a), int(b)) for g in groups for a, b in ((g[0], g[1]), (g[1], g[0]))]


# From this many bytes per rank, the two-fabric exchange runs as two one-way rounds (below);
# STRATA_ONE_WAY_BYTES overrides it when a program is lowered (0: always; a huge value: never).
ONE_WAY_BYTES = 256 * 1024


def _one_way_bytes() -> int:
    return runtime.env_bytes("STRATA_ONE_WAY_BYTES", ONE_WAY_BYTES, "262144 or 256K; 0: always")


def _ring_psum() -> bool:
    """``STRATA_RING_PSUM=0`` (read when a program is lowered): the two-fabric psum crosses in
    the two one-way rounds of :func:`_exchange` instead of along :func:`_ring` (the form before
    the ring, kept for A/B measurements)."""
    return os.environ.get("STRATA_RING_PSUM", "1") != "0"


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _ring(p: Plan):
    """The two-fabric ring: member l of fabric slot 0 sends to member l of slot 1, which sends
    to member l + 1 (mod L) of slot 0. Every rank sends once and receives once, all in one
    collective-permute, and every gloo connection carries one direction only: one connection
    carrying both directions of an exchange moves them by turns (see :func:`_exchange`),
    while here each host sends with all its members and receives with all of them at once.
    Needs L >= 2. Returns (pairs over every group, dst, src): ``dst[s][l]``/``src[s][l]`` the
    local index, in the other slot, that member l of slot s sends to / receives from."""
    dst = [[lo for lo in range(p.L)], [(lo + 1) % p.L for lo in range(p.L)]]
    src = [[(lo - 1) % p.L for lo in range(p.L)], [lo for lo in range(p.L)]]
    pairs = [
        (int(g[p.rank_of(s, lo)]), int(g[p.rank_of(1 - s, dst[s][lo])]))
        for g in p.groups
        for s in range(2)
        for lo in range(p.L)
    ]
    return pairs, dst, src


def _per_intra_group(p: Plan, rows) -> tuple[int, ...]:
    """A strata placement table, one row per intra-fabric group (native: the row of the group
    a member runs in): ``rows[s]`` for the groups of fabric slot s (one row: all alike)."""
    return tuple(
        int(b)
        for i in range(len(p.intra))
        for b in np.asarray(rows[i % p.F if len(rows) > 1 else 0]).ravel()
    )


def _exchange(send, p: Plan):
    """The partner's ``send``: the exchange of a two-fabric step over ``p.inter`` (groups of
    two, one member per fabric), by XLA's collective-permute.

    One collective-permute in both directions of every pair moves each pair's two messages
    over one gloo connection, and there they take turns: measured between simulated hosts
    over 1 Gbit/s links (launch --netns), 4 MiB each way took 65 ms where one way took 34 ms,
    the link's time. From ``ONE_WAY_BYTES`` per rank, psum's exchange therefore runs as two
    collective-permutes in which every pair moves one way, odd and even groups in opposite
    directions: in each round a host sends with half its members and receives with the other
    half, so both directions of its link are busy and each connection carries one message at a
    time. Each rank sends its buffer once and receives the partner's once, in one of the two
    rounds; the result is selected by the partition id (no arithmetic on the values).
    Measured at 1 Gbit/s (two A/B runs, load 23-28): psum 72-80 % of the link bound against
    46-57 % with one collective-permute, all_to_all 61-74 % against 48-52 %. (psum's shards,
    psum_scatter's and all_to_all's blocks now cross along :func:`_ring` instead, in one
    round; psum takes this form only with ``STRATA_RING_PSUM=0``.)
    """
    nbytes = int(np.prod(send.shape)) * send.dtype.itemsize
    groups = np.asarray(p.inter)
    # Not over XLA's MPI collectives: the two rounds are independent, and XLA's executor runs
    # one of them on a thread of its pool, where MPI refuses it ("MPI: Communicator requested
    # from a thread that is not the one MPI was initialized from"; every psum from 512 KiB per
    # rank failed so under mpirun between simulated hosts with 1 Gbit/s links). gloo's
    # both-ways turns are gloo's; MPI's one collective-permute reached 78 % of the link there.
    if nbytes < _one_way_bytes() or len(groups) < 2 or mpi_engine.selected():
        return _gc(send, "permute", "xla", p.inter, pairs=_pairs(p.inter))
    first = [(int(g[i % 2]), int(g[1 - i % 2])) for i, g in enumerate(groups)]
    second = [(b, a) for a, b in first]
    got_first = _gc(send, "permute", "xla", p.inter, pairs=first)
    got_second = _gc(send, "permute", "xla", p.inter, pairs=second)
    table = np.zeros(groups.size, np.bool_)
    for _, b in first:
        table[b] = True  # receives in the first round
    in_first = jnp.asarray(table)[_partition_id_p.bind().astype(jnp.int32)]
    return jax.lax.select(jnp.broadcast_to(in_first, send.shape), got_first, got_second)


# --------------------------------------------------------------------------------------
# The hierarchical algorithms (traced with jnp, lowered with mlir.lower_fun)
# --------------------------------------------------------------------------------------

_REDUCE_NAMES = {0: "sum", 1: "max", 2: "min"}


_KEY_TYPES = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _xla_all_reduce(x, groups, reduce: str):
    """XLA's all-reduce over ``groups``, with pmax/pmin of floats made to propagate NaN.

    gloo's max/min drop NaN (max(NaN, 5) = 5 on some ranks, NaN on others). Floats therefore
    cross as integer keys in IEEE-754 total order (the sign-magnitude bits with the magnitude
    flipped for negatives, so that integer order is float order), with every NaN made +NaN for
    max and -NaN for min, the ends of that order: a NaN anywhere wins on every rank. A tie of
    -0.0 and +0.0 gives +0.0 for max and -0.0 for min (IEEE-754 maximum/minimum). Same bytes,
    one collective.
    """
    if reduce == "sum" or not jnp.issubdtype(x.dtype, jnp.floating):
        return _gc(x, "all_reduce", "xla", groups, reduce=reduce)
    key_t = _KEY_TYPES[jnp.dtype(x.dtype).itemsize]
    flip = jnp.array(jnp.iinfo(key_t).max, key_t)  # every bit but the sign
    nan = jnp.array(jnp.nan if reduce == "max" else -jnp.nan, x.dtype)
    b = jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(x), nan, x), key_t)
    k = jnp.where(b < 0, b ^ flip, b)
    k = _gc(k, "all_reduce", "xla", groups, reduce=reduce)
    return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ flip, k), x.dtype)


def _all_reduce(x, p: Plan, reduce: str):
    if p.L == 1 or not p.uniform:
        return _xla_all_reduce(x, p.groups, reduce)
    v = x.reshape(-1)
    m = v.shape[0]
    chunk = -(-m // p.L)
    if chunk * p.L != m:  # padding stays inside: sliced off before returning
        v = jnp.pad(v, (0, chunk * p.L - m))
    v = _gc(v, "reduce_scatter", "strata", p.intra, reduce=reduce)
    if p.F == 2:
        # Two fabrics: one exchange of the shard with the partner (the same bytes as gloo's
        # ring all-reduce, one round instead of two), combined with the own shard inside the
        # intra-fabric all_gather (native all_gather_reduce: one pass, no XLA reduction). Both
        # partners put fabric slot 0's shard first (z_first), so every rank holds the same bits.
        #
        # From ONE_WAY_BYTES per rank the shards cross along the ring (_ring: one
        # collective-permute, every rank sends its shard and receives one at once, every
        # connection one way) instead of the two one-way rounds of _exchange: member l of slot s
        # receives the other fabric's partial sum of shard src[s][l], whose own partial is the
        # x of member src[s][l] of its own fabric (x_from; in slot 1 that is itself, in slot 0
        # the member before it), and the all_gather_reduce pairs them there. No select of two
        # rounds' results (one pass over the shard) and no zero-filled buffer of the round in
        # which a rank receives nothing. The same sums (two operands, slot 0's first).
        if _ring_psum() and _nbytes(v) >= _one_way_bytes():
            pairs, _, src = _ring(p)
            x_from = np.full(p.groups.size, -1, np.int64)
            for g in p.groups:
                for s in range(2):
                    for lo in range(p.L):
                        x_from[g[p.rank_of(s, lo)]] = g[p.rank_of(s, src[s][lo])]
            z = _gc(v, "permute", "xla", p.groups, pairs=pairs)
        else:
            x_from = ()
            z = _exchange(v, p)
        v = _gc(
            v,
            "all_gather_reduce",
            "strata",
            p.intra,
            reduce=reduce,
            z=z,
            z_first=_slot_table(p),
            x_from=x_from,
        )
    else:
        v = _xla_all_reduce(v, p.inter, reduce)
        v = _gc(v, "all_gather", "strata", p.intra)
    return v[:m].reshape(x.shape)


def _all_gather(x, p: Plan):
    if p.L == 1 or not p.uniform:
        return _gc(x, "all_gather", "xla", p.groups)
    if p.F == 2 and 0 < _nbytes(x) >= _one_way_bytes():
        # Two fabrics, from ONE_WAY_BYTES per rank: the own block crosses along the ring
        # (_ring: one collective-permute, every connection one way; member l of slot s receives
        # the block of member src[s][l] of the other slot), and the gather inside runs in two
        # parts into one output: the own fabric's blocks between the check and the crossing,
        # the blocks that crossed after it, written into the same buffer (aliased; no
        # concatenation of own and received blocks, none copied twice). Under launch --netns at
        # 1 Gbit/s (two A/B runs, load 6-7): 83-85/86-90 % of the link bound at 4/16 MiB
        # against 76-79/76-79 % with gloo's all-gather of the pairs (below); the crossing
        # started at once after the check instead of after the own blocks: 84-89/89 %, the same
        # within the noise, but two independent calls on a device are what the program-order
        # chain exists to avoid (docs/design.md), so the crossing reads the first part.
        # (A ring whose two blocks were concatenated for one gather inside gave no clear gain
        # over the pairs: 64-89/74-91 % against 72-74/51-82 % in four A/B runs, load 4-16; with
        # the check right before the crossing it was 62-72 % at 4 MiB in three.)
        pairs, _, src = _ring(p)
        rows = [
            [
                p.rank_of(s, lo) if f == 0 else p.rank_of(1 - s, src[s][lo])
                for lo in range(p.L)
                for f in range(2)
            ]
            for s in range(2)
        ]
        place = _per_intra_group(p, rows)
        own = _gc(x, "all_gather_part", "strata", p.intra, placement=place, part=0)
        # The crossing after the first part (which comes after the check: program-order chain)
        got = _gc(_after_p.bind(x, own), "permute", "xla", p.groups, pairs=pairs)
        return _gc(got, "all_gather_part", "strata", p.intra, z=own, placement=place, part=1)
    v = _gc(x, "all_gather", "xla", p.inter)  # [F*k]: own local index, every fabric
    # Inside the fabric, block (l, f) goes straight to its place in group order, perm_lf()[l*F
    # + f]: no reorder pass over the whole output afterwards.
    return _gc(v, "all_gather", "strata", p.intra, placement=_per_intra_group(p, [p.perm_lf()]))


def _reduce_scatter(x, p: Plan, reduce: str):
    if p.L == 1 or not p.uniform:
        return _gc(x, "reduce_scatter", "xla", p.groups, reduce=reduce)
    n = p.F * p.L
    k = x.shape[0] // n
    # Inside the fabric, member l sums the blocks (l, f), f < F, i.e. group blocks perm_lf()[l*F
    # + f], read where they are: no reorder pass over the whole input first.
    if k == 0:  # nothing to reduce (XLA rejects empty collectives at verification)
        return jnp.zeros((0, *x.shape[1:]), x.dtype)
    if p.F == 2:
        # Two fabrics: send the partner's block, reduce the one received into the own (the
        # same bytes as gloo's reduce-scatter, measured 1.5x faster at 16 MiB, 7x at 64 KiB).
        # Strata writes the partner's block to a result of its own (no slice copied out).
        # From ONE_WAY_BYTES per rank the block crosses along the ring (_ring): each member
        # sends the block of the member it sends to, and receives its own from another, so the
        # intra-fabric step's rows differ per fabric. Under launch --netns (two A/B runs against
        # the pairs' exchange, load 9-16): 83-88/87-89 % of the link bound at 4/16 MiB and
        # 1 Gbit/s against 60-81/52-84 %, 27-32/34-44 % at 10 Gbit/s against 28-29/32-33 %.
        ring = _nbytes(x) // n >= _one_way_bytes()
        if ring:
            pairs, dst, _ = _ring(p)
            rows = [
                [
                    p.rank_of(s, lo) if f == s else p.rank_of(1 - s, dst[s][lo])
                    for lo in range(p.L)
                    for f in range(2)
                ]
                for s in range(2)
            ]
        else:
            rows = [p.perm_lf()]
        _pending_check.set(None)  # a strata step: chained after the check
        v, send = _rs_divert_p.bind(
            x,
            groups=tuple(map(tuple, p.intra)),
            reduce=reduce,
            placement=_per_intra_group(p, rows),
            divert=tuple(int(o) for o in 1 - _slot_table(p)),
        )
        if ring:
            got = _gc(send, "permute", "xla", p.groups, pairs=pairs)
        else:
            got = _gc(send, "permute", "xla", p.inter, pairs=_pairs(p.inter))
        w = v.reshape(2, k, *x.shape[1:])
        return _REDUCERS[reduce].bind(
            jax.lax.dynamic_index_in_dim(w, _my_slot(p), keepdims=False), got
        )
    v = _gc(
        x,
        "reduce_scatter",
        "strata",
        p.intra,
        reduce=reduce,
        placement=_per_intra_group(p, [p.perm_lf()]),
    )
    return _gc(v, "reduce_scatter", "xla", p.inter, reduce=reduce)


def _all_to_all(x, p: Plan, split_axis: int, concat_axis: int):
    """Tiled all_to_all, with no data movement besides the two exchanges.

    x's split axis is viewed as [F (dest fabric slot), L*b] (a free reshape). Inside the
    fabric, strata splits the L*b part by destination local index and concatenates what it
    receives along the concat axis (source local index major): each member then holds, for
    every destination fabric, one contiguous-by-slot aggregate of everything its fabric sends
    to its own local index there. Across fabrics, XLA's all_to_all splits the F axis and
    concatenates along the same concat axis (source fabric major), so the concat axis ends up
    in (f, l) order: group order whenever the group lists each fabric's members together (else
    one static reorder of the n source blocks). No transposes: the strata copy is strided.
    """
    n = len(p.groups[0])
    if p.L == 1 or not p.uniform:
        return _gc(x, "all_to_all", "xla", p.groups, split=split_axis, concat=concat_axis)
    s, c = split_axis, concat_axis
    fl = p.perm_fl()  # group ranks in (f, l) order
    in_order = np.array_equal(fl, np.arange(n))
    shape = x.shape
    b = shape[s] // n
    if not in_order:  # destination blocks into (f, l) order (one static gather)
        x = _take_blocks(x, s, n, fl)
    v = x.reshape(*shape[:s], p.F, p.L * b, *shape[s + 1 :])
    c1 = c if c < s else c + 1  # the concat axis in v (c == s: the L*b part)
    if p.F == 2:
        # Two fabrics: only the partner fabric's aggregate moves (one collective-permute of
        # half the buffer; XLA's all_to_all copies both halves out and back in). Strata writes
        # it to a second result, so it crosses with no slice copied out of v, and what comes
        # back is written in place of the half strata left unwritten (v has no other reader).
        others = 1 - _slot_table(p)  # the partner fabric's slot, per partition
        k = c1 - 1 if c1 > s else c1  # where F goes: just before the concat part
        # From ONE_WAY_BYTES per rank (the half that crosses) the aggregates cross along the
        # ring (_ring, one collective-permute, every connection one way): each member gathers
        # the aggregate of the member it sends to (dest: its local index, per partition).
        # Under launch --netns against the two one-way rounds (two A/B runs, load 11-16), %
        # of the link bound at 4/16 MiB: 1 Gbit/s 82-92/89-91 against 90/58-84, 10 Gbit/s
        # 35-42/45-47 against 27-34/29-49.
        ring = _nbytes(x) // 2 >= _one_way_bytes()
        dest = np.zeros(p.groups.size, np.int64)
        pairs, dst, _ = _ring(p)
        for g in p.groups:
            for j in range(n):
                dest[g[j]] = dst[p.f[j]][p.loc[j]] if ring else p.loc[j]
        _pending_check.set(None)  # a strata step: chained after the check
        v, send = _a2a_divert_p.bind(
            v,
            groups=tuple(map(tuple, p.intra)),
            split=s + 1,
            concat=c1,
            divert_axis=s,
            divert=tuple(int(o) for o in others),
            move_to=k,
            divert_dest=tuple(int(d) for d in dest),
        )
        # v comes in the final layout: F moved to k and merged with the concat part (strata
        # writes it so; no transpose). The block that comes back has F of size 1, so its bytes
        # are already in that order, and the update is the last op on v (a reshape or a
        # transpose fused with it made XLA copy the whole of v first).
        if ring:
            got = _gc(send, "permute", "xla", p.groups, pairs=pairs)
        else:
            got = _exchange(send, p)
        width = send.shape[c1]
        got = got.reshape(*v.shape[:k], width, *v.shape[k + 1 :])
        v = jax.lax.dynamic_update_slice_in_dim(v, got, (1 - _my_slot(p)) * width, axis=k)
    else:
        v = _gc(v, "all_to_all", "strata", p.intra, split=s + 1, concat=c1)
        v = _gc(v, "all_to_all", "xla", p.inter, split=s, concat=c1)  # axis s: F -> 1
        v = v.reshape(*v.shape[:s], *v.shape[s + 1 :])  # c1 - 1 == c when c >= s
    if not in_order:  # source blocks from (f, l) order back into group order
        v = _take_blocks(v, c, n, np.argsort(fl))
    return v


def _take_blocks(v, axis: int, n: int, order: np.ndarray):
    """v with its ``axis`` cut into n equal blocks, block i of the result = block order[i]."""
    w = v.reshape(*v.shape[:axis], n, v.shape[axis] // n, *v.shape[axis + 1 :])
    return jnp.take(w, order, axis=axis).reshape(v.shape)


def _bits_or(a, b):
    if a.dtype == np.bool_:
        return a | b
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a | b
    u = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, u) | jax.lax.bitcast_convert_type(b, u), a.dtype
    )


def _permute(x, p: Plan, sources: np.ndarray):
    pairs = [(int(s), d) for d, s in enumerate(sources.tolist()) if s >= 0]
    full = [(int(g[s]), int(g[d])) for g in p.groups for s, d in pairs]
    if p.L == 1 or not p.uniform or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _gc(x, "permute", "xla", p.groups, pairs=full)
    fab = np.array([p.f[s] == p.f[d] for s, d in pairs], bool)
    inside = [pr for pr, same in zip(pairs, fab, strict=True) if same]
    across = [pr for pr, same in zip(pairs, fab, strict=True) if not same]
    out = None
    if across:
        cross = [(int(g[s]), int(g[d])) for g in p.groups for s, d in across]
        out = _gc(x, "permute", "xla", p.groups, pairs=cross)
    if inside:
        # Partition pairs of the intra steps; strata runs them when every fabric slot has the
        # same local pattern (one permutation for all intra groups).
        local = {(int(p.f[s]), int(p.loc[s]), int(p.loc[d])) for s, d in inside}
        per_slot = [{(a, b) for f, a, b in local if f == s} for s in range(p.F)]
        intra_pairs = [(int(g[s]), int(g[d])) for g in p.groups for s, d in inside]
        if all(ps == per_slot[0] for ps in per_slot):
            lp = sorted(per_slot[0])
            ip = [(grp[a], grp[b]) for grp in p.intra for a, b in lp]
            y = _gc(x, "permute", "strata", p.intra, pairs=ip)
        else:
            y = _gc(x, "permute", "xla", p.groups, pairs=intra_pairs)
        out = y if out is None else _bits_or(out, y)
    if out is None:
        out = jnp.zeros_like(x)
    return out


def _broadcast(x, p: Plan, root: int):
    if p.L == 1 or not p.uniform:
        v = _gc(x.reshape(1, *x.shape), "all_gather", "xla", p.groups)
        return v[root]
    fs, ls = int(p.f[root]), int(p.loc[root])
    v = _gc(x.reshape(1, *x.shape), "all_gather", "xla", p.inter)[fs]  # x of (fs, my l)
    v = _gc(v.reshape(1, *x.shape), "all_gather", "strata", p.intra)
    return v[ls]


# --------------------------------------------------------------------------------------
# MoE dispatch/combine across fabrics
# --------------------------------------------------------------------------------------


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# dispatch inside one fabric of rows gathered across fabrics: x [F*T, H] (the tokens of the
# group ranks with this local index, fabric slot major), weights [F*T, K] or [0, K], slots [N, K]
# in that order, counts [E_local] -> recv [E_local, C, H]; the native dispatch over ``groups``.
_intra_dispatch_p = core.Primitive("strata_moe_dispatch_in_fabric")
_intra_dispatch_p.def_abstract_eval(
    lambda x, w, slots, counts, *, groups, capacity, weighted: x.update(
        shape=(counts.shape[0], capacity, x.shape[1])
    )
)
mlir.register_lowering(
    _intra_dispatch_p,
    lambda ctx, x, w, slots, counts, *, groups, capacity, weighted: lowering.lower_strata_call(
        ctx,
        "strata_moe_dispatch",
        "moe.dispatch",
        [x, w, slots, counts],
        np.asarray(groups, np.int64),
        weighted=np.int64(weighted),
    ),
    platform="cpu",
    cacheable=False,
)


def _moe_dispatch(x, w, slots, counts, p: Plan, out_shape, weighted: bool):
    """recv [E_local, C, H] on this rank from every rank's x, by this rank's slot plan.

    Uniform layouts (F fabrics of L members): each rank's token rows cross to each other fabric
    once, to the member with the same local index (XLA's all_gather over the inter groups), so
    every member holds the rows of its local index in every fabric; then strata's dispatch
    inside the fabric pulls into each expert slot the one row it needs from the member holding
    it (the slot plan re-indexed to that layout). Otherwise every row reaches every rank
    through the hierarchical all_gather and is scattered into its slots locally (a repeated
    expert shares one slot).
    """
    el, c, h = out_shape
    n, k = slots.shape
    if p.L > 1 and p.uniform:
        t = x.shape[0]
        xf = _gc(x, "all_gather", "xla", p.inter)  # [F*T, H], fabric slot order
        wf = _gc(w, "all_gather", "xla", p.inter) if weighted else w
        held = np.array(  # global token held at row j of fabric member l, (l, j) order
            [p.rank_of(f, lo) * t + i for lo in range(p.L) for f in range(p.F) for i in range(t)],
            np.int32,
        )
        return _intra_dispatch_p.bind(
            xf,
            wf,
            slots[held] if n else slots,
            counts,
            groups=tuple(map(tuple, p.intra)),
            capacity=c,
            weighted=weighted,
        )
    xa = _all_gather(x, p)  # [N, H], global token order
    flat = slots.reshape(-1)
    tgt = jnp.where(flat >= 0, flat, el * c)
    rows = jnp.repeat(xa, k, axis=0)  # [(g, k), H]
    if weighted:
        wa = _all_gather(w, p)  # [N, K]
        same = (slots[:, :, None] == slots[:, None, :]) & (slots[:, None, :] >= 0)
        wsum = (wa[:, None, :] * same).sum(-1)  # weights of the choices naming the slot
        rows = (rows.astype(wa.dtype) * wsum.reshape(-1)[:, None]).astype(x.dtype)
    recv = jnp.zeros((el * c, h), x.dtype).at[tgt].set(rows, mode="drop")
    return recv.reshape(el, c, h)


def _moe_partials(ey, w, slots, p: Plan):
    """[N, H] (accumulator dtype): each global token's weighted rows of this rank's experts."""
    el, c, h = ey.shape
    n, k = slots.shape
    wa = _all_gather(w, p).astype(_acc(ey.dtype))  # [N, K]
    if el * c == 0:  # capacity 0: every pair dropped (and a gather from 0 rows is rejected)
        return jnp.zeros((n, h), wa.dtype)
    flat = slots.reshape(-1)
    valid = flat >= 0
    rows = ey.reshape(el * c, h)[jnp.where(valid, flat, 0)].astype(wa.dtype)
    rows = jnp.where(valid[:, None], rows * wa.reshape(-1)[:, None], 0)
    return rows.reshape(n, k, h).sum(1)


def lower_moe_across_fabrics(ctx, target: str, args, axes: tuple, attrs: dict):
    """The hook of the MoE primitives' lowering: when the expert axis spans fabrics, dispatch,
    combine and the weight-gradient gather are lowered as hierarchical collectives (the same
    semantics, layout, drop rule and gradients; the plan is computed in JAX as before):

    - dispatch: each token row crosses to each other fabric once (to the member with the same
      local index), then strata's dispatch inside the fabric pulls every slot's row from the
      member that holds it;
    - combine: each rank forms one partial row per global token from its experts (weighted,
      in the accumulator dtype), then a hierarchical psum_scatter: partial sums inside each
      fabric (strata) before the 1/L shard crosses back;
    - gather (d weights): the same psum_scatter on the per-choice scalars.

    Returns None when the axis lies inside one fabric.
    """
    p = plan(ctx, axes)
    if p is None:
        return None
    op = _API_NAMES.get(target, target)
    extra = (
        tuple((a.shape, str(a.dtype)) for a in ctx.avals_in[1:]),
        tuple(sorted((k, np.asarray(v).tolist()) for k, v in attrs.items())),
    )

    if all(a.size == 0 for a in ctx.avals_out) or (
        target == "strata_moe_dispatch" and ctx.avals_in[0].size == 0
    ):
        avals = ctx.avals_out

        def nothing(first, *rest):  # no tokens anywhere: every slot stays zero
            if _check_on():  # kept although unused: the check has a side effect
                _check_across(p, op, extra, ctx.avals_in[0], ctx)
            return [jnp.zeros(a.shape, a.dtype) for a in avals]

        return mlir.lower_fun(nothing, multiple_results=True)(ctx, *args)

    if target == "strata_moe_dispatch":
        shape = ctx.avals_out[0].shape
        weighted = bool(int(attrs["weighted"]))

        def fn(x, w, slots, counts):
            return _moe_dispatch(x, w, slots, counts, p, shape, weighted)

        return _lower_checked(fn, ctx, args, False, p, op, extra, ctx.avals_in[0])
    if target == "strata_moe_combine":
        part_aval = ctx.avals_out[1]

        def fn(ey, w, slots, rows):
            y = _reduce_scatter(_moe_partials(ey, w, slots, p), p, "sum").astype(ey.dtype)
            return [y, jnp.zeros(part_aval.shape, part_aval.dtype)]

        return _lower_checked(fn, ctx, args, True, p, op, extra, ctx.avals_in[0])
    if target == "strata_moe_gather":

        def fn(values, slots, idx):
            flat = values.reshape(-1)
            if flat.size == 0:  # capacity 0: every slot is -1 (a gather from 0 rows is rejected)
                v = jnp.zeros(slots.shape, values.dtype)
            else:
                v = jnp.where(slots >= 0, flat[jnp.where(slots >= 0, slots, 0)], 0)
            return _reduce_scatter(v.astype(values.dtype), p, "sum")

        return _lower_checked(fn, ctx, args, False, p, op, extra, ctx.avals_in[0])
    api = target.removeprefix("strata_").replace("moe_ll_", "moe.low_latency_")
    raise NotImplementedError(
        f"strata_jax: {api} over a group that spans fabric domains (hosts) is not supported "
        "yet. Keep the expert axis inside one host (e.g. a ('host', 'expert') mesh with the "
        "experts on the inner axis), or use the normal-mode dispatch/combine across hosts."
    )


def lower_across_fabrics(ctx, x, target: str, axes: tuple, attrs: dict):
    """The hook of ``collectives._ffi_call_lowering``: lowers ``target`` hierarchically when
    its groups span fabrics; returns None when every group lies inside one fabric."""
    p = plan(ctx, axes)
    if p is None:
        return None
    op = _API_NAMES.get(target, target)
    if target == "strata_all_reduce":
        op = {0: "psum", 1: "pmax", 2: "pmin"}[int(attrs["reduce"])]
    extra = tuple(sorted((k, np.asarray(v).tolist()) for k, v in attrs.items()))
    if ctx.avals_in[0].size == 0:
        (out_aval,) = ctx.avals_out

        def nothing(v):
            if _check_on():  # kept although unused: the check has a side effect
                _check_across(p, op, extra, ctx.avals_in[0], ctx)
            return jnp.zeros(out_aval.shape, out_aval.dtype)

        return mlir.lower_fun(nothing, multiple_results=False)(ctx, x)
    if target == "strata_all_reduce":
        fn = lambda v: _all_reduce(v, p, _REDUCE_NAMES[int(attrs["reduce"])])  # noqa: E731
    elif target == "strata_reduce_scatter":
        fn = lambda v: _reduce_scatter(v, p, _REDUCE_NAMES[int(attrs["reduce"])])  # noqa: E731
    elif target == "strata_all_gather":
        fn = lambda v: _all_gather(v, p)  # noqa: E731
    elif target == "strata_all_to_all":
        s, c = int(attrs["split_axis"]), int(attrs["concat_axis"])
        fn = lambda v: _all_to_all(v, p, s, c)  # noqa: E731
    elif target == "strata_permute":
        src = np.asarray(attrs["sources"])
        fn = lambda v: _permute(v, p, src)  # noqa: E731
    elif target == "strata_broadcast":
        r = int(attrs["root"])
        fn = lambda v: _broadcast(v, p, r)  # noqa: E731
    else:
        raise NotImplementedError(
            f"strata_jax: {target} over a group that spans fabric domains is not supported yet "
            f"(groups {p.groups.tolist()} cross fabrics); keep its axis inside one host."
        )
    return _lower_checked(fn, ctx, [x], False, p, op, extra, ctx.avals_in[0])


_API_NAMES = {
    "strata_reduce_scatter": "psum_scatter",
    "strata_all_gather": "all_gather",
    "strata_all_to_all": "all_to_all",
    "strata_permute": "ppermute",
    "strata_broadcast": "pbroadcast",
    "strata_moe_dispatch": "moe.dispatch",
    "strata_moe_combine": "moe.combine",
    "strata_moe_gather": "moe.combine",  # the weights' gradient of combine
}
