"""nccl-tests-style sweep of strata_jax collectives against jax.lax (and mpi4jax).

For every op, dtype and size (bytes per device, nccl-tests' convention: from -b/--min-bytes
times -f/--factor up to -e/--max-bytes, default 8 B .. 64 MiB by 2) and every
implementation in --impl, the script builds ``jax.jit(jax.shard_map(body, mesh, P('x'), P('x')))``
where ``body`` applies the op over mesh axis ``'x'``, feeds it fresh random inputs, times --iters
blocking calls after --warmup warm-up calls and reports the median, nccl-tests' algbw/busbw, and
the number of output elements that differ from numpy's result on the same input (each
implementation, jax.lax included, is checked against numpy, not against another implementation:
jax.lax over gloo has been seen to return wrong values, see docs/design.md, "Across fabrics").
Implementations run side by side on the same inputs; the last columns give the speedup of strata
over each other implementation (``time_other / time_strata``). A progress bar runs on stderr
(tqdm, optional ``bench`` extra); CSV, JSON (rows + machine description) and a PNG plot of busbw
against size go to --out.

Size convention (nccl-tests'): ``size`` is the per-rank buffer nccl-tests counts, ``count`` its
elements -- all-reduce (psum/pmean/pmax/pmin): input = output = size; all_gather: the per-rank
OUTPUT (each rank contributes size/N); psum_scatter: the per-rank INPUT (each rank gets size/N);
all_to_all, ppermute, pbroadcast: input = output = size. For all_gather, psum_scatter and
all_to_all ``count`` is rounded down to a multiple of N (at least N). algbw = size / time;
busbw = algbw * f, f = 2(N-1)/N (all-reduce), (N-1)/N (all_gather, psum_scatter, all_to_all),
1 (ppermute, pbroadcast).

Usage::

    # default: psum, float32, 8 in-process CPU devices, 8 B .. 64 MiB by 4, strata vs jax.lax
    python benchmarks/collectives.py
    # jax.lax only, every op, up to 1 MiB per device
    python benchmarks/collectives.py --impl xla --op all --max-bytes 1M
    # a few ops and dtypes, 4 devices, fixed iteration count
    python benchmarks/collectives.py --op psum,all_gather,all_to_all --dtype bfloat16,int32 \\
        --devices 4 --iters 50 --warmup 5
    # one process per device (re-launches itself under `python -m strata_jax.launch -n 4`);
    # xla = jax.lax over gloo; mpi4jax needs the processes started by mpirun instead
    python benchmarks/collectives.py --procs 4 --impl strata,xla
    # 2 simulated hosts with their own network, links shaped to 1 then 10 Gbit/s (root): adds
    # the link bound (fewest bytes a host must send across / rate) and each impl's share of it
    python benchmarks/collectives.py --procs 4 --hosts 2 --netns --link-gbit 1,10 \\
        --op psum,all_gather,psum_scatter,all_to_all -b 4M -e 16M
    # ... and against jax.lax over XLA's MPI collectives too (a second launch per rate with
    # launch --engine mpi; needs mpirun and MPITRAMPOLINE_LIB, left out with a note otherwise)
    python benchmarks/collectives.py --procs 4 --hosts 2 --netns --link-gbit 1,10 \\
        --impl strata,xla,mpi --op psum,all_gather,psum_scatter,all_to_all -b 4M -e 16M
    mpirun -n 4 python benchmarks/collectives.py --procs 4 --impl strata,xla,mpi4jax

In-process runs re-run themselves under ``LD_PRELOAD=libstrata_alloc.so`` (the deployment
shape: the launcher preloads it for --procs runs), so every implementation's large buffers come
from reused memory; ``--no-preload`` measures a plain ``python script.py``, where ``import
strata_jax`` hooks the allocator into jaxlib instead (XLA's buffers of every implementation come
from the pool, the rest of the process keeps glibc); add ``STRATA_ALLOC_HOOK=0`` for plain glibc,
where first-touch page faults on fresh outputs dominate every implementation at large sizes.

Notes: jax.lax.pbroadcast has no CPU lowering in jaxlib 0.10, so the 'xla' pbroadcast is its
documented equivalent ``psum(where(axis_index == source, x, 0))``.
Each call is waited for before the next is dispatched: dispatching multi-device launches far ahead
deadlocks XLA CPU (strata_jax/_src/runtime.py: configure_launch_threads).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# strata_jax must be imported before jax creates its CPU backend (it sets PJRT_NPROC &c.), so try
# it first, whatever --impl says: every implementation then runs in the same environment.
try:
    import strata_jax as _strata  # noqa: I001
except Exception as _e:  # not built yet / broken: only --impl strata needs it
    _strata = None
    _STRATA_ERROR: BaseException | None = _e
else:
    _STRATA_ERROR = None

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import format_size, parse_list, parse_size, size_sweep  # noqa: E402
from _collective_ops import AXIS, OPS  # noqa: E402
from _machine import machine_info, print_machine, reexec_with_allocator  # noqa: E402
from _report import progress, write_csv, write_json  # noqa: E402
from _sweep import (  # noqa: E402
    IMPLS,
    Point,
    Runner,
    make_context,
    make_table,
    plot,
    print_errors,
    print_summary,
    run_sweep,
    sweep_points,
    table_row,
)

CHILD_ENV = "STRATA_BENCH_CHILD"  # set on the processes this script re-launches under --procs
LINK_ENV = "STRATA_BENCH_LINK_GBIT"  # the link rate of this launch (--netns --link-gbit)
RESULT_ENV = "STRATA_BENCH_RESULT"  # a file where a re-launched run writes its JSON's path
MPI_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--op",
        default="psum",
        help=f"comma list of {', '.join(OPS)}, or 'all' (default: psum)",
    )
    p.add_argument("--dtype", default="float32", help="jax dtype name(s), comma list (float32)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="in-process CPU devices (default 8; 1 per process with --procs)",
    )
    # nccl-tests' names: -b/--minbytes, -e/--maxbytes, -f/--stepfactor.
    p.add_argument(
        "-b", "--min-bytes", "--minbytes", type=parse_size, default=8,
        help="smallest size per rank (default 8)",
    )  # fmt: skip
    p.add_argument(
        "-e", "--max-bytes", "--maxbytes", type=parse_size, default="64M",
        help="largest size per rank (default 64M)",
    )  # fmt: skip
    p.add_argument(
        "-f", "--factor", "--stepfactor", type=int, default=2,
        help="size multiplier between points, from -b up to -e (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per point (default clamp(5e8/size, 5, 200))",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up calls (default iters/10, 3..20)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="consecutive calls per timed sample, after one barrier and one untimed call"
        " (nccl-tests' and OSU's loop of calls; default 10 with several processes, 1 in one)",
    )
    p.add_argument(
        "--impl",
        default="strata,xla",
        help="comma list of strata, xla (jax.lax; over gloo across processes), mpi (jax.lax over "
        "XLA's MPI collectives, MPITRAMPOLINE_LIB needed: under mpirun, or with --procs through "
        "launch --engine mpi; with xla too, one launch per engine and a table of both), mpi4jax",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for CSV/JSON/PNG")
    p.add_argument("--procs", type=int, default=None, help="one process per device, P processes")
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="with --procs: simulate this many hosts (fabric domains; launch --hosts)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="with --procs and --hosts: each simulated host in its own network namespace, "
        "joined by veth links (launch --netns; root)",
    )
    p.add_argument(
        "--link-gbit",
        default=None,
        help="with --netns: each host's link rate in Gbit/s, a comma list (one launch per rate, "
        "e.g. 1,10); adds the link bound column link(us) and each implementation's %%link",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the random inputs")
    p.add_argument("--platform", default="cpu", help="jax platform of the mesh devices (cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="in-process: do not re-run under LD_PRELOAD=libstrata_alloc.so: a plain "
        "`python script.py`, where `import strata_jax` hooks the allocator into jaxlib "
        "(STRATA_ALLOC_HOOK=0 as well: plain glibc, fresh mmapped pages for every large "
        "buffer); --procs runs use the launcher's setting",
    )
    a = p.parse_args(argv)
    try:
        a.ops = parse_list(a.op, list(OPS))
        a.impls = parse_list(a.impl, IMPLS)
        a.sizes = size_sweep(a.min_bytes, a.max_bytes, a.factor)
    except ValueError as e:
        p.error(str(e))
    if not a.ops or not a.impls:
        p.error("--op and --impl need at least one value")
    if a.procs is not None and a.procs < 1:
        p.error("--procs must be >= 1")
    if a.devices is None:
        a.devices = 1 if a.procs else 8
    a.link_gbits = []
    if a.link_gbit is not None:
        try:
            a.link_gbits = [float(v) for v in a.link_gbit.split(",") if v.strip()]
        except ValueError:
            p.error(f"--link-gbit takes rates in Gbit/s, e.g. 1,10; got {a.link_gbit!r}")
        if not a.link_gbits or min(a.link_gbits) <= 0:
            p.error(f"--link-gbit rates must be > 0, got {a.link_gbit!r}")
        if not a.netns:
            p.error("--link-gbit needs --netns (the shaped links are the namespaces' veths)")
    if a.netns and (a.procs is None or a.hosts < 2):
        p.error("--netns needs --procs P and --hosts H >= 2")
    return a


def _under_mpi() -> bool:
    return any(k in os.environ for k in MPI_ENVS)


def engine_launches(impls: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The launches a --procs run needs: (engine, impls) pairs. XLA has one engine per process,
    so jax.lax over gloo ('xla') and over MPI ('mpi') run in two launches, strata in both (each
    compared with the jax.lax of its own launch, call by call)."""
    gloo = [i for i in impls if i != "mpi"]
    mpi = [i for i in impls if i != "xla"]
    if "mpi" not in impls:
        return [("gloo", list(impls))]
    if "xla" not in impls:
        return [("mpi", mpi)]
    return [("gloo", gloo), ("mpi", mpi)]


