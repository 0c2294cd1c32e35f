"""Soak: thousands of mixed strata_jax collective calls, every result checked against numpy.

Every call draws an op (psum, pmean, pmax, pmin, all_gather untiled and tiled, psum_scatter,
all_to_all, ppermute with two permutations, pbroadcast from two sources), a dtype (float32,
bfloat16, float16, float64, complex64, int32, int8, uint8, bool where the op takes it), a
per-device size from 0 B to --max-bytes (nccl-tests' per-rank buffer; small sizes more often,
so that the run also crosses the allocator threshold and the two-shot switch many times) and
whether the input is donated (``donate_argnums``). Each call gets fresh data: a random window
of a random pool, shifted by a random amount, of small integers scaled by 1/4 for floats, so
that every sum is exact in every dtype (bfloat16 included) and every result is compared with
numpy for equality, bit for bit. A wrong element anywhere counts the call as wrong.

The calls are drawn from --programs fixed combinations (every op at every size at least
once), so compilation ends early and RSS must then stay flat. Reported (per process): calls,
wrong calls (must be 0), RSS and open fds at start, when compilation was over ("warm": the
first 10 % tick by which every program the run compiled existed) and at the end, peak RSS,
segments
registered/mapped (strata_jax.memory_stats), compiled programs, time and calls/s. Exits 1 if
any call was wrong.

Usage::

    python benchmarks/soak.py                              # 10,000 calls, 8 in-process devices
    python benchmarks/soak.py --procs 4                    # the same over `launch -n 4`
    python benchmarks/soak.py --calls 300 --max-bytes 1M   # the short version the tests run

The calls run one after the other, each blocked to completion (dispatching multi-device
launches far ahead deadlocks XLA CPU; strata_jax/_src/runtime.py). Timings on a shared machine are
indicative only; the point of the soak is the zero and the flat RSS/fd lines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import strata_jax as sj  # noqa: I001  (before jax creates its CPU backend)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import format_size, parse_size  # noqa: E402
from _machine import machine_info, print_machine  # noqa: E402
from _report import write_json  # noqa: E402

CHILD_ENV = "STRATA_SOAK_CHILD"
DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "complex64",
    "int32",
    "int8",
    "uint8",
    "bool",
]
# per-device sizes in bytes and how often each is drawn (small ones more often)
SIZES = [0, 4, 64, 1028, 4096, 61440, 300_000, 1 << 20, 3 << 20, 8 << 20]
WEIGHTS = [6, 8, 8, 10, 10, 10, 8, 5, 3, 2]
OPS = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "all_gather_tiled",
    "psum_scatter",
    "all_to_all",
    "ppermute_shift",
    "ppermute_reverse",
    "pbroadcast_0",
    "pbroadcast_last",
]


def op_dtypes(op: str) -> list[str]:
    if op == "pmean":
        return ["float32", "bfloat16", "float16", "float64", "complex64"]
    if op in ("pmax", "pmin"):
        return [d for d in DTYPES if d != "complex64"]
    if op in ("psum", "psum_scatter", "pbroadcast_0", "pbroadcast_last"):
        return [d for d in DTYPES if d != "bool"]
    return DTYPES


def proc_status() -> tuple[int, int]:
    """(RSS bytes, open fds) of this process."""
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/self/fd"))


class Soak:
    """Compiled programs by (op, dtype, elements, donated) and the numpy oracle of each op."""

    def __init__(self, mesh, max_bytes: int, seed: int, impl: str = "strata"):
        import jax
        import numpy as np

        self.jax, self.np, self.mesh = jax, np, mesh
        self.impl = impl
        self.n = mesh.devices.size
        self.rng = np.random.default_rng(seed)  # the same stream on every process
        pool_elems = self.n * max_bytes + (1 << 16)
        self.pool = self.rng.integers(-15, 16, pool_elems).astype(np.int8)
        self.programs: dict = {}
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.sharding = NamedSharding(mesh, P("x"))
        self.P = P

    # -- data ------------------------------------------------------------------------------
    def fresh(self, count: int, dtype: str):
        """count values in [-15, 15] (unsigned: [0, 30]; floats: /4; bool: > 0), fresh each call."""
        np = self.np
        off = int(self.rng.integers(0, self.pool.size - count + 1))
        shift = int(self.rng.integers(0, 31))
        v = (self.pool[off : off + count].astype(np.int16) + 15 + shift) % 31 - 15
        jdt = self.jax.numpy.dtype(dtype)
        if dtype == "bool":
            return v > 0
        if dtype.startswith("uint"):
            return (v + 15).astype(jdt)
        if dtype.startswith("int"):
            return v.astype(jdt)
        if dtype.startswith("complex"):
            w = np.roll(v, 1)
            return ((v + 1j * w) / 4).astype(jdt)
        return (v.astype(np.float32) / 4).astype(jdt)

    # -- programs --------------------------------------------------------------------------
    def local_count(self, op: str, nbytes: int, itemsize: int) -> int:
        """Per-device input elements for a per-device buffer of nbytes (nccl-tests' sizes)."""
        c = nbytes // itemsize
        if op == "all_gather" or op == "all_gather_tiled":
            return c // self.n  # the output is the buffer
        if op in ("psum_scatter", "all_to_all"):
            return (c // self.n) * self.n
        return c

    def program(self, op: str, dtype: str, count: int, donate: bool):
        key = (op, dtype, count, donate)
        if key in self.programs:
            return self.programs[key]
        jax, P, n = self.jax, self.P, self.n
        lib = sj if self.impl == "strata" else jax.lax

        def body(v):
            return _body(v, lib)

        def _body(v, sj):  # the same calls for strata_jax and jax.lax
            if sj is jax.lax and op.startswith("pbroadcast"):
                # jax.lax.pbroadcast has no CPU lowering: its documented equivalent
                src = 0 if op == "pbroadcast_0" else n - 1
                hit = jax.lax.axis_index("x") == src
                return jax.lax.psum(jax.numpy.where(hit, v, jax.numpy.zeros_like(v)), "x")
            if sj is jax.lax and v.size == 0:
                # XLA rejects some empty collectives ("all_gather_dim cannot be zero"): the
                # baseline returns the empty result jax.lax's shape rules give
                stacked = op in ("psum", "pmean", "pmax", "pmin", "all_gather_tiled")
                shape = (1, n, 0) if op == "all_gather" else (1, 0) if stacked else (0,)
                return jax.lax.pcast(jax.numpy.zeros(shape, v.dtype), "x", to="varying")
            if op in ("psum", "pmean", "pmax", "pmin"):
                return getattr(sj, op)(v, "x")[None]
            if op == "all_gather":
                return sj.all_gather(v, "x")[None]
            if op == "all_gather_tiled":
                return sj.all_gather(v, "x", tiled=True)[None]
            if op == "psum_scatter":
                return sj.psum_scatter(v, "x", tiled=True)
            if op == "all_to_all":
                return sj.all_to_all(v, "x", 0, 0, tiled=True)
            if op == "ppermute_shift":
                return sj.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])
            if op == "ppermute_reverse":
                return sj.ppermute(v, "x", [(i, n - 1 - i) for i in range(n)])
            src = 0 if op == "pbroadcast_0" else n - 1
            return sj.pbroadcast(v, "x", source=src)

        f = jax.shard_map(body, mesh=self.mesh, in_specs=P("x"), out_specs=P("x"))
        self.programs[key] = jax.jit(f, donate_argnums=(0,) if donate else ())
        return self.programs[key]

    def expected(self, op: str, x, count: int):
        """The global result for global input x (n blocks of `count`), computed by numpy."""
        np, n = self.np, self.n
        blocks = x.reshape(n, count)
        wide = (
            blocks.astype(np.complex128)
            if np.iscomplexobj(blocks)
            else blocks.astype(np.float64)
            if blocks.dtype.kind == "f" or blocks.dtype.name == "bfloat16"
            else blocks.astype(np.int64)
        )
        if op == "psum":
            s = wide.sum(0)
            out = s.astype(np.int32 if x.dtype == np.bool_ else x.dtype)
            return np.broadcast_to(out, (n, count))
        if op == "pmean":
            return np.broadcast_to((wide.sum(0) / n).astype(x.dtype), (n, count))
        if op in ("pmax", "pmin"):
            r = blocks.max(0) if op == "pmax" else blocks.min(0)
            return np.broadcast_to(r, (n, count))
        if op == "all_gather":
            return np.broadcast_to(blocks, (n, n, count))
        if op == "all_gather_tiled":
            return np.broadcast_to(x, (n, n * count))
        if op == "psum_scatter":
            return wide.sum(0).astype(x.dtype)
        if op == "all_to_all":
            k = count // n
            return blocks.reshape(n, n, k).transpose(1, 0, 2).reshape(-1)
        if op == "ppermute_shift":
            return np.roll(blocks, 1, axis=0).reshape(-1)
        if op == "ppermute_reverse":
            return blocks[::-1].reshape(-1)
        src = 0 if op == "pbroadcast_0" else n - 1
        return np.broadcast_to(blocks[src], (n, count)).reshape(-1)

    # -- one call --------------------------------------------------------------------------
    def call(self, op: str, dtype: str, nbytes: int, donate: bool) -> str | None:
        """Runs one checked call; returns None if right, else a description of what was wrong."""
        jax, np = self.jax, self.np
        itemsize = jax.numpy.dtype(dtype).itemsize
        count = self.local_count(op, nbytes, itemsize)
        x = self.fresh(self.n * count, dtype)
        xg = jax.make_array_from_callback(x.shape, self.sharding, lambda i: x[i])
        out = self.program(op, dtype, count, donate)(xg)
        want = self.expected(op, x, count)
        for s in out.addressable_shards:
            got = np.asarray(s.data)
            exp = want[s.index]
            if got.shape != exp.shape or got.dtype != exp.dtype:
                return (
                    f"{op} {dtype} {nbytes} B: shard {got.shape} {got.dtype} != "
                    f"{exp.shape} {exp.dtype}"
                )
            if not np.array_equal(got, exp):
                bad = int((got != exp).sum())
                return (
                    f"{op} {dtype} {nbytes} B donate={donate}: {bad} wrong elements on device "
                    f"{s.device.id}"
                )
        return None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--devices", type=int, default=8, help="in-process devices (1 with --procs)")
    p.add_argument("--procs", type=int, default=None, help="run over `launch -n P`")
    p.add_argument("--max-bytes", type=parse_size, default=8 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--programs",
        type=int,
        default=240,
        help="distinct (op, dtype, size, donated) programs the calls are drawn from: every op "
        "at every size at least once; fixed so that RSS must be flat once all are compiled",
    )
    p.add_argument(
        "--impl",
        choices=["strata", "xla"],
        default="strata",
        help="xla: the same calls through jax.lax (a baseline for the RSS and fd lines)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the report here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def relaunch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cmd = [sys.executable, "-m", "strata_jax.launch", "-n", str(args.procs)]
    cmd += [str(Path(__file__).resolve()), *argv]
    print("# launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=dict(os.environ, **{CHILD_ENV: "1"}))


def run(
    mesh,
    calls: int,
    max_bytes: int,
    seed: int,
    programs: int,
    quiet: bool,
    write,
    impl: str = "strata",
) -> dict:
    """Runs the soak on `mesh` (axis "x"); returns the report row (with "errors", "per_op")."""
    import jax
    import numpy as np

    sizes = [s for s in SIZES if s <= max_bytes]
    weights = np.array(WEIGHTS[: len(sizes)], np.float64)
    weights /= weights.sum()
    soak = Soak(mesh, max_bytes, seed, impl)
    rss_start, fds_start = proc_status()
    wrong: list[str] = []
    per_op: dict[str, int] = {}
    marks: dict[int, tuple[int, int, int]] = {}  # calls -> (rss, fds, programs)
    t0 = time.monotonic()
    tick = max(1, calls // 10)
    combos: list[tuple[str, str, int, bool]] = []
    while not combos or len(combos) < programs:
        for op in OPS:
            for nbytes in sizes:
                dts = op_dtypes(op)
                dtype = dts[int(soak.rng.integers(len(dts)))]
                combos.append((op, dtype, nbytes, bool(soak.rng.integers(2))))
    combos = list(dict.fromkeys(combos))[: max(programs, len(OPS) * len(sizes))]
    # each combo's weight: its size's weight (small buffers more often)
    cw = np.array([weights[sizes.index(c[2])] for c in combos])
    cw /= cw.sum()
    for i in range(calls):
        op, dtype, nbytes, donate = combos[int(soak.rng.choice(len(combos), p=cw))]
        err = soak.call(op, dtype, nbytes, donate)
        per_op[op] = per_op.get(op, 0) + 1
        if err is not None:
            wrong.append(err)
            print(f"WRONG call {i}: {err}", flush=True)
        if (i + 1) % tick == 0:
            rss, fds = proc_status()
            marks[i + 1] = (rss, fds, len(soak.programs))
            if not quiet:
                write(
                    f"# {i + 1:6d} calls  {time.monotonic() - t0:7.1f} s  wrong {len(wrong)}  "
                    f"rss {rss / 2**20:.0f} MiB  fds {fds}  programs {len(soak.programs)}",
                    flush=True,
                )
    elapsed = time.monotonic() - t0
    rss_end, fds_end = proc_status()
    # warm: the first tick by which every program that the run compiled had been compiled
    done = [k for k, m in sorted(marks.items()) if m[2] == len(soak.programs)]
    warm = (done[0], *marks[done[0]][:2]) if done else (calls, rss_end, fds_end)
    ms = sj.memory_stats()
    row = {
        "impl": impl,
        "process": jax.process_index(),
        "calls": calls,
        "wrong": len(wrong),
        "rss_start_mib": round(rss_start / 2**20, 1),
        "warm_at_call": warm[0],
        "rss_warm_mib": round(warm[1] / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "fds_start": fds_start,
        "fds_warm": warm[2],
        "fds_end": fds_end,
        "registered_segments": ms.get("registered_segments"),
        "peer_segments_mapped": ms.get("peer_segments_mapped"),
        "pool_segments": ms.get("pool_segments"),
        "programs": len(soak.programs),
        "time_s": round(elapsed, 1),
        "calls_per_s": round(calls / elapsed, 1),
        "errors": wrong[:20],
        "per_op": per_op,
    }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.procs is not None and not os.environ.get(CHILD_ENV):
        return relaunch(args, argv)
    rss0, fds0 = proc_status()
    import jax

    if args.procs is None:
        jax.config.update("jax_num_cpu_devices", args.devices)
    info = sj.init()
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
    sj.set_timeout(120)
    main_proc = jax.process_index() == 0
    write = print if main_proc else (lambda *a, **k: None)
    sizes = [s for s in SIZES if s <= args.max_bytes]
    write("# strata_jax soak: mixed collective calls, each checked against numpy (bit-exact)")
    print_machine(machine_info(), write)
    write(
        f"# run        : {args.calls} calls, {mesh.devices.size} devices over "
        f"{jax.process_count()} process(es), fabric {info['fabric']}, registration "
        f"{info['registration']}, sizes {', '.join(format_size(s) for s in sizes)} per device, "
        f"seed {args.seed}"
    )
    write(f"# ops        : {', '.join(OPS)}; donated and non-donated inputs; impl {args.impl}")
    write(f"# programs   : {args.programs} (op, dtype, size, donated) combinations drawn from")
    row = run(
        mesh, args.calls, args.max_bytes, args.seed, args.programs, args.quiet, write, args.impl
    )
    row["rss_before_jax_mib"] = round(rss0 / 2**20, 1)
    row["fds_before_jax"] = fds0
    # one line per process (the launcher prefixes it with the rank), the header once
    keys = [k for k in row if "before_jax" not in k and k not in ("errors", "per_op")]
    write("# " + " ".join(keys))
    print("SOAK " + " ".join(str(row[k]) for k in keys), flush=True)
    print("SOAKJSON " + json.dumps(row), flush=True)
    if args.json is not None and main_proc:
        write_json(args.json, {"machine": machine_info(), "row": row})
    return 1 if row["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
