"""How much of each lowered program runs on strata: :func:`coverage`.

Every collective lowered for the CPU is recorded while its program is lowered: strata's own
operators (``strata_jax.psum`` ..., MoE dispatch/combine) as on strata, JAX's collectives
(``lax_hooks.py``) as on strata or on XLA with the reason. One record per lowered program
(per MLIR module: ``jit_step``, ``pmap_f`` ...), kept for the last ``_KEEP`` programs of the
process. ``STRATA_DEBUG=INFO`` also logs each collective that stays on XLA for a reason other
than ``use_for_jax_lax()`` being off, as it is lowered.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from strata_jax._src import collectives, debug, operators, ragged  # noqa: F401  (their primitives)
from strata_jax._src.jax_compat import lowering_rule, mlir, registered_primitives

_KEEP = 256
_KEY = ("strata_jax", "coverage")
_lock = threading.Lock()
_records: collections.deque = collections.deque(maxlen=_KEEP)


@dataclasses.dataclass
class ProgramCoverage:
    """Where the collectives of one lowered program went.

    Attributes:
      program: the lowered module's name (``jit_step`` for ``jax.jit(step)``).
      strata: collective (primitive name) -> how many of its applications lower to strata.
      xla: collective -> {reason it stayed on XLA -> how many}.
      calls: how many strata calls the collectives on strata became: fewer than
        ``on_strata`` where several all-reduces were combined into one call (a pytree's
        leaves, the gradient all-reduces of a training step: ``STRATA_COMBINE_BYTES``).
    """

    program: str
    strata: dict[str, int] = dataclasses.field(default_factory=dict)
    xla: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    calls: int = 0

    @property
    def on_strata(self) -> int:
        """Number of collectives lowered to strata."""
        return sum(self.strata.values())

    @property
    def on_xla(self) -> int:
        """Number of collectives left to XLA."""
        return sum(n for reasons in self.xla.values() for n in reasons.values())

    def __str__(self) -> str:
        total = self.on_strata + self.on_xla
        line = f"{self.program}: {self.on_strata} of {total} collectives on strata"
        if self.on_strata:
            line += f" in {self.calls} call" + ("s" if self.calls != 1 else "")
        if self.strata:
            line += " (" + ", ".join(f"{op} {n}" for op, n in sorted(self.strata.items())) + ")"
        if self.xla:
            parts = [
                f"{op} {n} ({why})"
                for op, reasons in sorted(self.xla.items())
                for why, n in sorted(reasons.items())
            ]
            line += f"; {self.on_xla} on XLA: " + ", ".join(parts)
        return line


def _program_name(ctx) -> str:
    try:
        return str(ctx.module_context.module.operation.attributes["sym_name"].value)
    except Exception:  # noqa: BLE001 - a module without a name (lowered by hand)
        return "<unnamed>"


def record(ctx, op: str, reason: str | None, calls: int = 1) -> None:
    """Records that ``op`` (a primitive name) of the program being lowered under ``ctx`` went
    to strata (``reason`` None) as ``calls`` strata calls (0 for the members of a combined
    call but one), or stayed on XLA because of ``reason``."""
    cache = ctx.module_context.cached_primitive_lowerings
    rec = cache.get(_KEY)
    if rec is None:
        rec = cache[_KEY] = ProgramCoverage(_program_name(ctx))
        with _lock:
            _records.append(rec)
    with _lock:
        if reason is None:
            rec.strata[op] = rec.strata.get(op, 0) + 1
            rec.calls += calls
        else:
            reasons = rec.xla.setdefault(op, {})
            reasons[reason] = reasons.get(reason, 0) + 1
    if reason is not None and debug.level() and not reason.endswith("is off"):
        debug.log(f"{rec.program}: {op} stays on XLA: {reason}")


def coverage() -> list[ProgramCoverage]:
    """Per lowered program (oldest first, the last 256 of the process), the collectives that
    run on strata and those that stay on XLA with the reason.

    Returns:
      list of :class:`ProgramCoverage` (copies): ``program`` (the module name, e.g.
      ``jit_step``), ``strata`` (primitive name -> count: JAX's ``psum``, ``psum_invariant``,
      ``all_gather``... lowered to strata under :func:`strata_jax.use_for_jax_lax`, and strata's
      own ``strata_all_reduce``... called directly), ``xla`` (primitive name -> {reason ->
      count}), ``calls`` (how many strata calls those on strata became: several all-reduces
      of one pytree or one training step are combined into one call under
      :func:`strata_jax.use_for_jax_lax`, see ``STRATA_COMBINE_BYTES``), and ``str(record)``,
      one line: ``"jit_step: 17 of 17 collectives on strata in 3 calls (psum 9,
      psum_invariant 8)"``. A program is recorded when it is lowered (a jitted function's
      first call, or again when its cache key changes), and only if it holds a collective.
      Counts are of the lowered program; XLA may later combine the all-reduces left to it.
    """
    with _lock:
        return [
            ProgramCoverage(
                r.program, dict(r.strata), {op: dict(w) for op, w in r.xla.items()}, r.calls
            )
            for r in _records
        ]


def strata_primitives() -> list:
    """strata's own primitives: those named after an operator's target in the operator table
    (operators.py), as their modules registered them (collectives, ragged, moe)."""
    import strata_jax.moe  # noqa: F401  (registers the MoE primitives)

    names = operators.targets()
    return [p for p in registered_primitives("cpu") if p.name in names]


def _record_strata_operators() -> None:
    """Wraps the CPU lowering of strata's own operators so they are recorded too."""
    for prim in strata_primitives():
        rule = lowering_rule(prim, "cpu")

        def recorded(ctx, *args, rule=rule, name=prim.name, **params):
            out = rule(ctx, *args, **params)
            record(ctx, name, None)
            return out

        mlir.register_lowering(prim, recorded, platform="cpu", cacheable=False)


_record_strata_operators()
