"""The DLRM step of benchmarks/recsys_model.py across processes: exchange="compact" (strata's
ragged_all_to_all of the used slots only, into strata_jax.empty) against the padded all_to_all
step, bit for bit (losses, drops, every state array), on random batches.

Run under the launcher: ``python -m strata_jax.launch -n P [--devices-per-proc D]
check_recsys_compact.py``. Every process draws the same batches from one seed and feeds its
own devices' rows. Prints "OK recsys compact" per process; raises on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recsys_model as rm  # noqa: E402

sj.set_timeout(60)
devs = sorted(jax.devices(), key=lambda d: d.id)
R = len(devs)
mesh = Mesh(np.array(devs), ("x",))
ROWS, B, L = (300, 200), 6, 4
cfg = rm.ModelConfig(rows=ROWS, dim=8, dense_features=5, bottom=(16,), top=(16,))
layout = rm.Layout(ROWS, R, "row")
rng = np.random.default_rng(4321)


def put(a: np.ndarray):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x")), lambda i: a[i])


batches = []
for _ in range(3):
    x = rng.standard_normal((R * B, 5)).astype(np.float32)
    ids = np.stack([rng.integers(0, n, (R * B, L)) for n in ROWS], axis=1).astype(np.int32)
    ids[rng.random(ids.shape) < 0.3] = -1
    batches.append((x, ids, (rng.random(R * B) < 0.4).astype(np.float32)))

runs = {}
for exchange in ("compact", "padded"):
    sc = rm.StepConfig(capacity=3, lr_sparse=0.1, lr_dense=0.05)  # capacity 3: some drops
    fn = rm.make_sharded_step(cfg, layout, sc, mesh, "x", sj, exchange=exchange)
    state = rm.initial_state(cfg, layout, 0, mesh, "x")
    out = []
    for b in batches:
        state, (loss, _, dropped, _) = fn(state, tuple(put(a) for a in b))
        out.append((float(np.asarray(loss.addressable_data(0))), int(dropped.addressable_data(0))))
    runs[exchange] = (out, [np.asarray(s.data) for a in jax.tree.leaves(state) for s in
                            sorted(a.addressable_shards, key=lambda s: str(s.index))])  # fmt: skip

assert runs["compact"][0] == runs["padded"][0], runs
assert sum(d for _, d in runs["padded"][0]) > 0, "no drops: the capacity no longer bites"
for g, w in zip(runs["compact"][1], runs["padded"][1], strict=True):
    np.testing.assert_array_equal(g, w)
print(f"OK recsys compact (process {info['process_id']})", flush=True)