def relaunch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """--procs P in the parent: run this script under `python -m strata_jax.launch -n P`
    (with `--engine mpi` for jax.lax over MPI: mpirun starts the ranks); with 'xla' and 'mpi'
    both asked for, one launch per engine, and their figures side by side at the end."""
    try:
        import strata_jax.launch as launcher
    except Exception as e:
        sys.exit(
            f"error: --procs needs the strata_jax launcher (python -m strata_jax.launch), which is "
            f"not importable here: {type(e).__name__}: {e}"
        )
    head = [sys.executable, "-m", "strata_jax.launch", "-n", str(args.procs)]
    head += ["--hosts", str(args.hosts)]
    launches = engine_launches(args.impls)
    if any(engine == "mpi" for engine, _ in launches):
        reason = launcher.mpi_unavailable_reason()
        if reason is not None:
            launches = [(e, i) for e, i in launches if e != "mpi"]
            if not launches:
                sys.exit(f"error: --impl mpi: {reason}")
            print(f"# jax.lax over MPI left out: {reason}", flush=True)
    rc = 0
    # One launch per link rate (the links are shaped when the launcher makes them) and engine;
    # the child reads its own rate from LINK_ENV and says where it wrote its JSON in RESULT_ENV.
    for rate in args.link_gbits or [None]:
        written: dict[str, Path] = {}
        for engine, impls in launches:
            net = ["--netns"] if args.netns else []
            net += ["--link-gbit", f"{rate:g}"] if rate is not None else []
            net += ["--engine", "mpi"] if engine == "mpi" else []
            cmd = [*head, *net, str(Path(__file__).resolve()), *argv, "--impl", ",".join(impls)]
            env = dict(os.environ, **{CHILD_ENV: "1"})
            if rate is not None:
                env[LINK_ENV] = f"{rate:g}"
            # In --out, not /tmp: a simulated host's private /tmp would hide it.
            args.out.mkdir(parents=True, exist_ok=True)
            note = (args.out / f".result-{os.getpid()}-{engine}").resolve()
            note.unlink(missing_ok=True)
            env[RESULT_ENV] = str(note)
            print("# launching:", " ".join(cmd), flush=True)
            rc = subprocess.call(cmd, env=env) or rc
            if note.is_file():
                written[engine] = Path(note.read_text().strip())
                note.unlink()
        if len(written) == 2:
            print_engines(written, rate)
    return rc


