"""Ranks on different fabrics that disagree on a call: an error naming every member's call
before any byte of it moves, not wrong values or a hang.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import program_order, runtime
from strata_jax._src.hierarchy.plan import Plan
from strata_jax._src.hierarchy.steps import (
    REDUCERS,
    after_p,
    inter_bytes,
    partition_id_p,
    pending_check,
    step,
)
from strata_jax._src.jax_compat import core, ir, mlir

# Inside a fabric, strata compares every call's descriptor at the rendezvous. Between fabrics
# the bytes cross through XLA's collective, which compares nothing: ranks that disagree on a
# shape would get wrong values (equal byte counts) or wait out gloo's own timeout. So every
# hierarchical call first gathers a fixed-size descriptor of the call (op, dtype, shape and a
# checksum of the rest: 96 bytes, whatever the call) across fabrics with XLA's all_gather over
# the groups that cross (NCCL and gloo compare descriptors the same way, on arrival), and a
# custom call (native/ffi/hier_handlers.cc) fails on every member alike, naming each member's
# call, before any byte of the call moves. The descriptor is a constant of the program.

ENV_CHECK = "STRATA_CHECK_ACROSS_FABRICS"


def check_on() -> bool:
    """``STRATA_CHECK_ACROSS_FABRICS=0`` (read when a call is lowered) leaves the descriptor
    check out (one small XLA all_gather less per call; ranks that disagree then get gloo's
    abort or wrong values, as before the check existed)."""
    return runtime.env_bool(ENV_CHECK, True, "1, the default: check; 0: leave the check out")


def lower_checked(
    fn, ctx, args, multiple_results: bool, p: Plan, op: str, extra, aval, defer: bool = True
):
    """Lowers ``fn`` (a hierarchical algorithm) with the call checked across fabrics first;
    ``defer=False``: ``fn``'s first step between fabrics cannot ride in the check's message
    (see :class:`PendingCheck`), which is then emitted at once."""
    if not check_on():
        return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)

    def checked(*a):
        pending = PendingCheck(p, op, extra, aval, ctx, defer)
        token = pending_check.set(pending)
        try:
            out = fn(*a)
            pending.result()  # a call whose steps never bound it: checked all the same
            # One element of each result, which the next call's check message waits for
            # (after_previous_p): it goes between fabrics after this call's last exchange.
            ends = [v.reshape(-1)[:1] for v in jax.tree.leaves(out) if v.size]
            if ends:
                call_end_p.bind(*ends)
            return out
        finally:
            pending_check.reset(token)

    return mlir.lower_fun(checked, multiple_results=multiple_results)(ctx, *args)


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


# Two hosts' exchanges between fabrics pair in the order each runs them (gloo and MPI match
# calls by order), so a call's check message goes between fabrics after the previous
# hierarchical call of its block has finished (after_previous_p: x handed on, by strata_order,
# after one element of each of that call's results, recorded by call_end_p), and the call's own
# exchanges after its check (steps.gate, PendingCheck.carry). Every call's exchanges then run
# after the previous call's, its check first: two hosts whose programs differ meet with two
# check messages (of one size) at the first call where they differ, and fail there with the
# named error. Unordered, a call's check could run ahead of the previous call's exchanges: a
# small call held back to carry its data, then a large one, in the other order on the other
# host, and the large call's checks met and agreed while the small call's message met the large
# call's data (gloo's abort on one host, a wait on the other; a reviewer's case). The first
# call of a block waits for nothing, so its check can start at once.
_CALL_ENDS = ("strata_jax", "hierarchical_call_ends")


def _ends_of_block(ctx) -> dict:
    """The recorded ends of the last hierarchical call, per block of the module being lowered
    (the module's primitive-lowering cache holds them, as program_order's op counter)."""
    return ctx.module_context.cached_primitive_lowerings.setdefault(_CALL_ENDS, {})


call_end_p = core.Primitive("strata_hierarchical_call_end")
call_end_p.multiple_results = True
call_end_p.def_abstract_eval(lambda *ends: [])


def _call_end_lowering(ctx, *ends):
    block = ir.InsertionPoint.current.block
    _ends_of_block(ctx)[block] = list(zip(ends, ctx.avals_in, strict=True))
    return []


mlir.register_lowering(call_end_p, _call_end_lowering, platform="cpu", cacheable=False)

after_previous_p = core.Primitive("strata_after_previous_call")
after_previous_p.def_abstract_eval(lambda x: x)
_order_rule = jax.ffi.ffi_lowering("strata_order", operand_output_aliases={0: 0})


def _after_previous_lowering(ctx, x):
    runtime.native()  # registers the FFI targets (this may be the program's first strata call)
    (aval,) = ctx.avals_in
    for end, end_aval in _ends_of_block(ctx).get(ir.InsertionPoint.current.block, ()):
        sub = ctx.replace(primitive=None, avals_in=[aval, end_aval], avals_out=[aval])
        (x,) = _order_rule(sub, x, end)
    return [x]


mlir.register_lowering(after_previous_p, _after_previous_lowering, platform="cpu", cacheable=False)

_check_p = core.Primitive("strata_check_across_fabrics")
_check_p.def_abstract_eval(lambda x, descs, pid, **_: x)


def _check_lowering(ctx, x, descs, pid, *, op, groups, who):
    """The check as a link of the program-order chain of strata calls (program_order.py): it takes
    the previous call's ``Done`` and gives its own, so the next strata call starts after it."""
    runtime.native()  # registers the FFI targets (this may be the program's first strata call)
    g = np.asarray(groups, np.int64)
    rule = jax.ffi.ffi_lowering("strata_check_across_fabrics", has_side_effect=True)
    w = np.asarray(who, np.int64)[g.ravel()]
    return program_order.chained(
        ctx,
        rule,
        [x, descs, pid],
        ctx.avals_in,
        op=op,
        groups=g.ravel(),
        group_size=np.int64(g.shape[1]),
        devices=w[:, 0].copy(),
        procs=w[:, 1].copy(),
        fabrics=w[:, 2].copy(),
    )


