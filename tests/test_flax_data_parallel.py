"""docs/examples/flax_data_parallel.py, tiny: a Flax CNN with BatchNorm over the data axis,
optax adam, shard_map data parallelism, on 2 devices. Under use_for_jax_lax() the losses of 5
steps are bitwise those of jax.lax with check_vma on and off, and every all-reduce of the
compiled step is a strata call (before the lowering hook, 14 of the 29 stayed on XLA with
check_vma on)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import strata_jax as sj

pytest.importorskip("flax")
pytest.importorskip("optax")

_spec = importlib.util.spec_from_file_location(
    "flax_data_parallel",
    Path(__file__).resolve().parent.parent / "docs" / "examples" / "flax_data_parallel.py",
)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@pytest.mark.parametrize("check_vma", [True, False])
def test_flax_loop_bitwise_and_every_all_reduce_on_strata(check_vma):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    data = example.batches(mesh, 5, batch=2, image=6, seed=np.random.default_rng().integers(99))
    losses, hlo = {}, {}
    for on in (False, True):
        step, state = example.build(
            mesh, batchnorm=True, check_vma=check_vma, image=6, features=((4, 1),), hidden=4
        )
        n_leaves = len(jax.tree_util.tree_leaves(state[0]))
        with sj.use_for_jax_lax(on):
            lowered = step.lower(state, *data[0])
            compiled = lowered.compile()
        rec = sj.coverage()[-1]
        if not on:
            all_reduces = lowered.as_text().count("stablehlo.all_reduce")
        hlo[on] = compiled.as_text()
        losses[on] = []
        for x, y in data:
            state, loss = compiled(state, x, y)
            losses[on].append(np.asarray(loss))
    assert [v.tobytes() for v in losses[True]] == [v.tobytes() for v in losses[False]]
    n = rec.on_strata  # 2 per parameter (the implicit pvary's transpose and the pmean) + BN's
    assert rec.on_xla == 0 and n == all_reduces == (19 if check_vma else 12), str(rec)
    # Combined: far fewer strata calls than all-reduces, each one a call.
    calls = hlo[True].count('custom_call_target="strata_all_reduce"') + hlo[True].count(
        'custom_call_target="strata_all_reduce_list"'
    )
    print(rec, "; parameter leaves:", n_leaves)
    assert calls == rec.calls <= n_leaves // 2, str(rec)
    assert not re.search(r"all-reduce(-start)?\(", hlo[True])
    assert re.search(r"all-reduce\(", hlo[False])  # what jax.lax compiles to
