"""Small-message latency across processes: strata against jax.lax over gloo and a jitted no-op.

One process per device (the script re-launches itself under ``python -m strata_jax.launch -n
--procs``). For every op and size it builds three programs on the same one-axis mesh, all
``jax.jit(jax.shard_map(body, mesh, P('x'), P('x')))``:

  * ``strata``: ``body = strata_jax.<op>``,
  * ``xla``: ``body = jax.lax.<op>`` (over gloo, XLA's CPU collectives across processes),
  * ``noop``: ``body = lambda x: x + 0`` -- one launch of a program on the same mesh with the
    same input and output, no collective: the floor a collective call cannot go below.

and times them in one run, alternating in ``--rounds`` rounds of ``--iters`` calls of each
(``--interleave call``: call 1 of each, call 2 of each, ...; ``--interleave block``: the
calls of one implementation back to back, then the next), every call blocked to completion,
fresh random inputs per point, results checked against jax.lax. The two orders measure
different things across processes: call by call, a collective absorbs the skew its ranks
bring from the call before (gloo's ranks leave a call up to hundreds of us apart) and the
no-op runs cold (40-60 us here); in blocks, the no-op runs on JAX's hot C++ path (6-7 us) and
the collective meets ranks that left its own previous call. It prints p10/p50/p99 of each
and the ratios
``strata / noop`` (goal <= 1.5: a collective costs at most half a launch more than the launch)
and ``xla / strata`` (how many times faster strata is than jax.lax over gloo). Timings are
rank 0's; the ``max p50`` column is the largest median over all ranks.

Usage::

    python benchmarks/latency.py --procs 4 --op psum -b 4K -e 64K
    python benchmarks/latency.py --procs 2 --op psum,all_gather -b 4K -e 4K --rounds 5
    # against jax.lax over XLA's MPI collectives (docs/guide/hosts.md, XLA over MPI)
    mpirun -n 4 -x MPITRAMPOLINE_LIB python benchmarks/latency.py --impl strata,mpi,noop
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import format_size, parse_list, parse_size, size_sweep  # noqa: E402
from _collective_ops import make_body  # noqa: E402  (the per-shard op, one definition)
from _machine import machine_info, print_machine  # noqa: E402
from _report import lead_print, write_json  # noqa: E402
from _timing import time_interleaved  # noqa: E402

CHILD_ENV = "STRATA_BENCH_CHILD"
AXIS = "x"
OPS = ("psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute")
IMPLS = ("strata", "xla", "mpi", "noop")
MPI_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def _program(body: Any, mesh: Any, x: Any, xr: Any) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    arg = xr if mesh.devices.flat[0] != x.sharding.mesh.devices.flat[0] else x
    return lambda: f(arg)


def _local(a: Any) -> np.ndarray:
    import jax

    return np.asarray(jax.block_until_ready(a).addressable_data(0))


def _percentiles(ts: list[float]) -> tuple[float, float, float]:
    a = np.asarray(ts) * 1e6
    p10, p50, p99 = np.percentile(a, [10, 50, 99])
    return float(p10), float(p50), float(p99)


def child(args: argparse.Namespace) -> int:
    import strata_jax as sj  # noqa: I001  (before jax creates its CPU backend)
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    impls = parse_list(args.impl, IMPLS)
    if "mpi" in impls:
        if "xla" in impls:
            sys.exit("error: --impl xla (gloo) and mpi cannot share a run (one engine a process)")
        if not any(k in os.environ for k in MPI_ENVS):
            sys.exit("error: --impl mpi needs the processes started by mpirun (see --help)")
        # jax.lax over XLA's MPI collectives; init() sets what they need (mpi_engine.py).
        jax.config.update("jax_cpu_collectives_implementation", "mpi")
    sj.init()
    devs = sorted(jax.devices(), key=lambda d: d.id)
    n = len(devs)
    mesh = Mesh(np.array(devs), (AXIS,))
    write = lead_print()
    lead = jax.process_index() == 0
    info = machine_info()
    write("# strata_jax small-message latency across processes (benchmarks/latency.py)")
    print_machine(info, write)
    write(
        f"# setup      : {jax.process_count()} processes x {jax.local_device_count()} device, "
        f"mesh axis '{AXIS}' of {n}; {', '.join(impls)} (xla: jax.lax over gloo, mpi: jax.lax "
        "over XLA's MPI collectives, noop: a jitted no-op x + 0) on "
        f"the same mesh; {args.rounds} rounds x {args.iters} calls, alternating "
        f"{'call by call' if args.interleave == 'call' else 'in blocks of ' + str(args.iters)}, "
        f"each blocked; times of rank 0 in us (load average {os.getloadavg()[0]:.1f}); "
        f"STRATA_LL_BYTES={os.environ.get('STRATA_LL_BYTES', 'default (64K)')}"
    )
    header = (
        f"{'op':>12} {'size':>8} {'impl':>7} {'p10':>9} {'p50':>9} {'p99':>9} {'max p50':>9} "
        f"{'#wrong':>6}"
    )
    write("#" + header[1:])
    sharding = NamedSharding(mesh, P(AXIS))
    # The general path for comparison: the same devices in reverse order are another
    # communicator, whose channel is made with the low-latency path turned off.
    rmesh = Mesh(np.array(devs[::-1]), (AXIS,))
    impls = impls + (["general"] if args.general else [])
    rows = []
    for op in parse_list(args.op, OPS):
        for nbytes in size_sweep(args.min_bytes, args.max_bytes, args.factor):
            count = max(n, nbytes // 4)
            count -= count % n
            per = count if op not in ("all_gather",) else count // n
            rng = np.random.default_rng(args.seed + nbytes)
            host = rng.standard_normal(n * per).astype(np.float32)
            x = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
            rsh = NamedSharding(rmesh, P(AXIS))
            xr = jax.make_array_from_callback(host.shape, rsh, lambda idx, h=host: h[idx])
            fns = {}
            for impl in impls:
                lib = jax.lax if impl in ("xla", "mpi", "noop") else sj
                body = (lambda v: v + 0) if impl == "noop" else make_body(lib, op, n)
                fns[impl] = _program(body, rmesh if impl == "general" else mesh, x, xr)
            if "general" in impls:  # its communicator's channel is made with the path off
                keep = sj.get_low_latency_threshold()
                sj.set_low_latency_threshold(0)
                jax.block_until_ready(fns["general"]())
                sj.set_low_latency_threshold(keep)
            outs = {k: _local(f()) for k, f in fns.items()}
            # Checked against jax.lax over the process's engine (gloo or MPI), on one mesh.
            lax_out = outs.get("xla", outs.get("mpi"))
            if lax_out is None:
                lax_out = _local(_program(make_body(jax.lax, op, n), mesh, x, xr)())
            wrong = {k: 0 for k in impls}
            for k in ("strata", "xla", "mpi"):
                if k in outs:
                    wrong[k] = int(
                        np.count_nonzero(~np.isclose(outs[k], lax_out, rtol=1e-5, atol=1e-5))
                    )
            if "general" in impls:
                ref = _local(_program(make_body(jax.lax, op, n), rmesh, x, xr)())
                wrong["general"] = int(
                    np.count_nonzero(~np.isclose(outs["general"], ref, rtol=1e-5, atol=1e-5))
                )
            times: dict[str, list[float]] = {k: [] for k in impls}
            for _ in range(args.rounds):
                if args.interleave == "call":
                    multihost_utils.sync_global_devices("latency round")
                    t, _o = time_interleaved(fns, args.iters, warmup=args.warmup)
                    for k in impls:
                        times[k] += t[k]
                    continue
                for k in impls:  # blocks: each impl's calls back to back, then the next
                    multihost_utils.sync_global_devices("latency block")
                    t, _o = time_interleaved({k: fns[k]}, args.iters, warmup=args.warmup)
                    times[k] += t[k]
            pct = {k: _percentiles(v) for k, v in times.items()}
            p50s = multihost_utils.process_allgather(np.array([pct[k][1] for k in impls]))
            p50max = np.asarray(p50s).reshape(-1, len(impls)).max(axis=0)
            size = format_size(count * 4)
            for i, k in enumerate(impls):
                p10, p50, p99 = pct[k]
                write(
                    f" {op:>11} {size:>8} {k:>7} {p10:9.1f} {p50:9.1f} {p99:9.1f} "
                    f"{p50max[i]:9.1f} {wrong[k]:>6}"
                )
            base = "xla" if "xla" in pct else "mpi"
            s, xl, no = pct["strata"], pct[base], pct["noop"]
            write(
                f" {op:>11} {size:>8} {'ratio':>7} strata/noop p10 {s[0] / no[0]:.2f} "
                f"p50 {s[1] / no[1]:.2f} p99 {s[2] / no[2]:.2f}; {base}/strata p50 "
                f"{xl[1] / s[1]:.1f}x (strata {'faster' if xl[1] > s[1] else 'slower'})"
                + (
                    f"; general/strata p50 {pct['general'][1] / s[1]:.2f}"
                    if "general" in impls
                    else ""
                )
            )
            st = sj.comm_stats()["ops"].get(op, {})
            if st.get("calls"):
                write(
                    f" {op:>11} {size:>8} {'handler':>7} strata handler (every strata call) p50 "
                    f"{st['p50_s'] * 1e6:.1f} us, p99 {st['p99_s'] * 1e6:.1f} us; of the total "
                    f"{st['wait_s'] / max(st['total_s'], 1e-12):.0%} waiting for peers"
                )
            sj.reset_stats()
            rows.append({"op": op, "bytes": count * 4, "pct": pct, "wrong": wrong})
            if lead and args.goal and op == "psum" and {"strata", "xla", "noop"} <= set(impls):
                i_s, i_x, i_n = impls.index("strata"), impls.index("xla"), impls.index("noop")
                r0, rmax = s[1] / no[1], p50max[i_s] / p50max[i_n]
                g0, gmax = xl[1] / s[1], p50max[i_x] / p50max[i_s]
                write(
                    f"# goal {op} {size}: strata p50 / no-op p50 = {r0:.2f} on rank 0, "
                    f"{rmax:.2f} with each one's slowest rank (goal <= 1.5: "
                    f"{'met' if max(r0, rmax) <= 1.5 else 'not met'}); jax.lax/gloo p50 / "
                    f"strata p50 = {g0:.1f} on rank 0, {gmax:.1f} slowest ranks (goal >= 20: "
                    f"{'met' if min(g0, gmax) >= 20 else 'not met'})"
                )
    if lead and args.json:
        write_json(Path(args.json), {"machine": info, "rows": rows})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--procs", type=int, default=4, help="processes (one device each)")
    ap.add_argument("--op", default="psum", help=f"comma list of {OPS} or 'all'")
    ap.add_argument("-b", "--min-bytes", type=parse_size, default=4096)
    ap.add_argument("-e", "--max-bytes", type=parse_size, default=65536)
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=100, help="calls per round of each impl")
    ap.add_argument("--rounds", type=int, default=5, help="alternations (each after a sync)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--interleave",
        choices=("call", "block"),
        default="call",
        help="alternate call by call, or in blocks of --iters calls per impl per round",
    )
    ap.add_argument(
        "--general",
        action="store_true",
        help="also time strata's general path (low-latency path off) on another communicator",
    )
    ap.add_argument(
        "--goal",
        action="store_true",
        help="print the latency goals for psum (strata below jax.lax at every size)",
    )
    ap.add_argument(
        "--impl",
        default="strata,xla,noop",
        help="comma list of strata, xla (jax.lax over gloo), mpi (jax.lax over XLA's MPI "
        "collectives; run under mpirun -x MPITRAMPOLINE_LIB, not with xla), noop",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the rows as JSON here (rank 0)")
    args = ap.parse_args()
    if os.environ.get(CHILD_ENV) or any(k in os.environ for k in MPI_ENVS):
        return child(args)  # under strata's launcher, or started by mpirun
    env = dict(os.environ, **{CHILD_ENV: "1"})
    argv = list(sys.argv[1:])
    if args.json:  # the ranks run in TMPDIR: a relative path is the caller's, make it absolute
        argv += ["--json", str(Path(args.json).resolve())]
    cmd = [
        sys.executable,
        "-m",
        "strata_jax.launch",
        "-n",
        str(args.procs),
        __file__,
        *argv,
    ]
    return subprocess.call(cmd, env=env, cwd=os.environ.get("TMPDIR", "/tmp"))


if __name__ == "__main__":
    sys.exit(main())
