"""DLRM-style recommendation model with row-sharded embedding tables, for train_recsys.py.

Model (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems"): dense features through a bottom MLP to a vector of width ``dim``;
each categorical feature is a bag of ids into its own embedding table, sum-pooled; the pairwise
dot products of the T + 1 vectors (strict upper triangle) next to the bottom output feed the top
MLP, whose single output is a click logit (sigmoid + binary cross-entropy).

Parallelism, inside ``jax.shard_map`` over one axis of R devices (TorchRec's row-wise sharding
with DLRM's data-parallel MLPs):

* every device holds its own batch of B samples and a replica of the dense MLPs, whose gradients
  are averaged with ``pmean`` (one flat bucket, DDP-style);
* the tables live in one array of ``R * rows_per_rank`` rows sharded over the axis. ``row``
  sharding puts id ``i`` of table ``t`` on device ``i % R`` (a hashed id space spreads its hot
  rows); ``table`` sharding puts all of table ``t`` on device ``t % R``.

One step, per device (``make_train_step``):

1. route: every id goes to its owner. At most ``capacity`` ids per destination (a fixed shape);
   the first ``capacity`` in (sample, table, position) order are kept, the rest are *dropped*
   (they contribute nothing and get no gradient) and counted: the step returns the count
   summed over devices, so a drop is never silent. The kept ids of one bag that go to one owner
   share a *slot* (at most ``slots = min(capacity, B * T)`` per destination). An id outside
   its table (other than the padding id -1) goes nowhere and is counted apart (``invalid``).
2. ``all_to_all`` of [R * capacity, 2] int32 (local row, slot) to the owners;
3. the owner gathers its rows and sum-pools them per (source, slot);
4. ``all_to_all`` of the pooled partial sums [R * slots, dim] back; the source adds the partials
   of each bag (a bag spread over several owners gets one partial from each);
5. the dense part runs forward and backward locally (``jax.value_and_grad``);
6. the bag gradients go back to the owners per slot (``all_to_all`` of [R * slots, dim]), the
   owner gives each received id its slot's gradient, sums them per unique row and applies
   row-wise Adagrad (FBGEMM's ``rowwise_adagrad``, DLRM's sparse optimizer) to the touched rows
   only: ``acc[r] += mean(g_r ** 2)``, ``w_r -= lr * g_r / (sqrt(acc[r]) + eps)``;
7. dense gradients and the loss: one ``pmean``; Adagrad on the dense parameters (accumulator
   starting at ``dense_acc_init``).

The collectives come from the module passed as ``coll`` (``strata_jax`` or ``jax.lax``: the
same names and signatures), so both implementations run the same arithmetic on the same
routing; only the bytes' transport differs. The loss is the global mean over R * B samples,
so every gradient equals that of one device holding everything (tests/test_recsys.py checks
this against an unsharded single-device reference).

Nothing here imports strata_jax; jax is imported lazily by the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHARDINGS = ("row", "table")


@dataclass(frozen=True)
class Layout:
    """Where each (table, id) lives: owner device and row in the owner's local shard.

    row sharding: owner ``i % R``, local row ``offset[t] + i // R`` with
    ``offset[t] = sum_{u < t} ceil(rows[u] / R)``. table sharding: owner ``t % R``, local row
    ``offset[t] + i`` with ``offset[t]`` the rows of the earlier tables on the same owner.
    ``rows_per_rank`` is the largest shard; shorter shards are padded with unused rows.
    """

    rows: tuple[int, ...]
    nranks: int
    sharding: str = "row"

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r}: choose from {SHARDINGS}")
        if not self.rows or min(self.rows) < 1:
            raise ValueError(f"every table needs at least one row, got rows={self.rows}")
        if self.nranks < 1:
            raise ValueError(f"nranks must be >= 1, got {self.nranks}")

    @property
    def offsets(self) -> np.ndarray:
        R = self.nranks
        off = np.zeros(len(self.rows), np.int64)
        if self.sharding == "row":
            off[1:] = np.cumsum([math.ceil(n / R) for n in self.rows])[:-1]
        else:
            used = [0] * R
            for t, n in enumerate(self.rows):
                off[t] = used[t % R]
                used[t % R] += n
        return off

    @property
    def rows_per_rank(self) -> int:
        R = self.nranks
        if self.sharding == "row":
            return sum(math.ceil(n / R) for n in self.rows)
        used = [0] * R
        for t, n in enumerate(self.rows):
            used[t % R] += n
        return max(used)

    def place(self, table: Any, ids: Any) -> tuple[Any, Any]:
        """(owner, local row) of ``ids`` of ``table`` (numpy or jax integer arrays, same shape)."""
        R = self.nranks
        off = self.offsets[table] if isinstance(table, np.ndarray) else _jnp_offsets(self)[table]
        if self.sharding == "row":
            return ids % R, off + ids // R
        return table % R + 0 * ids, off + ids

    def shard(self, tables: Sequence[np.ndarray]) -> np.ndarray:
        """Full tables [rows_t, dim] -> the global sharded array [R * rows_per_rank, dim]."""
        dim = tables[0].shape[1]
        out = np.zeros((self.nranks * self.rows_per_rank, dim), tables[0].dtype)
        for t, tab in enumerate(tables):
            owner, local = self.place(np.full(len(tab), t), np.arange(len(tab)))
            out[owner * self.rows_per_rank + local] = tab
        return out

    def unshard(self, sharded: np.ndarray) -> list[np.ndarray]:
        """Inverse of :meth:`shard`."""
        out = []
        for t, n in enumerate(self.rows):
            owner, local = self.place(np.full(n, t), np.arange(n))
            out.append(np.asarray(sharded)[owner * self.rows_per_rank + local])
        return out


def _jnp_offsets(layout: Layout):
    import jax.numpy as jnp

    return jnp.asarray(layout.offsets, jnp.int32)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    rows: tuple[int, ...]  # rows of each embedding table
    dim: int = 64  # embedding width (= bottom MLP output)
    dense_features: int = 13
    bottom: tuple[int, ...] = (128,)  # hidden widths of the bottom MLP (output: dim)
    top: tuple[int, ...] = (256, 128)  # hidden widths of the top MLP (output: 1 logit)

    @property
    def tables(self) -> int:
        return len(self.rows)

    @property
    def interaction_width(self) -> int:
        n = self.tables + 1
        return self.dim + n * (n - 1) // 2


def init_params(cfg: ModelConfig, seed: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Dense MLP parameters and the full (unsharded) tables, float32 numpy, from ``seed``.

    DLRM's initialisation: weights N(0, sqrt(2 / (fan_in + fan_out))), biases N(0, sqrt(1 /
    fan_out)), table rows U(-sqrt(1 / rows), sqrt(1 / rows)). Table t draws from its own
    generator, so the tables do not depend on the device count.
    """
    rng = np.random.default_rng([seed, 0])

    def mlp(widths: Sequence[int]) -> list[dict[str, np.ndarray]]:
        layers = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            w = rng.standard_normal((a, b)) * math.sqrt(2.0 / (a + b))
            bias = rng.standard_normal(b) * math.sqrt(1.0 / b)
            layers.append({"w": w.astype(np.float32), "b": bias.astype(np.float32)})
        return layers

    dense = {
        "bottom": mlp((cfg.dense_features, *cfg.bottom, cfg.dim)),
        "top": mlp((cfg.interaction_width, *cfg.top, 1)),
    }
    tables = []
    for t, n in enumerate(cfg.rows):
        r = np.random.default_rng([seed, 1, t])
        lim = math.sqrt(1.0 / n)
        tables.append(r.uniform(-lim, lim, (n, cfg.dim)).astype(np.float32))
    return dense, tables


