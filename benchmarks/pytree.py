"""A pytree's all-reduce: strata_jax.psum/pmean of many leaves against jax.lax, side by side.

A gradient is a pytree: data-parallel training all-reduces every parameter's gradient each step,
often hundreds of leaves of a few KiB to a few MiB. XLA's all-reduce combiner turns the leaves
of one ``jax.lax.psum`` into one all-reduce; strata makes the whole pytree one custom call with
one operand per leaf and one rendezvous (``strata_all_reduce_list``: one-shot or two-shot by the
total bytes, the leaves laid end to end and split evenly across the ranks). This script measures
that call for pytrees of ``--leaves`` leaves (default 1, 8, 64, 256) holding ``--total`` bytes per
device in all (default 1 MiB: 256 leaves are 4 KiB each), with leaf shapes of rank 0 to 3 mixed
(the sizes differ by up to 2x around the mean; the last leaf takes the rest), against
``jax.lax`` on the same inputs. A third column, ``lax@strata``, is unchanged ``jax.lax`` code
compiled inside ``strata_jax.use_for_jax_lax()``: JAX binds one psum per leaf, and strata's
all-reduce combiner makes them one call (``STRATA_COMBINE_BYTES``; the column shows what
existing code gets); ``1/leaf`` is the same compiled with ``STRATA_COMBINE_BYTES=0`` (one strata
call per leaf, as before the combiner).

Run::

    python benchmarks/pytree.py                         # 8 in-process CPU devices
    python benchmarks/pytree.py --leaves 256 --op pmean --dtype bfloat16
    python benchmarks/pytree.py --procs 4               # 4 processes x 1 device; jax.lax over gloo

Each step is ``jax.jit(jax.shard_map(lambda t: op(t, 'x'), ...))`` on fresh random inputs,
compiled once (``lower().compile()``; lax@strata inside ``use_for_jax_lax()``). The
implementations are called in turns (call i of each, then call i+1 of each: the machine is shared
and drifts, and this cancels the drift out of the ratio), every call blocked until done; the table
gives the median after ``--warmup`` calls. Strata's outputs must be bitwise equal to the ranks'
inputs folded in rank order by numpy (the script exits 1 otherwise); jax.lax's largest difference
from that fold is reported (0 in one process, where XLA CPU also sums in rank order; gloo sums in
ring order); lax@strata must be bitwise equal to the fold too. The header prints the load
average before and after; ``calls`` is the number of strata all-reduce calls (strata,
lax@strata) or XLA all-reduces (jax.lax) in the compiled step. In one process
the script re-runs itself under ``LD_PRELOAD=libstrata_alloc.so`` as the launcher does for its
processes (``--no-preload``: plain glibc).

Output: a table on stdout and ``<out>/pytree.json`` (all numbers and the machine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import format_size, parse_list, parse_size  # noqa: E402
from _machine import print_header, reexec_with_allocator  # noqa: E402
from _report import lead_print, write_json  # noqa: E402
from _timing import median, time_interleaved  # noqa: E402

AXIS = "x"
CHILD_ENV = "STRATA_BENCH_CHILD"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leaves", default="1,8,64,256", help="leaf counts (comma-separated)")
    p.add_argument("--total", default="1M", help="bytes per device in all the leaves (1M = 1 MiB)")
    p.add_argument("--op", default="psum", choices=("psum", "pmean"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=60, help="timed calls per implementation")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--devices", type=int, default=None, help="devices per process (8; 1 w/ procs)")
    p.add_argument("--procs", type=int, default=None, help="one process per device, P processes")
    p.add_argument("--no-preload", action="store_true", help="in-process: plain glibc allocator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="folder for pytree.json")
    a = p.parse_args(argv)
    a.leaf_counts = [int(v) for v in parse_list(a.leaves)]
    a.total_bytes = parse_size(a.total)
    if a.devices is None:
        a.devices = 1 if a.procs else 8
    return a


def relaunch(argv: list[str], procs: int) -> int:
    """--procs P: run this script under ``python -m strata_jax.launch -n P``."""
    cmd = [sys.executable, "-m", "strata_jax.launch", "-n", str(procs), __file__, *argv]
    print("# launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=dict(os.environ, **{CHILD_ENV: "1"}))


def leaf_shapes(n_leaves: int, total_elems: int, rng: np.random.Generator) -> list[tuple]:
    """``n_leaves`` shapes of rank 0..3 (cycled) whose sizes add up to ``total_elems``."""
    if n_leaves == 1:
        return [(total_elems,)]
    weights = rng.uniform(0.67, 1.33, n_leaves)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * total_elems)).astype(int)
    sizes[-1] = max(1, total_elems - int(sizes[:-1].sum()))
    shapes = []
    for k, s in enumerate(sizes):
        rank = k % 4
        if rank == 0 or s == 1:
            shapes.append(() if s == 1 else (int(s),))
        elif rank == 1:
            shapes.append((int(s),))
        elif rank == 2 and s % 4 == 0:
            shapes.append((4, int(s) // 4))
        elif rank == 3 and s % 8 == 0:
            shapes.append((2, 2, int(s) // 4))
        else:
            shapes.append((int(s),))
    return shapes


def fold(x: np.ndarray, op: str) -> np.ndarray:
    """``op`` over the leading (rank) axis of ``x``, rank 0 first; 16-bit floats in float32."""
    wide = x.dtype.itemsize == 2 and x.dtype.kind in "fV"
    acc = x[0].astype(np.float32) if wide else x[0].copy()
    for r in range(1, x.shape[0]):
        acc = acc + (x[r].astype(np.float32) if wide else x[r])
    acc = acc.astype(x.dtype)
    return acc / np.asarray(x.shape[0], acc.dtype) if op == "pmean" else acc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    multi = args.procs is not None
    if multi and not os.environ.get(CHILD_ENV):
        return relaunch(argv, args.procs)
    allocator = reexec_with_allocator(not args.no_preload and not multi)
    load_before = os.getloadavg()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import strata_jax

    if multi:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        strata_jax.init()
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = sorted(jax.devices(), key=lambda d: d.id)
    n = len(devs)
    mesh = Mesh(np.array(devs), (AXIS,))
    main_proc = jax.process_index() == 0
    write = lead_print()
    dtype = np.dtype(jnp.dtype(args.dtype))
    total_elems = max(1, args.total_bytes // dtype.itemsize)

    write(f"# strata_jax pytree all-reduce: {args.op} of many leaves, strata vs jax.lax")
    info = print_header(write, f"# allocator  : {allocator}")
    write(
        f"# ranks      : {n} = {jax.process_count()} process(es) x {args.devices} device(s); "
        f"jax.lax{' over gloo' if multi else ' (XLA CPU in-process all-reduce)'}"
    )
    write(
        f"# pytree     : {format_size(total_elems * dtype.itemsize)} of {dtype.name} per device "
        "in all, leaves of rank 0-3 mixed, sizes within 2x of the mean"
    )
    write(
        f"# time       : median of {args.iters} blocking calls after {args.warmup} warm-up, "
        "strata, jax.lax and lax@strata (jax.lax code inside use_for_jax_lax()) called in turns; "
        "calls = strata all-reduce calls / XLA all-reduces / lax@strata's strata calls in the "
        "compiled step; speedup = jax.lax / strata, lax@s x = jax.lax / lax@strata"
    )
    write(
        "# check      : s bitwise = strata's and lax@strata's results bitwise equal to the "
        "ranks' inputs folded in rank order by numpy (the script fails otherwise); lax |err| = "
        "jax.lax's largest absolute difference from it (XLA CPU sums in rank order too: 0 in "
        "one process; gloo sums in ring order)"
    )
    write(f"# load       : {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} (before)")
    ops = {"psum": (strata_jax.psum, jax.lax.psum), "pmean": (strata_jax.pmean, jax.lax.pmean)}
    s_op, x_op = ops[args.op]
    sharding = NamedSharding(mesh, P(AXIS))
    rng = np.random.default_rng(args.seed)
    cols = (
        "leaves",
        "leaf(avg)",
        "strata ms",
        "jax.lax ms",
        "lax@s ms",
        "1/leaf ms",
        "calls s/x/l@s/1",
        "speedup",
        "lax@s x",
        "s bitwise",
        "lax |err|",
    )
    write("# " + "  ".join(f"{c:>11}" for c in cols))
    rows: list[dict[str, Any]] = []
    failed = False
    for n_leaves in args.leaf_counts:
        shapes = leaf_shapes(n_leaves, total_elems, rng)
        hosts = [
            (rng.standard_normal((n, *s)).astype(np.float32) * 2).astype(dtype) for s in shapes
        ]

        def put(h):
            g = h.reshape((n * h.shape[1], *h.shape[2:])) if h.ndim > 1 else h
            return jax.make_array_from_callback(g.shape, sharding, lambda idx, g=g: g[idx])

        # Rank-0 leaves travel as (n,) arrays (one element per device) and are reshaped to ()
        # inside the body.
        tree = [put(h) for h in hosts]
        ranks0 = [len(s) == 0 for s in shapes]

        def body(op, t, ranks0=ranks0):
            t = [v.reshape(()) if r0 else v for v, r0 in zip(t, ranks0, strict=True)]
            out = op(t, AXIS)
            return [v.reshape((1,)) if r0 else v for v, r0 in zip(out, ranks0, strict=True)]

        jitted = {
            name: jax.jit(
                jax.shard_map(
                    lambda t, op=op: body(op, t), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
                )
            )
            for name, op in (
                ("strata", s_op),
                ("xla", x_op),
                ("lax_strata", x_op),
                ("per_leaf", x_op),
            )
        }
        fns = {}
        setting = os.environ.get("STRATA_COMBINE_BYTES")  # the user's, for lax@strata
        for k, f in jitted.items():
            with strata_jax.use_for_jax_lax(k in ("lax_strata", "per_leaf")):
                if k == "per_leaf":  # read when the program is lowered
                    os.environ["STRATA_COMBINE_BYTES"] = "0"
                try:
                    fns[k] = f.lower(tree).compile()
                finally:
                    os.environ.pop("STRATA_COMBINE_BYTES", None)
                    if setting is not None:
                        os.environ["STRATA_COMBINE_BYTES"] = setting
        hlo = {k: f.as_text() for k, f in fns.items()}
        calls = (
            hlo["strata"].count('custom_call_target="strata_all_reduce'),
            sum(1 for line in hlo["xla"].splitlines() if " all-reduce(" in line),
            hlo["lax_strata"].count('custom_call_target="strata_all_reduce'),
            hlo["per_leaf"].count('custom_call_target="strata_all_reduce'),
        )
        times, outs = time_interleaved(
            {k: (lambda f=f, t=tree: f(t)) for k, f in fns.items()}, args.iters, args.warmup
        )
        # The oracle: the ranks folded in rank order (rank 0 first, bfloat16/float16 in float32
        # and rounded once), as strata's kernels do; every process knows every rank's input.
        wants = [fold(h, args.op) for h in hosts]
        same = all(
            np.asarray(s.data).tobytes() == np.ascontiguousarray(w).tobytes()
            for impl in ("strata", "lax_strata", "per_leaf")
            for a, w in zip(outs[impl], wants, strict=True)
            for s in a.addressable_shards
        )
        lax_err = max(
            float(np.max(np.abs(np.asarray(s.data, np.float64) - w.astype(np.float64)), initial=0))
            for a, w in zip(outs["xla"], wants, strict=True)
            for s in a.addressable_shards
        )
        failed |= not same
        ts, tx = median(times["strata"]), median(times["xla"])
        tl, tp = median(times["lax_strata"]), median(times["per_leaf"])
        row = {
            "leaves": n_leaves,
            "leaf_bytes_avg": total_elems * dtype.itemsize / n_leaves,
            "strata_ms": 1e3 * ts,
            "xla_ms": 1e3 * tx,
            "lax_on_strata_ms": 1e3 * tl,
            "lax_on_strata_per_leaf_ms": 1e3 * tp,
            "lax_on_strata_per_leaf_calls": calls[3],
            "strata_calls": calls[0],
            "xla_all_reduces": calls[1],
            "lax_on_strata_calls": calls[2],
            "speedup": tx / ts,
            "lax_on_strata_speedup": tx / tl,
            "strata_bitwise_equal_to_oracle": same,
            "xla_max_abs_error": lax_err,
        }
        rows.append(row)
        write(
            "  "
            + "  ".join(
                f"{v:>11}"
                for v in (
                    n_leaves,
                    format_size(row["leaf_bytes_avg"]),
                    f"{row['strata_ms']:.3f}",
                    f"{row['xla_ms']:.3f}",
                    f"{row['lax_on_strata_ms']:.3f}",
                    f"{row['lax_on_strata_per_leaf_ms']:.3f}",
                    f"{calls[0]}/{calls[1]}/{calls[2]}/{calls[3]}",
                    f"{row['speedup']:.2f}x",
                    f"{row['lax_on_strata_speedup']:.2f}x",
                    "yes" if same else "NO",
                    f"{lax_err:.1e}",
                )
            )
        )
    load_after = os.getloadavg()
    write(f"# load       : {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (after)")
    for r in rows:
        s = r["speedup"]
        write(
            f"# speed: {r['leaves']} leaves: strata is {max(s, 1 / s):.2f}x "
            f"{'faster' if s >= 1 else 'slower'} than jax.lax ({r['strata_ms']:.3f} vs "
            f"{r['xla_ms']:.3f} ms median)"
        )
        s = r["lax_on_strata_speedup"]
        write(
            f"# speed: {r['leaves']} leaves: jax.lax code under use_for_jax_lax() is "
            f"{max(s, 1 / s):.2f}x {'faster' if s >= 1 else 'slower'} than jax.lax "
            f"({r['lax_on_strata_ms']:.3f} vs {r['xla_ms']:.3f} ms median, "
            f"{r['lax_on_strata_calls']} strata call(s))"
        )
        c = r["lax_on_strata_per_leaf_ms"] / r["lax_on_strata_ms"]
        write(
            f"# speed: {r['leaves']} leaves: under use_for_jax_lax(), combined is "
            f"{max(c, 1 / c):.2f}x {'faster' if c >= 1 else 'slower'} than one call per leaf "
            f"({r['lax_on_strata_ms']:.3f} vs {r['lax_on_strata_per_leaf_ms']:.3f} ms median, "
            f"{r['lax_on_strata_calls']} vs {r['lax_on_strata_per_leaf_calls']} calls)"
        )
    if main_proc:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(
            out / "pytree.json",
            {
                "args": vars(args),
                "machine": info,
                "load": [load_before, load_after],
                "rows": rows,
            },
        )
    if failed:
        write("# FAILED: strata's (or lax@strata's) result differs from the rank-order fold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
