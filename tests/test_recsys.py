"""The DLRM step of benchmarks/train_recsys.py against an unsharded single-device reference.

The reference holds every table whole on one device, pools each bag with a plain masked sum,
differentiates the global mean loss with ``jax.grad`` and applies row-wise Adagrad to the dense
table gradient (an untouched row has a zero gradient, so its accumulator and weights stay as
they are: the same as updating only the touched rows). Drops: the reference keeps, per source
device and owner, the first ``capacity`` valid ids in (sample, table, position) order (counted
here in numpy with the ownership rule written out), which is the step's documented rule; the
step's reported drop count must equal the reference's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import strata_jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recsys_model as rm  # noqa: E402

R = 4
AXIS = "x"
ROWS = (300, 200)
DIM = 8
B = 6  # samples per device
L = 4  # ids per bag at most
STEPS = 5
CFG = rm.ModelConfig(rows=ROWS, dim=DIM, dense_features=5, bottom=(16,), top=(16,))


def _owner(t: np.ndarray, i: np.ndarray, sharding: str) -> np.ndarray:
    return i % R if sharding == "row" else t % R


def _keep_mask(ids: np.ndarray, capacity: int, sharding: str) -> np.ndarray:
    """[R * B, T, L] bool: the ids the step keeps (first `capacity` per source and owner)."""
    keep = np.zeros(ids.shape, bool)
    for r in range(R):
        used = np.zeros(R, int)
        for b in range(r * B, (r + 1) * B):
            for t in range(ids.shape[1]):
                for j in range(ids.shape[2]):
                    i = ids[b, t, j]
                    if i < 0:
                        continue
                    o = _owner(np.array(t), np.array(i), sharding)
                    if used[o] < capacity:
                        keep[b, t, j] = True
                    used[o] += 1
    return keep


def _ref_logits(dense, x, pooled):
    h = x
    for p in dense["bottom"]:
        h = jax.nn.relu(h @ p["w"] + p["b"])
    z = jnp.concatenate([h[:, None], pooled], axis=1)
    n = z.shape[1]
    feats = [h] + [
        jnp.sum(z[:, i] * z[:, j], -1, keepdims=True) for i in range(n) for j in range(i + 1, n)
    ]
    g = jnp.concatenate(feats, axis=-1)
    for k, p in enumerate(dense["top"]):
        g = g @ p["w"] + p["b"]
        if k < len(dense["top"]) - 1:
            g = jax.nn.relu(g)
    return g[:, 0]


def _ref_loss(dense, tables, x, ids, keep, y):
    pooled = jnp.stack(
        [
            jnp.sum(jnp.where(keep[:, t, :, None], tables[t][jnp.maximum(ids[:, t], 0)], 0.0), 1)
            for t in range(len(tables))
        ],
        axis=1,
    )
    z = _ref_logits(dense, x, pooled)
    return jnp.mean(jnp.log1p(jnp.exp(-jnp.abs(z))) + jnp.maximum(z, 0) - y * z)


@jax.jit
def _ref_step(state, x, ids, keep, y, hp):
    """One plain training step; ``hp`` = (lr_sparse, lr_dense, dense_acc_init,
    sparse_acc_init, eps)."""
    dense, tables, dacc, tacc = state
    lr_s, lr_d, acc0, sacc0, eps = hp
    loss, (gd, gt) = jax.value_and_grad(_ref_loss, argnums=(0, 1))(dense, tables, x, ids, keep, y)
    dacc = jax.tree.map(lambda a, g: a + g * g, dacc, gd)
    dense = jax.tree.map(lambda p, g, a: p - lr_d * g / (jnp.sqrt(a + acc0) + eps), dense, gd, dacc)
    tacc = [a + jnp.mean(g * g, -1) for a, g in zip(tacc, gt, strict=True)]
    tables = [
        w - lr_s * g / (jnp.sqrt(a + sacc0)[:, None] + eps)
        for w, g, a in zip(tables, gt, tacc, strict=True)
    ]
    return (dense, tables, dacc, tacc), loss


def _reference(dense, tables, batches, keeps, sc: rm.StepConfig):
    """Plain single-device training; returns (losses, dense, tables)."""
    dense = jax.tree.map(jnp.asarray, dense)
    tables = [jnp.asarray(t) for t in tables]
    state = (
        dense,
        tables,
        jax.tree.map(jnp.zeros_like, dense),
        [jnp.zeros(len(t), jnp.float32) for t in tables],
    )
    hp = tuple(
        np.float32(v)
        for v in (sc.lr_sparse, sc.lr_dense, sc.dense_acc_init, sc.sparse_acc_init, sc.eps)
    )
    losses = []
    for (x, ids, y), keep in zip(batches, keeps, strict=True):
        state, loss = _ref_step(state, x, ids, keep, y, hp)
        losses.append(float(loss))
    return losses, state[0], state[1]


def _batches(rng, kind: str):
    out = []
    for _ in range(STEPS):
        x = rng.standard_normal((R * B, CFG.dense_features)).astype(np.float32)
        ids = np.stack([rng.integers(0, n, (R * B, L)) for n in ROWS], axis=1).astype(np.int32)
        ids[rng.random(ids.shape) < 0.3] = -1
        if kind == "skew":  # every id owned by device 1 (row sharding: id % R == 1)
            ids = np.where(ids >= 0, (ids // R) * R + 1, -1)
            ids = np.where(ids < np.array(ROWS)[None, :, None], ids, 1).astype(np.int32)
        if kind == "empty":  # empty bags: a whole sample, a whole table on a device, a device
            ids[0] = -1
            ids[B : 2 * B, 1] = -1
            ids[2 * B : 3 * B] = -1
        y = (rng.random(R * B) < 0.4).astype(np.float32)
        out.append((x, ids, y))
    return out


def _run_sharded(coll, sharding, capacity, batches, seed=0, exchange="padded"):
    mesh = Mesh(np.array(jax.devices()[:R]), (AXIS,))
    layout = rm.Layout(ROWS, R, sharding)
    sc = rm.StepConfig(capacity=capacity, lr_sparse=0.1, lr_dense=0.05)
    fn = rm.make_sharded_step(CFG, layout, sc, mesh, AXIS, coll, exchange=exchange)
    state = rm.initial_state(CFG, layout, seed, mesh, AXIS)
    shard = NamedSharding(mesh, P(AXIS))
    losses, drops, logits, invalid = [], [], [], []
    for batch in batches:
        state, (loss, lg, dropped, bad) = fn(state, tuple(jax.device_put(a, shard) for a in batch))
        losses.append(float(loss))
        drops.append(int(dropped))
        logits.append(np.asarray(lg))
        invalid.append(int(bad))
    return losses, drops, state, layout, sc, invalid


def _check(coll, sharding, capacity, batches, expect_drops, exchange="padded"):
    losses, drops, state, layout, sc, invalid = _run_sharded(
        coll, sharding, capacity, batches, exchange=exchange
    )
    assert invalid == [0] * len(batches)
    dense0, tables0 = rm.init_params(CFG, 0)
    keeps = [_keep_mask(ids, capacity, sharding) for _, ids, _ in batches]
    want_drops = [
        int(((ids >= 0) & ~k).sum()) for (_, ids, _), k in zip(batches, keeps, strict=True)
    ]
    assert drops == want_drops
    assert (sum(drops) > 0) == expect_drops
    ref_losses, ref_dense, ref_tables = _reference(dense0, tables0, batches, keeps, sc)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_dense), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # Tables: row i of table t must sit on its owner at the documented local row.
    glob = np.asarray(state[2])
    rpr = layout.rows_per_rank
    assert glob.shape == (R * rpr, DIM)
    off = 0
    for t, n in enumerate(ROWS):
        i = np.arange(n)
        if sharding == "row":
            where = (i % R) * rpr + off + i // R
            off += -(-n // R)
        else:
            where = (t % R) * rpr + sum(ROWS[u] for u in range(t) if u % R == t % R) + i
        np.testing.assert_allclose(glob[where], np.asarray(ref_tables[t]), rtol=1e-4, atol=1e-6)
        # rows no batch touched keep their initial values exactly
        touched = np.zeros(n, bool)
        for (_, ids, _), k in zip(batches, keeps, strict=True):
            touched[ids[:, t][k[:, t]]] = True
        np.testing.assert_array_equal(glob[where][~touched], tables0[t][~touched])


@pytest.mark.parametrize(
    "impl,drops",
    [
        pytest.param("strata", False, id="no_drops-strata"),
        pytest.param("xla", True, id="drops-xla"),
        pytest.param("strata", True, id="drops-strata", marks=pytest.mark.slow),
        pytest.param("xla", False, id="no_drops-xla", marks=pytest.mark.slow),
    ],
)
def test_matches_unsharded_reference(rng, impl, drops):
    coll = strata_jax if impl == "strata" else jax.lax
    batches = _batches(rng, "uniform")
    capacity = 3 if drops else B * len(ROWS) * L
    _check(coll, "row", capacity, batches, expect_drops=drops)


@pytest.mark.parametrize("drops", [False, True], ids=["no_drops", "drops"])
def test_all_ids_on_one_device(rng, drops):
    batches = _batches(rng, "skew")
    for _, ids, _ in batches:
        assert set(np.unique(ids[ids >= 0] % R)) == {1}
    capacity = 7 if drops else B * len(ROWS) * L
    _check(strata_jax, "row", capacity, batches, expect_drops=drops)


def test_empty_bags(rng):
    batches = _batches(rng, "empty")
    _check(strata_jax, "row", B * len(ROWS) * L, batches, expect_drops=False)


def test_table_sharding(rng):
    _check(strata_jax, "table", 10, _batches(rng, "uniform"), expect_drops=True)


@pytest.mark.parametrize(
    "sharding,drops",
    [("row", True), pytest.param("table", False, marks=pytest.mark.slow)],
)
def test_compact_exchange(rng, sharding, drops):
    """exchange="compact" (strata's ragged_all_to_all of the used slots only, into
    strata_jax.empty) against the unsharded reference, and against the padded all_to_all
    step bit for bit (losses, drops, every state array): the unused rows it leaves unwritten
    are never read."""
    batches = _batches(rng, "uniform")
    capacity = 3 if drops else B * len(ROWS) * L
    _check(strata_jax, sharding, capacity, batches, expect_drops=drops, exchange="compact")
    got = _run_sharded(strata_jax, sharding, capacity, batches, exchange="compact")
    want = _run_sharded(strata_jax, sharding, capacity, batches)
    assert got[0] == want[0] and got[1] == want[1] and got[5] == want[5]
    for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_compact_exchange_sizes(rng):
    """The per-owner slot counts that the compact exchange sends: ``route``'s ``slots`` is
    what each owner's received slots show (numbered 0..n-1), on random batches."""
    layout = rm.Layout(ROWS, R, "row")
    _, ids, _ = _batches(rng, "uniform")[0]
    for cap in (3, 40):
        rt = jax.jit(lambda a, cap=cap: rm.route(a, layout, cap))(ids[:B])
        send = np.asarray(rt["send"]).reshape(R, cap, 2)
        for d in range(R):
            slots = send[d, :, 1][send[d, :, 0] >= 0]
            want = int(slots.max()) + 1 if slots.size else 0
            assert int(rt["slots"][d]) == want
            assert sorted(set(slots.tolist())) == list(range(want))
        bag = np.asarray(rt["slot_bag"]).reshape(R, -1)
        used = (bag < B * len(ROWS)).sum(axis=1)
        np.testing.assert_array_equal(np.asarray(rt["slots"]), used)