def head_logits(dense: dict[str, Any], x: Any, pooled: Any) -> Any:
    """DLRM's dense part: x [B, F] and pooled embeddings [B, T, dim] -> logits [B]."""
    import jax
    import jax.numpy as jnp

    def mlp(layers, h, last_relu: bool):
        for i, p in enumerate(layers):
            h = h @ p["w"] + p["b"]
            if last_relu or i < len(layers) - 1:
                h = jax.nn.relu(h)
        return h

    bot = mlp(dense["bottom"], x, True)
    z = jnp.concatenate([bot[:, None, :], pooled], axis=1)  # [B, T + 1, dim]
    inter = jnp.einsum("bie,bje->bij", z, z)
    iu, ju = np.triu_indices(z.shape[1], k=1)
    feats = jnp.concatenate([bot, inter[:, iu, ju]], axis=-1)
    return mlp(dense["top"], feats, False)[:, 0]


def bce_with_logits(logits: Any, labels: Any) -> Any:
    """Mean binary cross-entropy of sigmoid(logits) against {0, 1} labels (stable form)."""
    import jax
    import jax.numpy as jnp

    return jnp.mean(jax.nn.softplus(logits) - labels * logits)


# --------------------------------------------------------------------------------------------------
# Routing and the training step
# --------------------------------------------------------------------------------------------------


