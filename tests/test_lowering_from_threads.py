"""Lowering from several threads.

strata's lowering keeps its state in the module being lowered and swaps nothing of JAX's, so
programs lowered and compiled at the same time by several threads are each what they are when
lowered alone, and JAX's functions are JAX's afterwards.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import mesh1d
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax._src.jax_compat import mlir

JAXPR_SUBCOMP = mlir.jaxpr_subcomp  # JAX's own, as imported before any lowering here


def _program(k: int, lax_psum: bool = False):
    """Program k: three lax.cond whose branches (chosen by axis_index % 2, so neighbours take
    different branches) each hold one psum (ranks in different branches meet in it); k changes
    the values around it."""
    psum = jax.lax.psum if lax_psum else sj.psum

    def body(x):
        odd = jax.lax.axis_index("x") % 2 == 1
        for j in range(3):
            x = jax.lax.cond(
                odd,
                lambda v, j=j: psum(v * (k + 1), "x") + j,
                lambda v, j=j: psum(jnp.sin(v) - (k + j), "x") * (k % 3 + 1),
                x,
            )
            x = x / 8 + jax.lax.axis_index("x")
        return x

    return jax.jit(
        jax.shard_map(body, mesh=mesh1d(4), in_specs=P("x"), out_specs=P("x"), check_vma=False)
    )


def _in_threads(work, n: int) -> None:
    """Runs work(k) for k in range(n), each on a thread of its own, and waits for them all."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize(
    "rounds", [2, pytest.param(10, marks=pytest.mark.slow, id="10-the-case's-own")]
)
def test_lowering_from_eight_threads(rng, rounds):
    """8 threads each lower and compile a different program over 4 devices, ``rounds`` times
    (the case's 10 behind -m slow: a minute on this machine)."""
    x = jnp.asarray(rng.standard_normal((4 * 2, 3)).astype(np.float32))
    alone = [np.asarray(_program(k).lower(x).compile()(x)) for k in range(8)]
    errors = []
    compiled = [[None] * 8 for _ in range(rounds)]
    barrier = threading.Barrier(8)

    def work(k):
        try:
            for r in range(rounds):
                barrier.wait()
                compiled[r][k] = _program(k).lower(x).compile()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    _in_threads(work, 8)
    assert not errors, errors
    assert mlir.jaxpr_subcomp is JAXPR_SUBCOMP
    for r in range(rounds):
        for k in range(8):
            np.testing.assert_array_equal(np.asarray(compiled[r][k](x)), alone[k], f"{r=} {k=}")


def test_jax_lax_psums_lowered_from_threads_under_use_for_jax_lax(rng):
    """The same with jax.lax.psum under use_for_jax_lax() (entered in each thread: the
    setting is thread-local), 4 threads, 2 rounds: each program on strata and as alone."""
    x = jnp.asarray(rng.standard_normal((4 * 2, 3)).astype(np.float32))
    with sj.use_for_jax_lax():
        alone = [np.asarray(_program(k, lax_psum=True)(x)) for k in range(4)]
    compiled, errors = {}, []

    def work(k):
        try:
            with sj.use_for_jax_lax():
                for r in range(2):
                    c = _program(k, lax_psum=True).lower(x).compile()
                    assert "strata_all_reduce" in c.as_text()
                    compiled[r, k] = c
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _in_threads(work, 4)
    assert not errors, errors
    assert mlir.jaxpr_subcomp is JAXPR_SUBCOMP
    for (_, k), c in sorted(compiled.items()):
        np.testing.assert_array_equal(np.asarray(c(x)), alone[k])
