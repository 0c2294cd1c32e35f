"""The operator table (native/common/ops.h, read by strata_jax/_src/operators.py) and every list
derived from it agree: the FFI targets registered with XLA, the jax.lax primitives
use_for_jax_lax() hooks, the primitives coverage() records, the public functions, the names
comm_stats() counts under, the reduction codes, and the docs' operator list."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax._src import collectives, coverage, hierarchy, lax_hooks, operators, runtime

ROOT = Path(__file__).resolve().parents[1]


def test_kinds_are_the_table_order_and_names_are_unique():
    ops = operators.OPERATORS
    assert [op.kind for op in ops] == list(range(1, len(ops) + 1))
    assert len({op.id for op in ops}) == len({op.stats for op in ops}) == len(ops)
    assert all(op.target.startswith("strata_") for op in ops)


def test_every_target_is_registered_with_xla():
    handlers = runtime.native().handlers()
    assert operators.targets() <= set(handlers)
    assert all(name.startswith("strata_") for name in handlers)


def test_every_operator_is_a_public_function():
    for op in operators.OPERATORS:
        obj = sj
        for part in op.api.split("."):
            obj = getattr(obj, part)
        assert callable(obj) and obj.__doc__, op.api


def test_hooks_follow_the_table():
    """lax_hooks has a rule for exactly the operators that run jax.lax primitives, and hooks
    every primitive the table names (the ones the running JAX release has)."""
    with_lax = {op.id for op in operators.OPERATORS if op.lax}
    assert set(lax_hooks.RULES) == with_lax
    hooked = {prim.name for prim, _, _ in lax_hooks._HOOKS}
    named = {name for op in operators.OPERATORS for name in op.lax}
    assert hooked <= named and {"psum", "all_gather", "ppermute"} <= hooked


def test_coverage_records_every_operator_primitive():
    assert {p.name for p in coverage.strata_primitives()} == set(operators.targets())


def test_reduction_codes_follow_the_table():
    """Each reduction's code is its row in STRATA_REDUCTIONS, under its kind and under the
    public name of the operator that computes it."""
    by_kind = {r.kind: r.code for r in operators.REDUCTION_ROWS}
    assert {"sum": 0, "max": 1, "min": 2, "mean": 3}.items() <= by_kind.items()
    assert collectives._REDUCE_CODES == by_kind
    assert operators.REDUCE_CODES == {f"p{kind}": code for kind, code in by_kind.items()}
    assert lax_hooks.REDUCE_CODES["pmax"] == 1
    rows = operators.REDUCTION_ROWS
    assert [r.code for r in rows] == list(range(len(rows)))
    assert {op.reduce for op in operators.OPERATORS} - {-1} <= {r.code for r in rows}
    assert hierarchy.steps.REDUCERS["max"] is jax.lax.max_p
    assert hierarchy.steps.REDUCERS["sum"] is hierarchy.steps.REDUCERS["mean"] is jax.lax.add_p


def test_comm_stats_counts_under_the_table_names(rng):
    """Every operator a program runs is counted under its table name, and an all-reduce's calls
    are split by the algorithms the table names for it."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x = jnp.asarray(rng.standard_normal(64).astype(np.float32))
    perm = [(i, (i + 1) % 4) for i in range(4)]
    bodies = {
        "psum": lambda v: sj.psum(v, "x"),
        "pmean": lambda v: sj.pmean(v, "x"),
        "ppermute": lambda v: sj.ppermute(v, "x", perm),
        "pbroadcast": lambda v: sj.pbroadcast(v, "x", 1),
    }
    fns = {
        k: jax.jit(jax.shard_map(b, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        for k, b in bodies.items()
    }
    jax.block_until_ready([f(x) for f in fns.values()])
    sj.reset_stats()
    jax.block_until_ready([f(x) for f in fns.values()])
    ops = sj.comm_stats()["ops"]
    for name in bodies:
        algos = operators.BY_STATS[name].algorithms
        assert set(ops[name]["algorithm"]) == set(algos), name
        assert sum(ops[name]["algorithm"].values()) == ops[name]["calls"] == 4, name


def test_docs_list_the_table():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import strata_docs
    finally:
        sys.path.pop(0)
    rows = strata_docs.operator_rows()[1:]
    assert [r[3] for r in rows] == [f"``{op.target}``" for op in operators.OPERATORS]
    assert ".. strata-operators::" in (ROOT / "docs" / "api.md").read_text()