def capacity_for(batch: int, tables: int, mean_bag: float, layout: Layout, factor: float) -> int:
    """Ids per destination: ``ceil(factor * B * mean_bag * tables on the busiest owner)``.

    Row sharding spreads every table over R owners (T / R tables' worth each); table sharding
    gives the busiest owner ``ceil(T / R)`` whole tables.
    """
    R = layout.nranks
    per_dest = tables / R if layout.sharding == "row" else math.ceil(tables / R)
    return max(1, math.ceil(factor * batch * mean_bag * per_dest))


def route(ids: Any, layout: Layout, capacity: int) -> dict[str, Any]:
    """Per-device routing of ids [B, T, L] (any integer dtype, -1 = empty position) to their
    owners.

    An id of table t outside ``[0, rows[t])`` other than -1 (one past the table, a negative
    id, an int64 id past int32's range) is *dropped and counted*, never turned into a row: a
    row-sharded id ``rows[t]`` would otherwise be another table's row (local row
    ``offset[t] + i // R`` is table t + 1's first), a table-sharded one the next table's or a
    padding row. Ids are compared with the table sizes in their own dtype, before any cast.

    Returns ``send`` [R * capacity, 2] int32 (local row, slot; -1 padding), ``slot_bag``
    [R * slots] int32 (the bag b * T + t that each (destination, slot) belongs to; B * T when
    unused), ``slots`` [R] int32 (slots used at each destination: its slots are numbered
    ``0 .. slots[d] - 1``, so ``slot_bag[d * S + s]`` is unused from ``s = slots[d]`` on),
    ``dropped`` (int32 scalar: valid ids beyond a destination's capacity) and
    ``invalid`` (int32 scalar: ids outside their table, other than -1).

    Raises:
      ValueError: ids not a 3-d integer array, a table count other than the layout's, or
        ``capacity < 1``.
    """
    import jax
    import jax.numpy as jnp

    if ids.ndim != 3 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer array [B, T, L], got {ids.dtype}{ids.shape}")
    if ids.shape[1] != len(layout.rows):
        raise ValueError(f"ids has {ids.shape[1]} tables, the layout {len(layout.rows)}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    B, T, L = ids.shape
    R, C = layout.nranks, capacity
    BT = B * T
    S = min(C, BT)
    # In the ids' own dtype: an int64 2**32 + 1 must not wrap to row 1 (nor uint32's
    # 2**32 - 1 to the padding id -1).
    info = jnp.iinfo(ids.dtype)
    last = np.minimum(np.asarray(layout.rows, np.int64) - 1, info.max).astype(ids.dtype)
    inside = ids <= jnp.asarray(last)[None, :, None]
    if info.min < 0:
        inside = inside & (ids >= 0)
        pad = ids == -1
    else:
        pad = jnp.zeros(ids.shape, bool)
    invalid = jnp.sum((~inside & ~pad).astype(jnp.int32))
    flat = jnp.where(inside, ids, 0).reshape(BT, L).astype(jnp.int32)  # row g = b * T + t: bag g
    table = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None], ids.shape)
    valid = inside.reshape(BT, L)
    owner, local = layout.place(table.reshape(BT, L), jnp.where(valid, flat, 0))
    owner = jnp.where(valid, owner, R).astype(jnp.int32)  # R: no destination
    # Position of each id among those its source sends to the same owner, in (bag, position)
    # order, from prefix sums (an argsort of the ids would cost ~10x more on XLA CPU).
    onehot = jax.nn.one_hot(owner, R + 1, dtype=jnp.int32)  # [BT, L, R + 1]
    in_bag = jnp.cumsum(onehot, axis=1) - onehot  # earlier ids of the same bag, per owner
    count = jnp.sum(onehot, axis=1)  # [BT, R + 1]
    before = jnp.cumsum(count, axis=0) - count  # ids of earlier bags, per owner
    pos = jnp.take_along_axis(in_bag + before[:, None, :], owner[..., None], axis=-1)[..., 0]
    kept = valid & (pos < C)
    # Bag g has a slot at owner d if any of its ids to d was kept: slots numbered in bag order.
    has = (count[:, :R] > 0) & (before[:, :R] < C)  # [BT, R]
    slot_of = jnp.cumsum(has.astype(jnp.int32), axis=0) - 1
    slot = jnp.take_along_axis(slot_of, jnp.minimum(owner, R - 1), axis=1)  # [BT, L]
    dest = jnp.where(kept, owner * C + pos, R * C).reshape(-1)
    send = (
        jnp.full((R * C, 2), -1, jnp.int32)
        .at[dest]
        .set(jnp.stack([local.astype(jnp.int32), slot], axis=-1).reshape(-1, 2), mode="drop")
    )
    where = jnp.where(has, jnp.arange(R, dtype=jnp.int32)[None, :] * S + slot_of, R * S)
    bag = jnp.broadcast_to(jnp.arange(BT, dtype=jnp.int32)[:, None], (BT, R))
    slot_bag = (
        jnp.full((R * S,), BT, jnp.int32).at[where.reshape(-1)].set(bag.reshape(-1), mode="drop")
    )
    dropped = jnp.sum(valid.astype(jnp.int32)) - jnp.sum(kept.astype(jnp.int32))
    slots = jnp.sum(has.astype(jnp.int32), axis=0)  # [R]: slots used at each owner (0..n-1)
    return {
        "send": send,
        "slot_bag": slot_bag,
        "slots": slots,
        "dropped": dropped,
        "invalid": invalid,
    }


