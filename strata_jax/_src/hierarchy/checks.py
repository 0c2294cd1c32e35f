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
from strata_jax._src.hierarchy.steps import partition_id_p, pending_check, step
from strata_jax._src.jax_compat import core, mlir

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


def lower_checked(fn, ctx, args, multiple_results: bool, p: Plan, op: str, extra, aval):
    """Lowers ``fn`` (a hierarchical algorithm) with the call checked across fabrics first."""
    if not check_on():
        return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)

    def checked(*a):
        pending = PendingCheck(p, op, extra, aval, ctx)
        token = pending_check.set(pending)
        try:
            out = fn(*a)
            pending.result()  # a call whose steps never bound it: checked all the same
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


class PendingCheck:
    """The check of one call (``op`` on ``aval``, with ``extra``; named as the user's call
    around it, see :func:`_call_of`) across the members of each group that crosses fabrics.
    The descriptors' all_gather is emitted at once (it depends on nothing: XLA may run it
    before or beside the call's first strata step); the custom call that compares them is
    emitted by :meth:`result`, once, at the call's first step, after it when that step is
    strata's (steps.step, steps.gate), so that no strata step waits for it: strata calls after
    it in the program start after it (program-order chain)."""

    def __init__(self, p: Plan, op: str, extra, aval, ctx):
        self._groups = p.inter if p.uniform and p.L > 1 else p.groups
        self._name, d = _call_of(ctx, op, aval, extra)
        self._descs = step(jnp.asarray(d[None]), "all_gather", "xla_check", self._groups)
        self._who = tuple(map(tuple, p.who.tolist()))
        self._result = None

    def result(self):
        """A small array that exists only once every member agreed (emitted on first use)."""
        if self._result is None:
            self._result = _check_p.bind(
                self._descs,
                self._descs,
                partition_id_p.bind(),
                op=self._name,
                groups=tuple(map(tuple, self._groups)),
                who=self._who,
            )
        return self._result


def check_across(p: Plan, op: str, extra, aval, ctx):
    """The check of a call (see :class:`PendingCheck`) emitted at once: a small array that
    exists only once every member agreed."""
    return PendingCheck(p, op, extra, aval, ctx).result()