def test_exchange_must_be_known():
    with pytest.raises(ValueError, match="exchange 'ragged'"):
        rm.make_train_step(
            CFG, rm.Layout(ROWS, R), rm.StepConfig(capacity=4), AXIS, jax.lax, "ragged"
        )


def test_route_layout():
    """One device's routing by hand: send buffer, slots, bag of each slot, drop count."""
    layout = rm.Layout((8, 8), 2, "row")
    # B = 2 samples, T = 2 tables, L = 3; bags b * T + t = 0, 1, 2, 3
    ids = np.array([[[1, 2, 3], [4, -1, -1]], [[-1, -1, -1], [5, 7, 6]]], np.int32)
    rt = jax.jit(lambda a: rm.route(a, layout, 3))(ids)
    # owner 0 gets (in order) bag0:2, bag1:4, bag3:6 ; owner 1 gets bag0:1,3, bag3:5,7 (7 dropped)
    # local rows: table 0 offset 0, table 1 offset 4; local = off + i // 2
    send = np.asarray(rt["send"]).reshape(2, 3, 2)
    np.testing.assert_array_equal(send[0], [[1, 0], [4 + 2, 1], [4 + 3, 2]])
    np.testing.assert_array_equal(send[1], [[0, 0], [1, 0], [4 + 2, 1]])
    np.testing.assert_array_equal(np.asarray(rt["slot_bag"]).reshape(2, 3), [[0, 1, 3], [0, 3, 4]])
    assert int(rt["dropped"]) == 1