@dataclass(frozen=True)
class StepConfig:
    capacity: int  # ids per destination per device per step
    lr_sparse: float = 0.05
    lr_dense: float = 0.02
    eps: float = 1e-8
    # Dense Adagrad's initial accumulator (TensorFlow's initial_accumulator_value). With 0, an
    # element whose gradient is round-off noise moves by a full +-lr: the two implementations'
    # pmeans differ in the last bit and their curves would part within ten steps.
    dense_acc_init: float = 0.1
    # The same for the row-wise accumulators: a row whose first gradient is round-off noise
    # (a saturated prediction) would otherwise move by a full lr in a random direction.
    sparse_acc_init: float = 1e-6


EXCHANGES = ("padded", "compact")


def make_train_step(
    cfg: ModelConfig,
    layout: Layout,
    step_cfg: StepConfig,
    axis: str,
    coll: Any,
    exchange: str = "padded",
):
    """The per-device body of one training step, for ``jax.shard_map`` over ``axis``.

    ``body(state, batch) -> (state, (loss, logits, dropped, invalid))`` with
    ``state = (dense, dense_acc, table, table_acc)``: dense parameters and their Adagrad
    accumulators (replicated, ``P()``), the local table shard [rows_per_rank, dim] float32
    and its row-wise accumulator [rows_per_rank] float32 (both ``P(axis)``); ``batch = (x
    [B, F] float32, ids [B, T, L] int32, labels [B] float32)`` (all ``P(axis)``). ``loss`` is
    the global mean (replicated), ``logits`` [B] are this device's predictions *before* the
    update (progressive validation), ``dropped`` the ids dropped for capacity and ``invalid``
    the ids outside their tables (other than -1; dropped too, see :func:`route`), both summed
    over all devices (replicated). ``coll`` is ``strata_jax`` or ``jax.lax``.

    ``exchange``: how the pooled embeddings and their gradients travel. ``"padded"``: a tiled
    ``all_to_all`` of every slot, used or not ([R * S, dim] each way). ``"compact"``: a
    ``ragged_all_to_all`` of the used slots only (source s uses ``slots[d]`` of its S slots at
    owner d, in order: both ends know that count without asking), written into the same
    [R * S, dim] layout; the unused rows are never read (the pooling drops their segment, the
    gradient gather never indexes them), so the values are the padded exchange's bit for
    bit. It needs a ``coll`` with a ``ragged_all_to_all`` that runs on this backend and an
    ``empty`` (strata_jax: XLA:CPU has no ragged-all-to-all, and jax.lax.empty is a zero fill
    there): the forward's output is ``coll.empty``, the backward's the forward's received
    partials (dead by then), so no zero fill is added.

    Raises:
      ValueError: ``exchange`` not in :data:`EXCHANGES`.
    """
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    if exchange not in EXCHANGES:
        raise ValueError(f"exchange {exchange!r}: choose from {EXCHANGES}")
    R, C = layout.nranks, step_cfg.capacity
    rpr = layout.rows_per_rank
    lr_s, lr_d, eps = step_cfg.lr_sparse, step_cfg.lr_dense, step_cfg.eps
    acc0, sacc0 = step_cfg.dense_acc_init, step_cfg.sparse_acc_init

    def loss_fn(dense, pooled, x, labels):
        logits = head_logits(dense, x, pooled)
        return bce_with_logits(logits, labels), logits

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def body(state, batch):
        dense, dense_acc, table, table_acc = state
        x, ids, labels = batch
        B, T, _ = ids.shape
        S = min(C, B * T)
        rt = route(ids, layout, C)

        # -- forward: ids to the owners, pooled partial sums back --------------------------------
        recv = coll.all_to_all(rt["send"], axis, 0, 0, tiled=True)  # [R * C, 2] by source
        rows, rslot = recv[:, 0], recv[:, 1]
        rvalid = rows >= 0
        src = jnp.arange(R * C, dtype=jnp.int32) // C
        seg = jnp.where(rvalid, src * S + rslot, R * S)
        emb = table[jnp.where(rvalid, rows, 0)]
        partial = jax.ops.segment_sum(emb, seg, num_segments=R * S)  # [R * S, dim] by source
        if exchange == "compact":
            # Block s of `partial` holds source s's slots, of which it uses the first
            # `served[s]` (its slots are numbered in order); this device uses rt["slots"][d]
            # at owner d. Each block lands at (sender) * S of the receiver's output.
            me_at = jnp.full((R,), jax.lax.axis_index(axis) * S, jnp.int32)
            starts = jnp.arange(R, dtype=jnp.int32) * S
            served = jnp.max(jnp.where(rvalid, rslot + 1, 0).reshape(R, C), axis=1)
            # unused rows of the output are never read: no zero fill (jax.lax.empty's on CPU)
            back = coll.ragged_all_to_all(
                partial, coll.empty(partial.shape, partial.dtype), starts, served, me_at,
                rt["slots"], axis_name=axis,
            )  # fmt: skip
            slot_bag = rt["slot_bag"]
        else:
            back = coll.all_to_all(partial, axis, 0, 0, tiled=True)  # [R * S, dim] by owner
            slot_bag = rt["slot_bag"]
        pooled = jax.ops.segment_sum(back, slot_bag, num_segments=B * T)
        pooled = pooled.reshape(B, T, -1)

        # -- dense part, data parallel -----------------------------------------------------------
        dense_v = jax.tree.map(lambda a: jax.lax.pcast(a, axis, to="varying"), dense)
        (loss, logits), (g_dense, g_pooled) = grad_fn(dense_v, pooled, x, labels)
        flat, unravel = ravel_pytree((g_dense, loss))
        g_dense, loss = unravel(coll.pmean(flat, axis))
        dense_acc = jax.tree.map(lambda a, g: a + g * g, dense_acc, g_dense)
        dense = jax.tree.map(
            lambda p, g, a: p - lr_d * g / (jnp.sqrt(a + acc0) + eps), dense, g_dense, dense_acc
        )

        # -- backward: bag gradients to the owners per slot; sparse row-wise Adagrad -------------
        g_bags = g_pooled.reshape(B * T, -1) / R  # d(global mean loss) = d(local mean) / R
        used = rt["slot_bag"] < B * T
        g_slots = jnp.where(used[:, None], g_bags[jnp.where(used, rt["slot_bag"], 0)], 0.0)
        if exchange == "compact":  # the used slots only, into `back` (dead by now)
            g_recv = coll.ragged_all_to_all(
                g_slots, back, starts, rt["slots"], me_at, served, axis_name=axis
            )
        else:
            g_recv = coll.all_to_all(g_slots, axis, 0, 0, tiled=True)  # [R * S, dim] by source
        g_ids = jnp.where(rvalid[:, None], g_recv[jnp.where(rvalid, seg, 0)], 0.0)
        # Duplicates of a row: sum their gradients at the row's first place in sorted order
        # (sort + binary search: jnp.unique's argsort costs ~10x more on XLA CPU), then every
        # copy computes the same new row and accumulator and writes it (identical values).
        key = jnp.where(rvalid, rows, rpr)  # rpr: padding, out of range, writes dropped
        first = jnp.searchsorted(jnp.sort(key), key, side="left").astype(jnp.int32)
        g_row = jax.ops.segment_sum(g_ids, first, num_segments=R * C)[first]
        acc = table_acc.at[key].get(mode="fill", fill_value=0.0) + jnp.mean(g_row * g_row, -1)
        table_acc = table_acc.at[key].set(acc, mode="drop")
        new_rows = table.at[key].get(mode="fill", fill_value=0.0) - lr_s * g_row / (
            jnp.sqrt(acc + sacc0)[:, None] + eps
        )
        table = table.at[key].set(new_rows, mode="drop")

        counts = coll.psum(jnp.stack([rt["dropped"], rt["invalid"]]), axis)
        return (dense, dense_acc, table, table_acc), (loss, logits, counts[0], counts[1])

    return body


