"""The check across fabrics carries a call's first exchange between fabrics when it is small
(hierarchy/checks.py: PendingCheck.carry): one collective between fabrics where there were two.

Oracles: the same call with the carry off (``STRATA_CHECK_CARRY_BYTES=0``), bitwise, and
jax.lax on the same input. The compiled program of a carried call holds the check's all-gather
and no other collective between fabrics; a call too large to carry keeps its own exchange.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import rotation
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax._src import topology

# The XLA collectives a step between fabrics may lower to (the check's own is an all-gather).
_CROSS = ("all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

LAYOUTS = {
    "2x2": (4, lambda d: d.id // 2),  # two fabrics of two (two hosts of two)
    "2x4": (8, lambda d: d.id // 4),
    "4x1": (4, lambda d: d.id),  # one device per fabric: XLA's collective over the whole group
    "interleaved": (4, lambda d: d.id % 2),
}

# Pairs between fabrics within the check's groups (member l of each fabric; the whole group
# with one device per fabric), so that the permute rides in the check's message; a member
# that receives nothing gets zeros.
PERMS = {
    "2x2": [(0, 2), (2, 0), (1, 3)],
    "interleaved": [(0, 1), (1, 0), (3, 2)],
    "4x1": [(0, 3), (3, 0), (1, 2)],
}
OPS = {
    "psum": lambda m, layout: lambda v: m.psum(v, "x"),
    "pmax": lambda m, layout: lambda v: m.pmax(v, "x"),
    "pmin": lambda m, layout: lambda v: m.pmin(v, "x"),
    "all_gather": lambda m, layout: lambda v: m.all_gather(v, "x", tiled=True),
    "all_gather_axis1": lambda m, layout: lambda v: m.all_gather(v, "x", axis=1),
    "psum_scatter": lambda m, layout: lambda v: m.psum_scatter(v, "x", tiled=True),
    "psum_scatter_dim1": lambda m, layout: (
        lambda v: m.psum_scatter(v, "x", scatter_dimension=1, tiled=True)
    ),
    "all_to_all": lambda m, layout: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True),
    "all_to_all_1_0": lambda m, layout: lambda v: m.all_to_all(v, "x", 1, 0, tiled=True),
    "ppermute": lambda m, layout: lambda v: m.ppermute(v, "x", PERMS[layout]),
    "pbroadcast": lambda m, layout: lambda v: sj.pbroadcast(v, "x", 1),
}


def _fabrics(monkeypatch, layout: str):
    n, fabric_of = LAYOUTS[layout]
    names = tuple("abcdefgh"[: len({fabric_of(d) for d in jax.devices()[:n]})])
    monkeypatch.setattr(topology, "_map", topology.FabricMap(names, 0))
    monkeypatch.setattr(topology, "fabric_of_device", fabric_of)
    return Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[:n]), ("x",))


def _run(mesh, body, x, monkeypatch, carry: str | None):
    if carry is None:
        monkeypatch.delenv("STRATA_CHECK_CARRY_BYTES", raising=False)
    else:
        monkeypatch.setenv("STRATA_CHECK_CARRY_BYTES", carry)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    hlo = f.lower(x).compile().as_text()
    return np.asarray(f(x)), hlo


def _input(rng, n: int, rows: int, dtype):
    shape = (n * rows, 2 * n)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(-50, 50, shape).astype(dtype)
    x = rng.standard_normal(shape).astype(dtype)
    x[0, 0] = np.nan  # NaN and zero ties cross as the fold defines them
    x[1, 1], x[n * rows - 1, 1] = -0.0, 0.0
    return x


@pytest.mark.parametrize(
    "layout,op,dtype",
    rotation(
        [(lay, op) for lay in LAYOUTS for op in OPS],
        [[np.float32, jnp.bfloat16, np.int8, np.int32, np.float16, np.bool_]],
    ),
)
def test_carried_call_equals_uncarried_and_lax(monkeypatch, rng, layout, op, dtype):
    if dtype == np.bool_ and op.startswith(("psum", "pmax", "pmin")):
        pytest.skip("no reductions of bool (jax.lax refuses them too)")
    mesh = _fabrics(monkeypatch, layout)
    n = mesh.size
    if op == "ppermute" and layout not in PERMS:
        pytest.skip("the permutations are written for 4 devices")
    x = _input(rng, n, 2 * n, dtype)
    make = OPS[op]
    before = sj.comm_stats()["inter_fabric_bytes"]
    got, hlo = _run(mesh, make(sj, layout), x, monkeypatch, None)
    carried = sj.comm_stats()["inter_fabric_bytes"] - before
    off, hlo_off = _run(mesh, make(sj, layout), x, monkeypatch, "0")
    uncarried = sj.comm_stats()["inter_fabric_bytes"] - before - carried
    if op in ("pmax", "pmin"):  # strata propagates NaN (collectives.md); XLA:CPU's drops it
        blocks = np.asarray(x, np.float64).reshape(n, -1, x.shape[1])
        red = np.max(blocks, 0) if op == "pmax" else np.min(blocks, 0)
        want = np.tile(red, (n, 1)).astype(x.dtype)
    else:
        want, _ = _run(mesh, make(jax.lax, layout), x, monkeypatch, None)
    # Carried or not, the same bits (the fold of psum/pmax runs in group order everywhere;
    # XLA's all-reduce of two members is commutative, exact).
    if layout != "4x1" or op not in ("psum", "psum_scatter", "psum_scatter_dim1"):
        assert got.dtype == off.dtype and got.shape == off.shape
        np.testing.assert_array_equal(got.view(np.uint8), off.view(np.uint8), err_msg=op)
    if jnp.issubdtype(dtype, jnp.floating):
        tol = 1e-5 if dtype == np.float32 else 2e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
        )  # NaN where the oracle has NaN, and only there
    else:
        np.testing.assert_array_equal(got, want)
    # The carried program moves its data in the check's all-gather: no other collective.
    assert "strata_check_across_fabrics" in hlo
    assert not [c for c in _CROSS if f" {c}(" in hlo or f"{c}-start(" in hlo], op
    assert re.search(r" all-gather(-start)?\(", hlo)
    # Counted as the exchange it replaces, per call.
    assert carried == uncarried > 0, (carried, uncarried)
    assert any(f" {c}(" in hlo_off or f"{c}-start(" in hlo_off for c in (*_CROSS, "all-gather"))


def test_a_call_above_the_carry_keeps_its_exchange(monkeypatch, rng):
    """psum of 64 KiB per shard between two fabrics of two: carried at the default (64 KiB);
    with STRATA_CHECK_CARRY_BYTES=16K, its own exchange (a collective-permute) after the
    check, and the same values."""
    mesh = _fabrics(monkeypatch, "2x2")
    x = rng.standard_normal((4 * 2, 16 * 1024)).astype(np.float32)  # 128 KiB per device
    body = lambda v: sj.psum(v, "x")  # noqa: E731
    got, hlo = _run(mesh, body, x, monkeypatch, None)
    assert "collective-permute" not in hlo
    small, hlo_small = _run(mesh, body, x, monkeypatch, "16K")
    assert "collective-permute" in hlo_small and "strata_check_across_fabrics" in hlo_small
    np.testing.assert_array_equal(got, small)
    np.testing.assert_allclose(got[:2], x.reshape(4, 2, -1).sum(0), rtol=1e-4, atol=1e-5)


def test_a_step_that_cannot_ride_waits_for_the_check(monkeypatch, rng):
    """A ring ppermute over two fabrics of two crosses between members of different check
    groups (1 -> 2, 3 -> 0): it keeps its own collective-permute, which reads its operand
    handed on by the check (strata_order), so no byte crosses before the members agreed."""
    mesh = _fabrics(monkeypatch, "2x2")
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = jax.jit(
        jax.shard_map(
            lambda v: sj.ppermute(v, "x", ring), mesh=mesh, in_specs=P("x"), out_specs=P("x")
        )
    )
    x = rng.standard_normal((16,)).astype(np.float32)
    text = f.lower(x).as_text()
    gated = re.search(r"%(\S+) = stablehlo.custom_call @strata_order\(", text)
    assert gated and re.search(rf'"stablehlo.collective_permute"\(%{gated[1]}\)', text), text
    np.testing.assert_array_equal(np.asarray(f(x)), np.roll(x.reshape(4, 4), 1, 0).ravel())
