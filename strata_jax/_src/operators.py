"""The operator table: every operator strata runs, one row each, as the native extension spells it.

The table is written once, in ``native/common/ops.h`` (``STRATA_OPERATORS``); the extension hands
it over (``strata_jax._strata.operators()``) and this module reads it at import. Everything that
lists operators takes them from here: the jax.lax primitives ``use_for_jax_lax()`` hooks
(``lax_hooks.py``), the primitives ``coverage()`` records (``coverage.py``), the algorithms
``comm_stats()`` splits calls by (``stats.py``), the names the hierarchical forms report
(``hierarchy/``), and the operator list of the docs (``docs/_ext/strata_docs.py``).
``tests/test_operators.py`` checks that the Python side agrees with it.
"""

from __future__ import annotations

import dataclasses
import importlib

from strata_jax._src.extension import NAME


@dataclasses.dataclass(frozen=True)
class Operator:
    """One row of the table.

    Attributes:
      id: the operator's one name in the native code (``Op::id``).
      kind: the number its calls carry, compared at every rendezvous.
      api: what a user calls: ``strata_jax.<api>`` (``"moe.dispatch"``).
      lax: the jax.lax primitives it runs under ``use_for_jax_lax()``.
      target: its FFI target, which is also the name of its JAX primitive.
      stats: its name in ``comm_stats()["ops"]``.
      algorithms: what ``comm_stats()`` splits its calls by (``("one_shot", "two_shot")`` or
        ``("direct",)``).
      reduce: the reduction's code in the native kernels (-1: not a reduction).
    """

    id: str
    kind: int
    api: str
    lax: tuple[str, ...]
    target: str
    stats: str
    algorithms: tuple[str, ...]
    reduce: int


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One reduction the all-reduce kernels compute (``STRATA_REDUCTIONS``).

    Attributes:
      code: its number in the native kernels (``ReduceOp``), what a call's ``reduce`` carries.
      kind: its name in the JAX primitives' ``reduce`` parameter (``"sum"``, ``"max"``...).
      element: the jax.lax primitive that combines two elements (``jax.lax.<element>_p``).
    """

    code: int
    kind: str
    element: str


def _read() -> tuple[Operator, ...]:
    rows = importlib.import_module(NAME).operators()
    return tuple(
        Operator(
            id=r["id"],
            kind=int(r["kind"]),
            api=r["api"],
            lax=tuple(r["lax"].split()),
            target=r["target"],
            stats=r["stats"],
            algorithms=tuple(r["algorithms"].split()),
            reduce=int(r["reduce"]),
        )
        for r in rows
    )


OPERATORS: tuple[Operator, ...] = _read()
REDUCTION_ROWS: tuple[Reduction, ...] = tuple(
    Reduction(code=int(r["code"]), kind=r["kind"], element=r["element"])
    for r in importlib.import_module(NAME).reductions()
)
BY_ID = {op.id: op for op in OPERATORS}
BY_STATS = {op.stats: op for op in OPERATORS}

# The reductions' codes by public name (psum 0, pmax 1, pmin 2, pmean 3), and by the name the
# all-reduce primitive's ``reduce`` parameter uses (sum, max, min, mean); the public name of each
# code; the jax.lax primitive that combines two elements of each kind.
REDUCE_CODES = {op.api: op.reduce for op in OPERATORS if op.reduce >= 0}
REDUCE_CODES_BY_KIND = {r.kind: r.code for r in REDUCTION_ROWS}
REDUCTIONS = {code: api for api, code in REDUCE_CODES.items()}
ELEMENT_OPS = {r.kind: r.element for r in REDUCTION_ROWS}


def targets() -> frozenset[str]:
    """The FFI targets (JAX primitive names) of the operators."""
    return frozenset(op.target for op in OPERATORS)


def api_of_target(target: str, reduce: int | None = None) -> str:
    """The public name of the operator whose call goes through ``target`` (the reduction of
    code ``reduce`` for the all-reduce target); ``target`` itself when no operator has it."""
    if reduce is not None and int(reduce) in REDUCTIONS:
        return REDUCTIONS[int(reduce)]
    for op in OPERATORS:
        if op.target == target:
            return op.api
    return target