def make_sharded_step(
    cfg: ModelConfig,
    layout: Layout,
    step_cfg: StepConfig,
    mesh: Any,
    axis: str,
    coll: Any,
    check_vma: bool = True,
    exchange: str = "padded",
):
    """``jax.jit(jax.shard_map(make_train_step(...)))`` with the specs filled in; donates state."""
    import jax
    from jax.sharding import PartitionSpec as P

    body = make_train_step(cfg, layout, step_cfg, axis, coll, exchange)
    rep = P()
    dense_spec = {
        "bottom": [{"w": rep, "b": rep} for _ in range(len(cfg.bottom) + 1)],
        "top": [{"w": rep, "b": rep} for _ in range(len(cfg.top) + 1)],
    }
    state_spec = (dense_spec, dense_spec, P(axis), P(axis))
    batch_spec = (P(axis), P(axis), P(axis))
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(state_spec, batch_spec),
            out_specs=(state_spec, (rep, P(axis), rep, rep)),
            check_vma=check_vma,
        ),
        donate_argnums=0,
    )


def initial_state(
    cfg: ModelConfig, layout: Layout, seed: int, mesh: Any, axis: str
) -> tuple[Any, ...]:
    """Device arrays of the step state from :func:`init_params`, placed on ``mesh``.

    Works under several processes: each process fills only its addressable shards.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    dense_np, tables = init_params(cfg, seed)
    table_np = layout.shard(tables)

    def put(a: np.ndarray, spec: Any) -> Any:
        return jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, spec), lambda idx, a=a: a[idx]
        )

    dense = jax.tree.map(lambda a: put(a, P()), dense_np)
    dense_acc = jax.tree.map(lambda a: put(np.zeros_like(a), P()), dense_np)
    table = put(table_np, P(axis))
    table_acc = put(np.zeros(table_np.shape[0], np.float32), P(axis))
    return dense, dense_acc, table, table_acc


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


class SyntheticClicks:
    """A click log from a hidden logistic model, reproducible per (seed, step, device).

    Ids of table t follow a bounded Zipf law over its rows (``P(rank k) ~ (k + 1) ** -a``),
    mapped through a fixed random permutation (ids are hashes, so hot ids land on random
    owners); bag sizes are uniform in [min_bag, max_bag]; dense features are N(0, 1). The label
    is Bernoulli(sigmoid(x . v + sum_t mean of w_t over the bag + b)) with hidden v, w_t ~ N(0,
    1), so a model that learns the hot ids' weights raises AUC above 0.5.
    """

    def __init__(
        self,
        rows: Sequence[int],
        dense_features: int,
        min_bag: int,
        max_bag: int,
        zipf: float,
        seed: int,
    ) -> None:
        if not 0 <= min_bag <= max_bag or max_bag < 1:
            raise ValueError(f"need 0 <= min_bag <= max_bag, max_bag >= 1: {min_bag}, {max_bag}")
        rng = np.random.default_rng([seed, 2])
        self.rows = tuple(rows)
        self.min_bag, self.max_bag = min_bag, max_bag
        self.seed = seed
        self.cdfs, self.perms, self.weights = [], [], []
        for n in self.rows:
            p = np.arange(1, n + 1, dtype=np.float64) ** -zipf
            self.cdfs.append(np.cumsum(p) / p.sum())
            self.perms.append(rng.permutation(n).astype(np.int32))
            self.weights.append(rng.standard_normal(n).astype(np.float32))
        self.v = (rng.standard_normal(dense_features) / math.sqrt(dense_features)).astype(
            np.float32
        )
        self.dense_features = dense_features

    @property
    def mean_bag(self) -> float:
        return (self.min_bag + self.max_bag) / 2

    @property
    def max_ids(self) -> int:
        return self.max_bag

    def batch(self, step: int, shard: int, size: int) -> tuple[np.ndarray, ...]:
        """(x [size, F] float32, ids [size, T, max_bag] int32 (-1 padded), labels [size])."""
        rng = np.random.default_rng([self.seed, 3, step, shard])
        T, L = len(self.rows), self.max_bag
        x = rng.standard_normal((size, self.dense_features)).astype(np.float32)
        sizes = rng.integers(self.min_bag, self.max_bag + 1, (size, T))
        ids = np.empty((size, T, L), np.int32)
        logit = x @ self.v
        present = np.arange(L)[None, :] < sizes[:, :, None]  # [size, T, L]
        for t in range(T):
            u = rng.random((size, L))
            k = np.minimum(np.searchsorted(self.cdfs[t], u), self.rows[t] - 1)
            i = self.perms[t][k]
            m = present[:, t]
            w = np.where(m, self.weights[t][i], 0.0).sum(1) / np.maximum(sizes[:, t], 1)
            logit = logit + w
            ids[:, t] = np.where(m, i, -1)
        labels = (rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return x, ids, labels


class CriteoTSV:
    """Criteo-format click log: ``label \\t 13 integers \\t 26 hex categoricals`` per line.

    Integers become ``log(1 + max(v, 0))`` (missing: 0), categoricals ``int(hex) % rows[t]``
    (missing: an empty bag), one id per bag. Reads at most ``limit`` lines; batches cycle over
    what was read, samples laid out as global batch ``step``, device ``shard``.
    """

    DENSE, CATS = 13, 26

    def __init__(self, path: Path, rows: Sequence[int], limit: int, global_batch: int) -> None:
        if len(rows) != self.CATS:
            raise ValueError(f"Criteo has {self.CATS} categorical columns, got {len(rows)} tables")
        xs, ids, labels = [], [], []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if len(labels) >= limit:
                    break
                cols = line.rstrip("\n").split("\t")
                if len(cols) != 1 + self.DENSE + self.CATS:
                    raise ValueError(
                        f"{path}:{lineno}: {len(cols)} tab-separated columns, expected "
                        f"{1 + self.DENSE + self.CATS} (label, 13 integers, 26 categoricals)"
                    )
                labels.append(float(cols[0]))
                xs.append([math.log1p(max(int(v), 0)) if v else 0.0 for v in cols[1:14]])
                ids.append(
                    [int(v, 16) % n if v else -1 for v, n in zip(cols[14:], rows, strict=True)]
                )
        if not labels:
            raise ValueError(f"{path}: no samples")
        self.x = np.asarray(xs, np.float32)
        self.ids = np.asarray(ids, np.int32)[:, :, None]
        self.labels = np.asarray(labels, np.float32)
        self.global_batch = global_batch
        self.dense_features = self.DENSE
        self.mean_bag = float((self.ids >= 0).mean())
        self.max_ids = 1

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, step: int, shard: int, size: int) -> tuple[np.ndarray, ...]:
        start = step * self.global_batch + shard * size
        idx = (start + np.arange(size)) % len(self.labels)
        return self.x[idx], self.ids[idx], self.labels[idx]


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); nan if one class."""
    labels = np.asarray(labels).ravel() > 0.5
    scores = np.asarray(scores, np.float64).ravel()
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(s.size)
    # average rank over runs of equal scores
    edges = np.flatnonzero(np.diff(s)) + 1
    lo = np.concatenate([[0], edges])
    hi = np.concatenate([edges, [s.size]])
    avg = (lo + hi + 1) / 2.0
    ranks[order] = np.repeat(avg, hi - lo)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))
