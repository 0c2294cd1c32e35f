"""Recommendation training (DLRM) with sharded embedding tables, strata against XLA, side by side.

The paper's third production workload. A DLRM (bottom MLP, sum-pooled embedding bags, pairwise
dot interaction, top MLP, sigmoid + binary cross-entropy; Naumov et al. 2019) is trained with
its embedding tables row-sharded (``--sharding table``: table-wise) over one mesh axis and its
MLPs data parallel. Every step sends each sample's ids to the devices that own their rows with
``all_to_all``, pools on the owner, brings the pooled embeddings back with ``all_to_all``, sends
the embedding gradients the reverse way and updates only the touched rows (row-wise Adagrad);
dense gradients are averaged with ``pmean``. The step itself is ``benchmarks/recsys_model.py``
(tests/test_recsys.py checks it against an unsharded single-device reference). The same model,
seed and batches run once per ``--impl``:

* ``strata``: ``strata_jax.all_to_all``, ``strata_jax.pmean``, ``strata_jax.psum``;
* ``xla``: ``jax.lax.all_to_all``, ``jax.lax.pmean``, ``jax.lax.psum``;
* ``nocomm``: ``xla``'s computation with every exchange replaced by identity
  (``_nocomm.no_exchange``): wrong losses by design, never compared; its step time is the bound
  that no faster exchange can beat at these sizes;
* ``meet``: ``nocomm`` whose exchanges still make the ranks meet (a 1-element strata psum each,
  forward and backward: ``_nocomm.no_exchange(meet=True)``): with it the communication lines
  split the exchange time into waiting for the slowest rank and moving the bytes.

Run (8 in-process CPU devices)::

    python benchmarks/train_recsys.py                       # strata vs xla, defaults
    python benchmarks/train_recsys.py --data day_0.tsv      # a Criteo-format TSV
    python -m strata_jax.launch -n 4 benchmarks/train_recsys.py   # one device per process

The implementations are stepped in turns (step i of each, then step i+1 of each: the machine
drifts, and this cancels the drift out of the ratio), every step is jitted whole and blocked
until done; the table reports the median step time after ``--warmup`` steps. The exchanges are
capacity-padded per destination (``--capacity-factor``, or ``--capacity`` ids); ids beyond a
destination's capacity are dropped and the drops are counted every step and reported (both
implementations drop the same ids: the routing is shared). Loss curves must agree as
train_moe.py's do (``_report.compare_loss_curves``: ``--tol-first``, 1e-5, over the first
``--tol-steps``, 10; ``--tol-rel``, 1% of the loss, for the ``--tol-window`` (20) step moving
means over every step; the all_to_alls are exact, only the pmeans' summation orders may differ)
and the drops must be equal; the script exits 1 otherwise. In one process the two curves came
out bitwise equal on this machine; across processes ``jax.lax.pmean`` runs over gloo, whose
summation order differs from strata's in the last bit, and training grows that (the script says
from which step on the curves differ by more than 1e-6).

Data: by default a synthetic click log (fixed seed): ids per table from a bounded Zipf law
(``--zipf``), bags of ``--min-bag``..``--max-bag`` ids, labels from a hidden logistic model, so
AUC rises above 0.5 as the model learns the hot ids. ``--data FILE`` reads a Criteo TSV (label,
13 integers, 26 hex categoricals; one table per categorical, ids hashed modulo ``--rows``).
Loss and AUC are printed every ``--eval-every`` steps; the AUC is progressive validation: the
predictions each step made on its batch *before* training on it, over the last window.

Output: progress bar (tqdm), a table, ``<out>/train_recsys.png`` (loss curves, matplotlib
Agg) and ``<out>/train_recsys.json`` (all numbers and the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recsys_model as rm  # noqa: E402
from _args import (  # noqa: E402
    add_loss_tolerance_args,
    add_preset,
    impl_list,
    parse_list,
    preset_line,
)
from _machine import print_header  # noqa: E402
from _nocomm import no_exchange  # noqa: E402
from _report import (  # noqa: E402
    Table,
    args_record,
    bound_sentence,
    communication_share,
    compare_loss_curves,
    loss_curves_sentence,
    progress,
    speed_sentence,
    write_results,
)
from _timing import align_processes, slowest_process  # noqa: E402
from train_moe import start_runtime  # noqa: E402

IMPLS = ("strata", "xla", "nocomm", "meet", "strata_padded", "strata_compact")
FREE = ("nocomm", "meet")  # xla's computation, no bytes exchanged

# Configurations by name (--preset): the values become argparse defaults. "paper": the paper's
# regime, where the jax.lax (xla) step spends 30-45% of its time exchanging (against nocomm),
# measured on the 2-core machine of docs/performance.md; picked by that share alone.
PRESETS = {
    "paper": {
        # the share falls with the bag size (pooling work per exchanged row) and, over gloo,
        # the batch; in one process the default model's share read 33-36% in two runs at load
        # ~15 but 10-12% in two at load ~12, dim 128 with bags of 1..10 36%
        "one_process": {"dim": 128, "max_bag": 10, "batch": 256, "steps": 40},
        "launch": {"dim": 256, "max_bag": 10, "batch": 256, "steps": 40},
    }
}
PRESET_WHY = (
    "paper: the paper's regime, where the jax.lax (xla) step spends 30-45%% of its time "
    "exchanging (against nocomm). Measured on the 2-core machine of docs/performance.md: "
    "30-31%% in one process, 34-39%% under strata_jax.launch -n 4 (the share moves with the "
    "machine's load by 10 points and more). Each placement has its own configuration."
)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in parse_list(text) if v) if text else ()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--impl",
        default="strata,xla,nocomm",
        help=f"comma list of {IMPLS}; with all three the communication share of xla's step and "
        "the part of it strata removes are printed (add meet to split it into waiting for the "
        "slowest rank and moving bytes)",
    )
    g.add_argument(
        "--devices",
        type=int,
        default=8,
        help="in-process CPU devices (per process under strata_jax.launch: from the launcher)",
    )
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    g.add_argument("--eval-every", type=int, default=10, help="loss/AUC line every N steps")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--no-check-vma", dest="check_vma", action="store_false", help="shard_map(check_vma=False)"
    )
    g.add_argument(
        "--strata-exchange",
        choices=rm.EXCHANGES,
        default="compact",
        help="how strata moves the pooled embeddings and their gradients (recsys_model."
        "make_train_step): padded = all_to_all of every slot, as jax.lax does; compact = "
        "ragged_all_to_all of the used slots only. --impl strata_padded (strata_compact) runs "
        "that form beside it, in the same turns",
    )
    add_loss_tolerance_args(g)
    g.add_argument("--out", type=Path, default=Path("bench_out"))
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", type=Path, default=None, help="Criteo-format TSV (default: synthetic Zipf log)"
    )
    g.add_argument("--batch", type=int, default=256, help="samples per device per step")
    g.add_argument("--min-bag", type=int, default=1, help="fewest ids per bag (synthetic)")
    g.add_argument("--max-bag", type=int, default=20, help="most ids per bag (synthetic)")
    g.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    g = p.add_argument_group("model")
    g.add_argument("--tables", type=int, default=8, help="embedding tables (Criteo: 26)")
    g.add_argument(
        "--rows",
        default="100000",
        help="rows per table: one number for all, or a comma list (one per table)",
    )
    g.add_argument("--dim", type=int, default=64, help="embedding width")
    g.add_argument("--bottom", default="128", help="bottom MLP hidden widths (comma list)")
    g.add_argument("--top", default="256,128", help="top MLP hidden widths (comma list)")
    g.add_argument("--sharding", choices=rm.SHARDINGS, default="row")
    g.add_argument(
        "--capacity-factor",
        type=float,
        default=1.5,
        help="ids per destination = ceil(f * batch * mean bag * tables per owner)",
    )
    g.add_argument(
        "--capacity", type=int, default=None, help="ids per destination (overrides the factor)"
    )
    g = p.add_argument_group("optimizer (Adagrad; row-wise on the tables)")
    g.add_argument("--lr-sparse", type=float, default=0.01)
    g.add_argument("--lr-dense", type=float, default=0.1)
    g.add_argument(
        "--dense-acc-init", type=float, default=0.1, help="dense Adagrad's initial accumulator"
    )
    g.add_argument(
        "--sparse-acc-init", type=float, default=1e-6, help="row-wise Adagrad's initial accumulator"
    )
    add_preset(p, PRESETS, argv, PRESET_WHY)
    args = p.parse_args(argv)
    args.impls = impl_list(p, args.impl, IMPLS)
    for name in ("batch", "eval_every", "dim", "tables"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.capacity is not None and args.capacity < 1:
        p.error("--capacity must be >= 1")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.data is not None:
        args.tables = rm.CriteoTSV.CATS
        args.max_bag = 1
    rows = _ints(args.rows)
    if len(rows) == 1:
        rows = rows * args.tables
    if len(rows) != args.tables:
        p.error(f"--rows: {len(rows)} values for {args.tables} tables")
    args.rows_t = rows
    return args


_OP_COUNTERS = ("calls", "bytes", "total_s", "wait_s", "move_s")


def _add_ops(into: dict[str, dict[str, float]], before: dict, after: dict) -> None:
    """Adds what ``comm_stats()["ops"]`` counted between ``before`` and ``after`` (one turn of
    one implementation) to ``into``: the counters are the process's, shared by every strata
    implementation that runs (``strata_padded`` beside ``strata``)."""
    for name, o in after.items():
        b = before.get(name, {})
        acc = into.setdefault(name, dict.fromkeys(_OP_COUNTERS, 0.0))
        for k in _OP_COUNTERS:
            acc[k] += o[k] - b.get(k, 0)


def _strata_ops(ops: dict[str, dict[str, float]], jax: Any, args: argparse.Namespace) -> dict:
    """Where strata's step spends its time in collectives: ``comm_stats()["ops"]`` over the
    timed steps of ``--impl strata`` alone (``ops``, summed by :func:`_add_ops`), per device
    per step (this process's devices): calls, milliseconds in the handler, of which ``wait``
    (until every peer had arrived) and ``move`` (the copy and the departure barrier), and MB of
    input. Returns the numbers and their ``#`` lines."""
    steps = max(1, args.steps - args.warmup) * jax.local_device_count()
    out: dict[str, Any] = {}
    parts = []
    for name, o in sorted(ops.items()):
        d = {
            "calls": o["calls"] / steps,
            "total_ms": 1e3 * o["total_s"] / steps,
            "wait_ms": 1e3 * o["wait_s"] / steps,
            "move_ms": 1e3 * o["move_s"] / steps,
            "mb": o["bytes"] / steps / 1e6,
        }
        out[name] = d
        parts.append(
            f"{name} {d['calls']:g} calls {d['total_ms']:.1f} ms (wait {d['wait_ms']:.1f}, "
            f"move {d['move_ms']:.1f}), {d['mb']:.2f} MB in"
        )
    if parts:
        out["lines"] = [
            "# strata's collectives, per device per timed step (this process; comm_stats()"
            "['ops']; wait: until the last peer arrived, and on the pairs path of a large "
            "all_to_all the copies made meanwhile; move: the copy and the departure): "
            + "; ".join(parts)
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strata_jax, jax = start_runtime(args)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    axis = "x"
    mesh = Mesh(np.array(jax.devices()), (axis,))
    R = mesh.shape[axis]
    B = args.batch
    global_batch = B * R
    # The compact exchange is strata_jax.ragged_all_to_all, which does not cross fabrics (hosts)
    # yet: across hosts strata exchanges the padded slots with all_to_all, and says so.
    hosts = len(strata_jax.topology()["fabrics"])
    if hosts > 1 and "strata_compact" in args.impls:
        sys.exit(
            f"error: --impl strata_compact: the compact exchange (ragged_all_to_all) does not "
            f"run across the {hosts} fabrics (hosts) of this job yet; use strata_padded"
        )
    if hosts > 1 and args.strata_exchange == "compact":
        args.strata_exchange = "padded"
        say(
            f"# exchange   : the {hosts} fabrics (hosts) of this job: strata's pooled embeddings "
            "and gradients go as padded all_to_all (the compact exchange, ragged_all_to_all, "
            "does not cross hosts yet)"
        )

    # ---- data ----------------------------------------------------------------------------------
    if args.data is None:
        data: Any = rm.SyntheticClicks(
            args.rows_t, 13, args.min_bag, args.max_bag, args.zipf, args.seed
        )
        data_name = (
            f"synthetic click log: Zipf({args.zipf}) ids, bags of {args.min_bag}..{args.max_bag} "
            f"ids, labels from a hidden logistic model, seed {args.seed}"
        )
    else:
        data = rm.CriteoTSV(args.data, args.rows_t, args.steps * global_batch, global_batch)
        data_name = f"{args.data} (Criteo TSV), {len(data):,} samples read"

    cfg = rm.ModelConfig(
        rows=args.rows_t,
        dim=args.dim,
        dense_features=data.dense_features,
        bottom=_ints(args.bottom),
        top=_ints(args.top),
    )
    layout = rm.Layout(cfg.rows, R, args.sharding)
    capacity = (
        args.capacity
        if args.capacity is not None
        else rm.capacity_for(B, cfg.tables, data.mean_bag, layout, args.capacity_factor)
    )
    sc = rm.StepConfig(
        capacity=capacity,
        lr_sparse=args.lr_sparse,
        lr_dense=args.lr_dense,
        dense_acc_init=args.dense_acc_init,
        sparse_acc_init=args.sparse_acc_init,
    )
    slots = min(capacity, B * cfg.tables)

    info = print_header(say, preset_line(args, PRESETS))
    dense_np, _ = rm.init_params(cfg, args.seed)
    n_dense = sum(a.size for a in jax.tree.leaves(dense_np))
    n_emb = sum(cfg.rows) * cfg.dim
    say(f"# data       : {data_name}")
    say(
        f"# model      : DLRM, {cfg.tables} tables x {cfg.dim} "
        f"({'rows ' + str(cfg.rows[0]) if len(set(cfg.rows)) == 1 else 'rows ' + str(cfg.rows)}"
        f"), bottom MLP {cfg.dense_features}-{'-'.join(map(str, cfg.bottom))}-{cfg.dim}, dot "
        f"interaction, top MLP {cfg.interaction_width}-{'-'.join(map(str, cfg.top))}-1; "
        f"{n_emb:,} embedding + {n_dense:,} dense params (float32)"
    )
    say(
        f"# parallelism: {R} devices on axis '{axis}' ({jax.process_count()} process(es)): "
        f"tables {args.sharding}-sharded ({layout.rows_per_rank:,} rows per device), MLPs data "
        f"parallel ({B} samples per device, {global_batch:,} per step)"
    )
    say(
        f"# exchange   : per device and step, all_to_all of [{R} x {capacity}, 2] int32 ids "
        f"(capacity {capacity} ids per destination), of [{R} x {slots}, {cfg.dim}] f32 pooled "
        f"embeddings back, of the same gradients forward again; pmean of "
        f"{n_dense + 1:,} f32 (dense grads + loss)"
        + (
            "; strata's pooled embeddings and gradients: ragged_all_to_all of the used slots only"
            " (--strata-exchange compact)"
            if args.strata_exchange == "compact"
            else ""
        )
    )
    say(
        f"# training   : {args.steps} steps, Adagrad (row-wise on tables, lr {args.lr_sparse}; "
        f"dense lr {args.lr_dense}), seed {args.seed}, check_vma={args.check_vma}"
    )

    shard = NamedSharding(mesh, P(axis))
    local_devs = [
        (i, d) for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()
    ]

    def put_batch(step: int):
        """This process's devices' samples of global batch ``step`` as global arrays."""
        parts = {i: data.batch(step, i, B) for i, _ in local_devs}
        arrays = []
        for k in range(3):
            shape = (global_batch, *parts[local_devs[0][0]][k].shape[1:])
            bufs = [jax.device_put(parts[i][k], d) for i, d in local_devs]
            arrays.append(jax.make_array_from_single_device_arrays(shape, shard, bufs))
        return tuple(arrays), {i: parts[i][2] for i, _ in local_devs}

    runs: dict[str, dict[str, Any]] = {}
    batch0, _ = put_batch(0)
    for impl in args.impls:
        coll = strata_jax if impl.startswith("strata") else jax.lax
        # nocomm: an identity pmean leaves the dense gradients unreplicated as far as the
        # shard_map type checker knows
        check_vma = args.check_vma and impl not in FREE
        # strata: --strata-exchange; strata_<exchange>: that one beside it (A/B in one run)
        exchange = (
            args.strata_exchange
            if impl == "strata"
            else impl.removeprefix("strata_")
            if impl.startswith("strata_")
            else "padded"
        )
        fn = rm.make_sharded_step(cfg, layout, sc, mesh, axis, coll, check_vma, exchange)
        state = rm.initial_state(cfg, layout, args.seed, mesh, axis)
        t0 = time.perf_counter()
        with no_exchange(meet=impl == "meet") if impl in FREE else contextlib.nullcontext():
            compiled = fn.lower(state, batch0).compile()
        runs[impl] = {
            "fn": compiled,
            "state": state,
            "losses": [],
            "times": [],
            "cpu": [],
            "drops": [],
            "invalid": [],
            "scores": [],
            "auc": [],
            "compile_s": time.perf_counter() - t0,
        }
        name = {"xla": "jax.lax", "nocomm": "no-op", "meet": "meeting"}.get(impl, "strata_jax")
        a2a = {
            "padded": f"{name}.all_to_all x3",
            "compact": f"{name}.all_to_all, {name}.ragged_all_to_all x2",
        }[exchange]
        say(
            f"# {impl:<10} : compiled in {runs[impl]['compile_s']:.1f} s ({a2a}, "
            f"{name}.pmean, {name}.psum)"
        )

    labels_window: list[np.ndarray] = []
    strata_turns: dict[str, dict[str, float]] = {}  # _add_ops
    bar = progress(args.steps, desc="train", enable=args.progress and lead)
    t_start = time.perf_counter()
    for i in range(args.steps):
        if i == args.warmup:  # strata's per-operator counters: the timed steps only
            strata_jax.reset_stats()
        batch, labels = put_batch(i)
        labels_window.append(np.concatenate([labels[k] for k, _ in local_devs]))
        for k, r in runs.items():
            align_processes("train_recsys")  # several processes: start each step together
            # strata's counters over its own timed turns (not strata_padded's beside it)
            ops0 = strata_jax.comm_stats()["ops"] if k == "strata" and i >= args.warmup else None
            t0, c0 = time.perf_counter(), time.process_time()
            r["state"], (loss, logits, dropped, invalid) = r["fn"](r["state"], batch)
            jax.block_until_ready((r["state"], loss, logits, dropped, invalid))
            r["times"].append(time.perf_counter() - t0)
            r["cpu"].append(time.process_time() - c0)
            if ops0 is not None:
                _add_ops(strata_turns, ops0, strata_jax.comm_stats()["ops"])
            r["losses"].append(float(np.asarray(loss.addressable_data(0))))
            r["drops"].append(int(np.asarray(dropped.addressable_data(0))))
            r["invalid"].append(int(np.asarray(invalid.addressable_data(0))))
            r["scores"].append(np.concatenate([np.asarray(s.data) for s in _in_order(logits)]))
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            y = multihost_utils.process_allgather(np.concatenate(labels_window)).ravel()
            parts = []
            for k, r in runs.items():
                s = multihost_utils.process_allgather(np.concatenate(r["scores"])).ravel()
                r["auc"].append((i + 1, rm.auc(y, s)))
                r["scores"] = []
                window = r["losses"][-len(labels_window) :]
                parts.append(
                    f"{k} loss {np.mean(window):.4f} AUC {r['auc'][-1][1]:.4f} "
                    f"drops {sum(r['drops'][-len(labels_window) :])}"
                )
            labels_window = []
            if lead:
                bar.write(f"  step {i + 1:>5}: " + " | ".join(parts) + "  (means over the window)")
        bar.set_postfix_str(" ".join(f"{k} {r['losses'][-1]:.4f}" for k, r in runs.items()))
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - t_start

    # ---- results -------------------------------------------------------------------------------
    base = "xla" if "xla" in runs else None
    table = Table.of(
        "impl 8 | steps 6 | first loss 10 .4f | final loss 10 .4f | final AUC 9 .4f | drops 8 | "
        "samples/s 10 ,.0f | median ms 10 .1f | p10 ms 8 .1f | p90 ms 8 .1f | cpu ms 8 .1f | "
        "compile s 9 .1f | xla/this 8 .2f"
    )
    rows = []
    for impl, r in runs.items():
        r["times"] = slowest_process(r["times"])  # several processes: the slowest one's
        t = np.array(r["times"][args.warmup :])
        r["median_s"] = float(np.median(t))
        r["cpu_s"] = float(np.median(r["cpu"][args.warmup :]))
        p10, p90 = (float(v) for v in np.percentile(t, [10, 90]))
        rows.append(
            {
                "impl": impl,
                "steps": args.steps,
                "first_loss": r["losses"][0],
                "final_loss": r["losses"][-1],
                "final_auc": r["auc"][-1][1],
                "drops": sum(r["drops"]),
                "samples_per_s": global_batch / r["median_s"],
                "median_step_s": r["median_s"],
                "p10_step_s": p10,
                "p90_step_s": p90,
                "cpu_step_s": r["cpu_s"],
                "compile_s": r["compile_s"],
            }
        )
    for row in rows:
        row["xla_over_this"] = runs[base]["median_s"] / row["median_step_s"] if base else None
    total_ids = sum(int((data.batch(0, d, B)[1] >= 0).sum()) for d in range(min(R, 2))) / min(R, 2)
    say("")
    say(
        f"# step time: median of steps {args.warmup}..{args.steps - 1}, each jitted whole and "
        f"blocked; implementations stepped in turns; wall {wall:.0f} s. xla/this = xla's median "
        f"step time / this one's (above 1: faster than xla); cpu ms: median CPU time of this "
        "process (all its threads) per step, which other jobs on the machine do not inflate"
    )
    for line in table.header_lines():
        say(line)
    for row in rows:
        say(
            table.row(
                [
                    row[k]
                    for k in (
                        "impl",
                        "steps",
                        "first_loss",
                        "final_loss",
                        "final_auc",
                        "drops",
                        "samples_per_s",
                    )
                ]
                + [
                    1e3 * row["median_step_s"],
                    1e3 * row["p10_step_s"],
                    1e3 * row["p90_step_s"],
                    1e3 * row["cpu_step_s"],
                    row["compile_s"],
                    row["xla_over_this"],
                ]
            )
        )

    ok = True
    compared = [i for i in args.impls if i not in FREE]  # nocomm, meet: wrong values by design
    drops = runs[(compared or args.impls)[0]]["drops"]
    say(
        f"# drops: {sum(drops):,} ids dropped over {args.steps} steps (about {total_ids:,.0f} ids "
        f"per device per step; capacity {capacity} per destination)"
        + ("" if sum(drops) == 0 else ": raise --capacity-factor to drop none")
    )
    invalid = runs[(compared or args.impls)[0]]["invalid"]
    if sum(invalid):
        say(
            f"# invalid ids: {sum(invalid):,} ids outside their tables (other than -1) dropped "
            f"over {args.steps} steps: the data holds ids past its tables' --rows"
        )
    diffs = {}
    # Every other implementation against the first (xla when it runs).
    ref = base if base else (compared[0] if compared else None)
    for a in [i for i in compared if i != ref]:
        b = ref
        c = compare_loss_curves(
            runs[a]["losses"],
            runs[b]["losses"],
            args.tol_steps,
            args.tol_first,
            args.tol_rel,
            args.tol_window,
        )
        d = np.abs(np.array(runs[a]["losses"]) - np.array(runs[b]["losses"]))
        same_drops = runs[a]["drops"] == runs[b]["drops"]
        good = c["ok"] and same_drops
        ok &= good
        apart = np.flatnonzero(d > 1e-6)
        first_apart = int(apart[0]) if apart.size else None
        diffs[a] = {k: v for k, v in c.items() if k != "ok"}
        diffs[a].update({"first_step_over_1e-6": first_apart, "same_drops": same_drops})
        say(
            f"{loss_curves_sentence(a, b, c)}; "
            + ("bitwise equal" if d.max() == 0 else f"first above 1e-6 at step {first_apart}")
            + f"; drops per step {'equal' if same_drops else 'DIFFER'}"
            + f": {'OK' if good else 'FAILED'}"
        )
    if diffs and set(diffs) == {"strata"}:
        diffs = diffs["strata"]  # the JSON's earlier form when only strata is compared
    if "strata" in runs and base:
        say(speed_sentence("strata", runs["strata"]["median_s"], base, runs[base]["median_s"]))
    for other in [i for i in runs if i.startswith("strata_")]:
        if "strata" not in runs:
            break
        t_c, t_p = runs["strata"]["median_s"], runs[other]["median_s"]
        c_c, c_p = runs["strata"]["cpu_s"], runs[other]["cpu_s"]
        say(
            f"# A/B: strata ({args.strata_exchange}) {1e3 * t_c:.1f} ms vs {other} "
            f"{1e3 * t_p:.1f} ms median step ({t_p / t_c:.2f}x), CPU {1e3 * c_c:.1f} vs "
            f"{1e3 * c_p:.1f} ms"
        )
    if "nocomm" in runs and base:
        say(bound_sentence(runs["nocomm"]["median_s"], base, runs[base]["median_s"]))
    communication = None
    if base and {"strata", "nocomm"} <= set(runs):
        lines, communication = communication_share(
            runs[base]["median_s"], runs["strata"]["median_s"], runs["nocomm"]["median_s"], base,
            t_meet=runs["meet"]["median_s"] if "meet" in runs else None,
        )  # fmt: skip
        for line in lines:
            say(line)
        # The same in CPU time: on a loaded machine the wall-clock gap is mostly waiting for the
        # 8 device threads to be scheduled at each collective's two barriers, not work.
        cpu_lines, communication["cpu"] = communication_share(
            runs[base]["cpu_s"], runs["strata"]["cpu_s"], runs["nocomm"]["cpu_s"], base,
            "step's CPU time", runs["meet"]["cpu_s"] if "meet" in runs else None,
        )  # fmt: skip
        for line in cpu_lines:
            say(line)

    strata_ops = _strata_ops(strata_turns, jax, args) if "strata" in runs else {}
    for line in strata_ops.pop("lines", []):
        say(line)

    if lead:
        record = {
            "args": args_record(args),
            "machine": info,
            "data": data_name,
            "capacity": capacity,
            "results": rows,
            "loss_diff": diffs,
            "communication": communication,
            "strata_ops": strata_ops,
            "losses": {k: r["losses"] for k, r in runs.items()},
            "auc": {k: r["auc"] for k, r in runs.items()},
            "drops": {k: r["drops"] for k, r in runs.items()},
            "invalid_ids": {k: r["invalid"] for k, r in runs.items()},
            "step_times_s": {k: r["times"] for k, r in runs.items()},
            "step_cpu_s": {k: r["cpu"] for k, r in runs.items()},
        }
        write_results(args.out, "train_recsys", record, say, lambda plt: _plot(plt, runs))
    return 0 if ok else 1


def _in_order(arr: Any) -> list[Any]:
    """This process's shards of a P(axis) array, in mesh (global index) order."""
    return sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)


def _plot(plt: Any, runs: dict[str, dict[str, Any]]) -> Any:
    """Loss per step and AUC per window of every impl."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (k, r), style in zip(runs.items(), ("-", "--"), strict=False):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=k, lw=1.2)
        xs, ys = zip(*r["auc"], strict=True) if r["auc"] else ((), ())
        ax2.plot(xs, ys, style, marker="o", markersize=3, label=k, lw=1.2)
    ax.set(xlabel="step", ylabel="loss (binary cross-entropy, nats)", title="training loss")
    ax2.set(xlabel="step", ylabel="AUC (progressive, per window)", title="AUC")
    return fig


if __name__ == "__main__":
    sys.exit(main())