def test_route_errors():
    layout = rm.Layout((8, 8), 2, "row")
    with pytest.raises(ValueError, match="tables"):
        rm.route(jnp.zeros((2, 3, 1), jnp.int32), layout, 4)
    with pytest.raises(ValueError, match="integer"):
        rm.route(jnp.zeros((2, 2, 1), jnp.float32), layout, 4)
    with pytest.raises(ValueError, match="capacity"):
        rm.route(jnp.zeros((2, 2, 1), jnp.int32), layout, 0)


def test_auc():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.standard_normal(300) + y, 1)  # ties included
    pos, neg = s[y], s[~y]
    want = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (
        pos.size * neg.size
    )
    assert rm.auc(y, s) == pytest.approx(want, abs=1e-12)
    assert np.isnan(rm.auc(np.zeros(3), np.arange(3)))


# ------------------------------------------------------------------------------------------------
# Ids outside their table are dropped and counted
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,sharding",
    [
        pytest.param(b, s, id=f"{s}-id{b}", marks=[] if (i + j) % 2 == 0 else [pytest.mark.slow])
        for i, b in enumerate([4, 5, 7, -2, -7])
        for j, s in enumerate(["row", "table"])
    ],
)
def test_id_outside_its_table_is_dropped_and_counted(sharding, bad):
    """2 tables of 4 rows over 2 devices. Table 0's id 4 (its row count) used to land
    on table 1's row 0 (row sharding) or the next table's / a padding row (table sharding);
    ids below 0 other than the padding id -1 likewise. Now: not sent anywhere, counted as
    ``invalid`` (not as a capacity drop), and the routing of the other ids is unchanged."""
    layout = rm.Layout((4, 4), 2, sharding)
    good = np.array([[[1, 2, -1], [3, 0, -1]], [[0, -1, -1], [2, 1, 3]]], np.int32)
    ids = good.copy()
    ids[0, 0, 2] = bad  # table 0, an id outside [0, 4) (and not the padding id -1)
    run = jax.jit(lambda a: rm.route(a, layout, 16))
    got, want = run(ids), run(good)
    for k in ("send", "slot_bag"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    assert int(got["dropped"]) == 0
    assert int(got["invalid"]) == 1
    assert int(want["invalid"]) == 0


def test_ids_wider_than_int32_are_not_wrapped():
    """An int64 id 2**32 + 1 of a 4-row table is outside it (it wrapped to row 1 by the int32
    cast); uint32 ids work, and their 2**32 - 1 is no padding id."""
    layout = rm.Layout((4, 4), 2, "row")
    base = np.array([[[1, -1], [2, 3]]], np.int64)
    want = jax.jit(lambda a: rm.route(a, layout, 8))(base)
    wide = base.copy()
    wide[0, 0, 1] = 2**32 + 1
    got = jax.jit(lambda a: rm.route(a, layout, 8))(wide)
    np.testing.assert_array_equal(np.asarray(got["send"]), np.asarray(want["send"]))
    assert int(got["invalid"]) == 1
    u = np.array([[[1, 4294967295], [2, 3]]], np.uint32)
    got = jax.jit(lambda a: rm.route(a, layout, 8))(u)
    np.testing.assert_array_equal(np.asarray(got["send"]), np.asarray(want["send"]))
    assert int(got["invalid"]) == 1


@pytest.mark.parametrize("sharding", ["row", "table"])
def test_step_with_ids_outside_their_tables(rng, sharding):
    """A training step whose batch holds ids outside their tables gives the state and loss of
    the same batch with those ids made padding (-1), bitwise, and reports how many there were
    (summed over devices); the other table's rows are untouched by table 0's bad ids."""
    good_batches, bad_batches = [], []
    for x, ids, y in _batches(rng, "uniform")[:2]:
        bad, good = ids.copy(), ids.copy()
        for (b, j), v in zip(
            np.argwhere(ids[:, 0] >= 0)[:3], (ROWS[0], ROWS[0] + 7, -3), strict=True
        ):
            bad[b, 0, j] = v  # three ids of table 0 outside it
            good[b, 0, j] = -1
        bad_batches.append((x, bad, y))
        good_batches.append((x, good, y))
    n_bad = [3, 3]
    cap = B * len(ROWS) * L
    got = _run_sharded(strata_jax, sharding, cap, bad_batches)
    want = _run_sharded(strata_jax, sharding, cap, good_batches)
    assert got[0] == want[0]  # losses, bitwise
    assert got[1] == want[1] == [0, 0]  # no capacity drops
    assert got[5] == n_bad and want[5] == [0, 0]
    for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_benchmark_strata_ops_count_strata_alone(tmp_path):
    """train_recsys.py's ``# strata's collectives, per device per timed step`` line (and
    ``strata_ops`` in its JSON) counts the turns of ``--impl strata`` alone: with
    ``strata_padded`` stepped beside it, the process-wide counters used to add both forms'
    calls (all_to_all 4 and psum 4 per step instead of 1 and 2)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_recsys.py"
    argv = [sys.executable, str(script), "--impl", "strata,strata_padded", "--devices", "2"]
    argv += ["--steps", "2", "--warmup", "1", "--batch", "16", "--tables", "2", "--rows", "64"]
    argv += ["--dim", "8", "--bottom", "8", "--top", "8", "--no-progress", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "JAX_"))}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ops = json.loads((tmp_path / "train_recsys.json").read_text())["strata_ops"]
    calls = {name: ops[name]["calls"] for name in ("all_to_all", "ragged_all_to_all", "psum")}
    # compact strata: the ids' all_to_all, the two ragged exchanges, pmean and the counts' psum
    assert calls == {"all_to_all": 1, "ragged_all_to_all": 2, "psum": 2}, calls


def test_benchmark_across_hosts_uses_the_padded_exchange(tmp_path):
    """train_recsys.py under ``launch --hosts 2``: strata's default compact exchange is
    ragged_all_to_all, which does not cross fabrics, so the script exchanges the padded slots
    there and says so (it used to fail at lowering: 'ragged_all_to_all over a group that spans
    fabric domains'); its loss curve equals jax.lax's."""
    from _mp_util import run_benchmark

    args = ["--impl", "strata,xla", "--steps", "2", "--warmup", "1", "--batch", "16"]
    args += ["--tables", "2", "--rows", "64", "--dim", "8", "--bottom", "8", "--top", "8"]
    out = run_benchmark("train_recsys.py", tmp_path, *args, hosts=2)
    assert "the 2 fabrics (hosts) of this job: strata's pooled embeddings" in out, out[-3000:]
    assert "# loss curves strata vs xla" in out and ": OK" in out, out[-3000:]
    args = json.loads((tmp_path / "train_recsys.json").read_text())["args"]
    assert args["strata_exchange"] == "padded"