mlir.register_lowering(_check_p, _check_lowering, platform="cpu", cacheable=False)


# The check's message: the descriptor, then CARRY_BYTES more, the same size for every call, so
# that ranks that disagree on a call still exchange equal byte counts (gloo aborts the process
# on a size mismatch: "Received data size doesn't match expected size"). When the call's first
# step between fabrics moves at most that many bytes per rank over the check's own groups, its
# data crosses in that space (PendingCheck.carry): one exchange between fabrics where there
# were two. Each exchange between simulated hosts costs 0.4-1.6 ms on this machine (a 96-byte
# all_gather over gloo, 4 processes on 2 cores), so a call that needed two took twice as long.
CARRY_BYTES = 64 * 1024
ENV_CARRY = "STRATA_CHECK_CARRY_BYTES"


def carry_bytes() -> int:
    """The data bytes every check's message has room for (``STRATA_CHECK_CARRY_BYTES``, read when
    a call is lowered; the same on every process, or the messages differ in size)."""
    return runtime.env_bytes(ENV_CARRY, CARRY_BYTES, "65536 or 64K; 0: the descriptor alone")


_DESC_BYTES = 4 * _DESC_WORDS


def _nbytes(x) -> int:
    """Bytes of an array or aval."""
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _bytes_of(x):
    """``x`` (a real or bool dtype) as uint8 [x.nbytes]."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.dtype(x.dtype).itemsize > 1:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return x.astype(jnp.uint8).reshape(-1)


def _from_bytes(b, dtype, shape):
    """The inverse of :func:`_bytes_of`: uint8 [..., nbytes] to ``dtype`` [..., *shape]."""
    lead = b.shape[:-1]
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_:
        return b.reshape(*lead, *shape) != 0
    if dt.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dt).reshape(*lead, *shape)
    return jax.lax.bitcast_convert_type(b.reshape(*lead, *shape, dt.itemsize), dt)


class PendingCheck:
    """The check of one call (``op`` on ``aval``, with ``extra``; named as the user's call
    around it, see :func:`_call_of`) across the members of each group that crosses fabrics.

    Each member sends the others a message of a fixed size: the call's descriptor and
    :func:`carry_bytes` more. A call of at most ``carry_bytes() * group size`` bytes per rank is
    *deferred*: its message waits for the call's first step between fabrics, and when that step
    moves at most ``carry_bytes()`` per rank among the check's own groups, the step's data
    rides in the message (:meth:`carry`) and the step needs no exchange of its own. Otherwise
    the message (with nothing in its data part) is emitted at once (it depends on nothing:
    XLA may run it before or beside the call's first strata step); the custom call that
    compares the descriptors is emitted by :meth:`result`, once, at the call's first step,
    after it when that step is strata's (steps.step, steps.gate), so that no strata step waits
    for it: strata calls after it in the program start after it (program-order chain)."""

    def __init__(self, p: Plan, op: str, extra, aval, ctx, defer: bool = True):
        self._groups = tuple(map(tuple, p.inter if p.uniform and p.L > 1 else p.groups))
        self._name, self._desc = _call_of(ctx, op, aval, extra)
        self._who = tuple(map(tuple, p.who.tolist()))
        self._carry = carry_bytes()
        self.deferred = defer and 0 < _nbytes(aval) <= self._carry * p.groups.shape[1]
        self._descs = None if self.deferred else self._exchange(None)
        self._result = None

    def _exchange(self, data, counted: int = -1):
        """The all_gather of every member's message: uint8 [group size, descriptor + carry]."""
        msg = jnp.concatenate(
            [
                jnp.asarray(self._desc.astype("<i4").view(np.uint8)),
                jnp.zeros((self._carry,), jnp.uint8)
                if data is None
                else jnp.pad(data, (0, self._carry - data.shape[0])),
            ]
        )
        msg = after_previous_p.bind(msg[None])  # after the previous call's exchanges
        return step(msg, "all_gather", "xla_check", self._groups, counted=counted)

    def _compare(self, msgs, x):
        """``x`` handed on by the custom call that compares the descriptors in ``msgs``."""
        n = msgs.shape[0]
        descs = jax.lax.bitcast_convert_type(
            msgs[:, :_DESC_BYTES].reshape(n, _DESC_WORDS, 4), jnp.int32
        )
        return _check_p.bind(
            x,
            descs,
            partition_id_p.bind(),
            op=self._name,
            groups=self._groups,
            who=self._who,
        )

    def result(self):
        """A small array that exists only once every member agreed (emitted on first use)."""
        if self._result is None:
            if self._descs is None:
                self._descs = self._exchange(None)
            self._result = self._compare(self._descs, self._descs[:, :_DESC_BYTES])
        return self._result

    def may_carry(self, x) -> bool:
        """Whether a step between fabrics of ``x`` may cross inside the message."""
        return (
            self.deferred
            and self._result is None
            and _nbytes(x) <= self._carry
            and not jnp.issubdtype(x.dtype, jnp.complexfloating)
        )

    def carry(self, x, kind: str, groups, *, reduce: str, pairs, split: int, concat: int):
        """The result of the step ``kind`` over ``groups`` of ``x`` computed from the messages
        (every member's ``x`` in its data part), or None when this step cannot ride in them:
        not deferred, already checked, too large, complex, or groups other than the check's
        (a permute: a pair outside one of them)."""
        if not self.may_carry(x):
            return None
        g = self._groups
        n = len(g[0])
        where = {int(m): (i, j) for i, row in enumerate(g) for j, m in enumerate(row)}
        src = {}
        if kind == "permute":
            for a, b in pairs:
                if a not in where or b not in where or where[a][0] != where[b][0]:
                    return None
                src[int(b)] = where[int(a)][1]
        elif (
            kind not in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
            or tuple(map(tuple, groups)) != g
        ):
            return None
        nbytes = _nbytes(x)
        counted = inter_bytes(kind, nbytes, groups, pairs)
        self._descs = msgs = self._exchange(_bytes_of(x), counted)
        self._result = self._compare(msgs, msgs[:, :_DESC_BYTES])
        msgs = after_p.bind(msgs, self._result)  # read only once the members agreed
        rows = _from_bytes(msgs[:, _DESC_BYTES : _DESC_BYTES + nbytes], x.dtype, x.shape)
        pid = partition_id_p.bind().astype(jnp.int32)
        table = np.zeros(len(where), np.int32) if not where else np.zeros(max(where) + 1, np.int32)
        for m, (_, j) in where.items():
            table[m] = j
        pos = jnp.asarray(table)[pid]  # this member's index in its group
        if kind == "all_gather":
            return rows.reshape(n * x.shape[0], *x.shape[1:])
        if kind == "permute":
            source = np.full(table.shape, -1, np.int32)
            for b, j in src.items():
                source[b] = j
            s = jnp.asarray(source)[pid]
            got = jax.lax.dynamic_index_in_dim(rows, jnp.maximum(s, 0), keepdims=False)
            return jnp.where(s >= 0, got, jnp.zeros_like(got))
        if kind == "all_to_all":
            sh = list(x.shape)
            b = sh[split] // n
            r = rows.reshape(n, *sh[:split], n, b, *sh[split + 1 :])
            blk = jax.lax.dynamic_index_in_dim(r, pos, axis=1 + split, keepdims=False)
            return jnp.concatenate([blk[i] for i in range(n)], axis=concat)
        total = rows[0]  # all_reduce, reduce_scatter: folded in group order, alike everywhere
        for i in range(1, n):
            total = REDUCERS[reduce].bind(total, rows[i])
        if kind == "all_reduce":
            return total
        k = x.shape[0] // n
        return jax.lax.dynamic_slice_in_dim(total, pos * k, k, axis=0)


def check_across(p: Plan, op: str, extra, aval, ctx):
    """The check of a call (see :class:`PendingCheck`) emitted at once: a small array that
    exists only once every member agreed."""
    return PendingCheck(p, op, extra, aval, ctx).result()