def print_engines(written: dict[str, Path], rate: float | None) -> None:
    """strata against jax.lax over gloo and over MPI, from the JSON of the two launches of one
    link rate: each launch's times are interleaved call by call (strata with the jax.lax of its
    own engine); across the launches they are not."""
    import json

    rows = {e: json.loads(p.read_text())["rows"] for e, p in written.items()}
    by: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for engine, rs in rows.items():
        for r in rs:
            key = (r["op"], r["dtype"], r["size_bytes"])
            name = {"strata": f"strata[{engine}]"}.get(r["impl"], r["impl"])
            by.setdefault(key, {})[name] = r
            by[key][f"_wire[{engine}]"] = r
    pct = lambda r, k: "-" if not r or r.get(k) is None else f"{100 * r[k]:.0f}"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{v / 1e3:.2f}"  # noqa: E731

    def ratio(r: dict[str, Any], num: str, den: str) -> str:
        a, b = r.get(num, {}).get("time_us"), r.get(den, {}).get("time_us")
        return f"{a / b:.2f}" if a and b else "-"

    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    rate_s = f"{rate:g} Gbit/s" if rate is not None else "unshaped"
    print(f"#\n# strata against jax.lax over gloo and over MPI, links {rate_s}, load {load}")
    print(
        "# %link = link bound / time; wire = jax.lax ppermute of the bound's bytes over that"
        " engine; xla/strata, mpi/strata = jax.lax's time over strata's in the same launch"
        " (> 1: strata faster); the two launches ran one after the other"
    )
    print(
        "| op | size | bound ms | wire gloo/mpi ms | strata[gloo] %link | xla %link | xla/strata"
        " | strata[mpi] %link | mpi %link | mpi/strata | #wrong |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (op, _dtype, size), r in by.items():
        sg, sm = r.get("strata[gloo]", {}), r.get("strata[mpi]", {})
        bound = next((v.get("link_bound_us") for v in r.values() if v.get("link_bound_us")), None)
        wires = "/".join(ms(r.get(f"_wire[{e}]", {}).get("wire_us")) for e in ("gloo", "mpi"))
        wrong = sum(v.get("wrong") or 0 for k, v in r.items() if not k.startswith("_"))
        print(
            f"| {op} | {format_size(size)} | {ms(bound)} | {wires} | {pct(sg, 'link_share')} |"
            f" {pct(r.get('xla'), 'link_share')} | {ratio(r, 'xla', 'strata[gloo]')} |"
            f" {pct(sm, 'link_share')} | {pct(r.get('mpi'), 'link_share')} |"
            f" {ratio(r, 'mpi', 'strata[mpi]')} | {wrong} |"
        )


def setup_jax(args: argparse.Namespace, dtypes: Sequence[np.dtype], multi: bool) -> None:
    """Configure jax before any backend use (device count, collectives, x64, distributed init)."""
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if any(d.itemsize == 8 and d.kind != "c" or d.itemsize == 16 for d in dtypes):
        jax.config.update("jax_enable_x64", True)
    if multi:
        engine = "mpi" if "mpi" in args.impls else "gloo"
        jax.config.update("jax_cpu_collectives_implementation", engine)
        if _strata is not None and hasattr(_strata, "init"):
            _strata.init()  # initializes jax.distributed from the launcher's (or mpirun's) env
        else:
            jax.distributed.initialize()  # auto-detects mpirun/slurm


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    multi = args.procs is not None
    if multi and not os.environ.get(CHILD_ENV) and not _under_mpi():
        return relaunch(args, argv)
    # In-process: the deployment's allocator, as the launcher sets it for --procs runs.
    allocator = reexec_with_allocator(not args.no_preload and not multi)

    if "strata" in args.impls and _strata is None:
        sys.exit(
            "error: --impl strata needs the strata_jax package, which failed to import "
            f"({type(_STRATA_ERROR).__name__}: {_STRATA_ERROR}). Build/install it (pip install .) "
            "or run with --impl xla."
        )
    if "mpi" in args.impls:
        if not (multi and _under_mpi()):
            sys.exit(
                "error: --impl mpi needs one process per rank started by mpirun "
                "(mpirun -n P -x MPITRAMPOLINE_LIB python benchmarks/collectives.py --procs P "
                "--impl strata,mpi); see docs/guide/hosts.md"
            )
        if "xla" in args.impls:
            sys.exit(
                "error: --impl xla (gloo) and mpi cannot share a run: XLA has one engine per "
                "process; run them separately"
            )
        if args.devices != 1:
            sys.exit("error: --impl mpi needs --devices 1 (XLA's MPI: one device per process)")
    if "mpi4jax" in args.impls:
        try:
            import mpi4jax  # noqa: F401
        except Exception as e:
            sys.exit(f"error: --impl mpi4jax needs mpi4jax (optional 'bench' extra): {e}")
        if not (multi and _under_mpi()):
            sys.exit(
                "error: --impl mpi4jax needs one process per rank started by mpirun "
                "(mpirun -n P python benchmarks/collectives.py --procs P ...)"
            )
        if args.devices != 1:
            sys.exit("error: --impl mpi4jax needs --devices 1 (one device per process)")

    import jax.numpy as jnp

    try:
        dtypes = [np.dtype(jnp.dtype(d)) for d in parse_list(args.dtype)]
    except TypeError as e:
        sys.exit(f"error: bad --dtype {args.dtype!r}: {e}")

    setup_jax(args, dtypes, multi)
    import jax

    ctx = make_context(args.platform)
    batch = args.batch if args.batch is not None else (10 if ctx.process_count > 1 else 1)
    if multi and _strata is not None:
        ctx.hosts = len(_strata.topology()["fabrics"])
    if os.environ.get(LINK_ENV):
        ctx.link_gbit = float(os.environ[LINK_ENV])
    expected = args.devices * (args.procs or 1)
    if ctx.n != expected:
        sys.exit(
            f"error: expected {expected} {args.platform} devices, jax has {ctx.n} "
            "(XLA_FLAGS --xla_force_host_platform_device_count conflicting?)"
        )
    main_proc = ctx.is_main
    write: Callable[[str], Any] = print if main_proc else (lambda s: None)

    info = machine_info()
    info["strata_jax"] = "imported" if _strata is not None else f"unavailable: {_STRATA_ERROR!r}"
    write("# strata_jax collectives benchmark (nccl-tests style)")
    print_machine(info, write)
    write(f"# strata_jax : {info['strata_jax']}")
    write(f"# allocator  : {allocator}")
    write(
        f"# compared   : {', '.join(args.impls)}  ('xla' = jax.lax"
        + (" over gloo" if multi else "")
        + ("; 'mpi' = jax.lax over XLA's MPI collectives" if "mpi" in args.impls else "")
        + "; #wrong is against numpy on the same input)"
    )
    write(
        f"# ranks      : {ctx.n} = {ctx.process_count} process(es) x {args.devices} "
        f"{args.platform} device(s); mesh axis '{AXIS}'"
    )
    if _strata is not None and multi:
        topo = _strata.topology()
        write(
            f"# fabrics    : {len(topo['fabrics'])} ("
            + "; ".join(f"{f['id']}: processes {f['processes']}" for f in topo["fabrics"])
            + "); strata moves bytes inside a fabric, XLA's collectives "
            f"({jax.config.jax_cpu_collectives_implementation}) between; "
            "inter(B) = bytes per device per call handed to them (strata: measured, "
            "jax.lax: its whole input)"
        )
    write(
        "# size       : nccl-tests convention: the per-rank buffer: all-reduce in = out;"
        " all_gather the OUTPUT (input = size/N); psum_scatter the INPUT (output = size/N);"
        " all_to_all, ppermute, pbroadcast in = out"
    )
    write(
        "# time       : median of iters blocking calls after warm-up, impls interleaved call by"
        " call (several processes: the slowest process's median over samples of --batch"
        f" (here {batch}) consecutive calls, each sample started on all of them together by a"
        " barrier and one untimed call outside the timing); algbw = size/time; busbw = algbw *"
        " 2(N-1)/N all-reduce, (N-1)/N"
        " all_gather/psum_scatter/all_to_all, 1 ppermute/pbroadcast (GB/s = 1e9 B/s)"
    )
    write(
        "# %mem       : the op's memory floor (every input byte read once, every output byte"
        " written once, all ranks: 2N*size all-reduce/all_to_all/ppermute, (N+1)*size all_gather/"
        "psum_scatter/pbroadcast) over its time, as % of 'stream' = the memory bandwidth of"
        " these devices (GB/s): STREAM add a = a + b by XLA on every device at once, in place,"
        " for the same bytes, measured in this run just before the point"
    )
    write(
        "# cores      : CPU time of all processes per call (user + system, every thread; median)"
        " over time: the cores the call kept busy, at most this machine's"
        f" {os.cpu_count()}; where it reaches that, the call is CPU-bound"
    )
    write(
        "# #wrong     : elements != numpy's result on the same input (bitwise; float"
        " psum/psum_scatter: |d| > (N-1)*N*eps*max|x|), first and last call checked; '-': not"
        " checked (no numpy meaning: psum of bool, pmax/pmin of complex); speedup ="
        " time_other / time_strata"
    )

    if ctx.link_gbit:
        write(
            f"# link       : each host's link shaped to {ctx.link_gbit:g} Gbit/s each way (launch "
            "--netns, tc tbf); link(us) = the link bound: the fewest bytes each host must send"
            " across for the op (all-reduce 2(H-1)/H*size, all_gather/psum_scatter (H-1)/H*size,"
            " all_to_all L(H-1)/H*size, ppermute/pbroadcast size; H hosts of L ranks) over the"
            " link rate; %link = link(us)/time(us): the share of the bound an implementation"
            " reaches (100 = the link is the only cost); wire(us) = the wire floor: jax.lax"
            f" ppermute over {jax.config.jax_cpu_collectives_implementation} moving the same"
            " bytes per host along a ring of the hosts (every"
            " rank sends link bytes/L to a rank of the next host), timed in the same run with the"
            " others; %wire = wire(us)/time(us): the share of what that engine reaches on these"
            " links on this machine (where the CPU, not the link, is the limit, this is the bound"
            " the machine can judge); wcpu(ms) and cpu(ms): CPU time of all processes per call"
            " (user + system, every thread; median) of the wire floor and of each implementation"
        )
    points = [
        pt
        for op in args.ops
        for dt in dtypes
        for pt in sweep_points(op, dt, args.sizes, ctx.n, args.iters, args.warmup, batch)
    ]
    bar = progress(len(points), "collectives", enable=main_proc and not args.no_progress)
    out_write = bar.write if main_proc else (lambda s: None)
    table = make_table(args.impls, link=bool(ctx.link_gbit))
    state: dict[str, Any] = {"group": None}

    def emit(pt: Point, results: dict[str, dict[str, Any]]) -> None:
        group = (pt.op, pt.dtype.name)
        if state["group"] != group:
            state["group"] = group
            out_write("#")
            for line in table.header_lines():
                out_write(line)
        link_s = ctx.link_seconds(OPS[pt.op], pt.nbytes)
        out_write(table_row(table, pt, results, None if link_s is None else link_s * 1e6))

    def tick(desc: str) -> None:
        bar.set_postfix_str(desc)

    runner = Runner(ctx, args.impls)
    t0 = time.perf_counter()
    rows = run_sweep(
        ctx, runner, points, seed=args.seed, emit=emit, tick=tick, step=lambda: bar.update(1)
    )
    bar.close()
    elapsed = time.perf_counter() - t0

    if main_proc:
        print_errors(rows, write)
        print_summary(rows, args.impls, write)
        write(f"# wall time: {elapsed:.1f} s")
        dnames = "-".join(d.name for d in dtypes)
        stem = f"collectives_{dnames}_n{ctx.n}" + (f"_p{ctx.process_count}" if multi else "")
        stem += f"_h{ctx.hosts}" if ctx.hosts > 1 else ""
        stem += f"_link{ctx.link_gbit:g}g" if ctx.link_gbit else ""
        stem += "_mpi" if multi and jax.config.jax_cpu_collectives_implementation == "mpi" else ""
        out: Path = args.out
        write_csv(out / f"{stem}.csv", rows)
        write_json(
            out / f"{stem}.json",
            {
                "benchmark": "collectives",
                "args": {k: v for k, v in vars(args).items()},
                "machine": info,
                "jax_version": jax.__version__,
                "elapsed_s": elapsed,
                "rows": rows,
            },
        )
        png = out / f"{stem}.png"
        plotted = plot(png, rows)
        if os.environ.get(RESULT_ENV):
            Path(os.environ[RESULT_ENV]).write_text(str((out / f"{stem}.json").resolve()))
        write(
            f"# wrote {out / (stem + '.csv')}, {out / (stem + '.json')}"
            + (f", {png}" if plotted else " (no PNG: matplotlib missing)")
        )
    failed = any(r["wrong"] or r.get("error") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
