"""The sweep of benchmarks/collectives.py in one process (of one or several): the mesh and the
processes (:class:`Context`), the points (op, dtype, size), the timed implementations
alternated call by call with their results checked (:class:`Runner`, :func:`run_sweep`), and the
table, summary and plot of the rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _args import auto_iters, format_size
from _collective_ops import (
    AXIS,
    OPS,
    OpSpec,
    _LaxForBench,
    _one_line,
    count_wrong,
    float_tolerance,
    local_pieces,
    make_body,
    numpy_reference,
    random_array,
)
from _report import Column, Table, plot_lines
from _timing import align_processes, median, stream_add_gbs, time_interleaved

IMPLS = ("strata", "xla", "mpi", "engine", "mpi4jax")
WIRE = "_wire"  # the wire floor's program among the timed ones (Runner.wire_fn)


def _strata() -> Any:
    """strata_jax when collectives.py imported it (first, before jax's backend), else None."""
    return sys.modules.get("strata_jax")


@dataclass
class Context:
    mesh: Any
    n: int  # ranks on the mesh axis
    process_index: int
    process_count: int
    hosts: int = 1  # fabrics (simulated hosts) of the job
    link_gbit: float | None = None  # each host's link rate, --netns --link-gbit

    def link_seconds(self, spec: OpSpec, nbytes: int) -> float | None:
        """The link bound: ``spec.link_bytes`` over the link rate (None without a rate)."""
        if not self.link_gbit or self.hosts < 2:
            return None
        return spec.link_bytes(nbytes, self.hosts, self.n // self.hosts) / (self.link_gbit * 1.25e8)

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def _gather(self, v: float) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.asarray(v, np.float64)))

    def max_across(self, v: float) -> float:
        return v if self.process_count == 1 else float(np.max(self._gather(v)))

    def sum_across(self, v: float) -> float:
        if self.process_count == 1:
            return v
        total = np.sum(self._gather(float(v)))
        return int(total) if isinstance(v, (int, np.integer)) else float(total)


def make_context(platform: str) -> Context:
    import jax
    from jax.sharding import Mesh

    devs = sorted(jax.devices(platform), key=lambda d: d.id)
    return Context(
        Mesh(np.array(devs), (AXIS,)), len(devs), jax.process_index(), jax.process_count()
    )


@dataclass
class Point:
    op: str
    dtype: np.dtype
    count: int  # elements of the size buffer
    nbytes: int  # size in bytes (nccl-tests' size)
    iters: int  # timed samples
    warmup: int
    batch: int = 1  # consecutive calls per timed sample (time_interleaved)


def sweep_points(
    op: str,
    dtype: np.dtype,
    sizes: Sequence[int],
    n: int,
    iters: int | None,
    warmup: int | None,
    batch: int = 1,
) -> list[Point]:
    """The points of one op and dtype. ``batch`` > 1: the point's ``iters`` calls (given, or
    auto_iters) are timed as at least 3 samples of up to ``batch`` consecutive calls."""
    spec = OPS[op]
    pts: list[Point] = []
    seen: set[int] = set()
    for s in sizes:
        count = max(1, s // dtype.itemsize)
        if spec.divisible:
            count = max(n, count - count % n)
        if count in seen:
            continue
        seen.add(count)
        nbytes = count * dtype.itemsize
        it = iters if iters is not None else auto_iters(nbytes)
        wu = warmup if warmup is not None else max(3, min(20, it // 10))
        b = max(1, min(batch, it))
        pts.append(Point(op, dtype, count, nbytes, max(3, -(-it // b)) if b > 1 else it, wu, b))
    return pts


def wire_ring(n: int, hosts: int) -> list[tuple[int, int]]:
    """The wire floor's (source, destination) pairs over n ranks in hosts hosts of n/hosts
    consecutive ranks: rank l of host h sends to rank l of host h + 1, and the last host's rank
    l to rank l + 1 of the first, so each rank sends once and receives once, to and from other
    hosts, and (with more than two ranks) no two ranks exchange both ways."""
    per = n // hosts

    def dst(r: int) -> int:
        host, lo = divmod(r, per)
        return ((host + 1) % hosts) * per + (lo + (host == hosts - 1)) % per

    return [(r, dst(r)) for r in range(n)]


class Runner:
    """Builds, caches and times the jitted programs of each implementation for one context."""

    def __init__(self, ctx: Context, impls: Sequence[str]) -> None:
        self.ctx = ctx
        self.impls = list(impls)
        # 'xla' and 'mpi' are both jax.lax; which engine moves the bytes between processes
        # (gloo or XLA's MPI collectives) is the process's, set in setup_jax.
        # 'engine' is jax.lax too, run by strata's engine for XLA's collectives.
        self.libs: dict[str, Any] = {
            "xla": _LaxForBench(),
            "mpi": _LaxForBench(),
            "engine": _LaxForBench(),
        }
        if "strata" in impls:
            self.libs["strata"] = _strata()
        self._mpi: Any = None

    # ---- programs
    def wire_fn(self, per_rank_bytes: float) -> Callable[[], Any]:
        """The wire floor of a point (``--netns --link-gbit``): jax.lax.ppermute over gloo of
        ``per_rank_bytes`` (rounded up to whole float32) from every rank to a rank of the next
        host, along the ring strata crosses on (rank l of host h sends to rank l of host h + 1,
        the last host to rank l + 1 of the first), so every gloo connection carries one
        direction and every rank sends and receives at once. Its time is what gloo itself
        takes to move the link bound's bytes over these links on this machine, the same run."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        n = self.ctx.n
        perm = wire_ring(n, self.ctx.hosts)
        m = max(1, -(-int(per_rank_bytes) // 4))
        f = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.ppermute(v, AXIS, perm),
                mesh=self.ctx.mesh,
                in_specs=P(AXIS),
                out_specs=P(AXIS),
            )
        )
        x = jax.device_put(jnp.zeros((n * m,), jnp.float32), NamedSharding(self.ctx.mesh, P(AXIS)))
        return lambda: f(x)

    def shard_map_fn(self, impl: str, op: str) -> Callable[[Any], Any]:
        import jax
        from jax.sharding import PartitionSpec as P

        body = make_body(self.libs[impl], op, self.ctx.n)
        return jax.jit(jax.shard_map(body, mesh=self.ctx.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))

    def mpi4jax_fn(self, op: str) -> Callable[[Any], Any]:
        """Per-process function on the local (1-device) array; mpi4jax has no reduce_scatter."""
        import jax
        import mpi4jax
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
        first = lambda r: r[0] if isinstance(r, tuple) else r  # older mpi4jax returns (x, token)
        ops = {"psum": MPI.SUM, "pmax": MPI.MAX, "pmin": MPI.MIN}
        if op in ops:
            f = lambda x: first(mpi4jax.allreduce(x, op=ops[op], comm=comm))
        elif op == "all_gather":
            f = lambda x: first(mpi4jax.allgather(x, comm=comm)).reshape(-1)
        elif op == "all_to_all":
            f = lambda x: first(mpi4jax.alltoall(x.reshape(n, -1), comm=comm)).reshape(-1)
        elif op == "pbroadcast":
            f = lambda x: first(mpi4jax.bcast(x, root=0, comm=comm))
        elif op == "ppermute":
            f = lambda x: first(
                mpi4jax.sendrecv(x, x, source=(rank - 1) % n, dest=(rank + 1) % n, comm=comm)
            )
        else:
            raise NotImplementedError(f"mpi4jax has no {op}")
        return jax.jit(f)

    # ---- one point
    def make_input(self, pt: Point, seed: int) -> tuple[Any, np.ndarray]:
        """The sharded input and its host copy (every process holds all of it)."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        n = self.ctx.n
        total = n * OPS[pt.op].in_count(pt.count, n)
        host = random_array(np.random.default_rng(seed), total, pt.dtype, n)
        sharding = NamedSharding(self.ctx.mesh, P(AXIS))
        x = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        # XLA's own copy, as a training step's gradients are: on CPU jax may borrow a 64-byte
        # aligned numpy buffer instead of copying it, and outside LD_PRELOAD (mpirun without
        # strata-run: the allocator hooked into jaxlib only) numpy's memory is not fabric
        # memory, so strata would stage such an input.
        return jax.device_put(x, sharding, may_alias=False), host

    def prepare(self, impl: str, pt: Point, x: Any) -> Callable[[], Any]:
        """A no-argument callable running `impl` on `x` (compiled by its first call)."""
        if impl == "mpi4jax":
            fn = self.mpi4jax_fn(pt.op)
            arg = x.addressable_data(0)
        else:
            fn = self.shard_map_fn(impl, pt.op)
            arg = x
        return lambda: fn(arg)


def run_sweep(
    ctx: Context,
    runner: Runner,
    points: Sequence[Point],
    *,
    seed: int,
    emit: Callable[[Point, dict[str, dict[str, Any]]], None],
    tick: Callable[[str], None] = lambda desc: None,
    step: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """The per-process body: every point x implementation; returns one row per (point, impl).

    Runs identically on every process of a multi-process run (collectives need them all); timings
    are the max over processes of each process's median, #wrong the sum over processes.
    """
    import jax

    rows: list[dict[str, Any]] = []
    for k, pt in enumerate(points):
        spec = OPS[pt.op]
        # The memory floor: STREAM add of the same traffic on the same devices, measured now,
        # before this point's arrays exist (every process takes part, as in any jitted call).
        traffic = spec.min_traffic(pt.nbytes, ctx.n)
        stream = stream_add_gbs(ctx.mesh, traffic)
        link_s = ctx.link_seconds(spec, pt.nbytes)
        x, host = runner.make_input(pt, seed + k)
        amax = float(np.sqrt(2.0)) if pt.dtype.kind == "c" else 1.0
        tol = (
            float_tolerance(pt.dtype, ctx.n, amax)
            if spec.reduces and (pt.dtype.kind in "fc" or pt.dtype.kind == "V")
            else None
        )
        # reference: numpy on the host copy of the input, so that each implementation's #wrong
        # is its own (jax.lax over gloo is one of the implementations checked, not the oracle).
        ref: list[np.ndarray] | None = None
        ref_error = None
        expected = numpy_reference(pt.op, host, ctx.n)
        if expected is None:
            ref_error = f"no numpy reference for {pt.op} on {pt.dtype.name}: not checked"
        else:
            rank_of = {d: r for r, d in enumerate(ctx.mesh.devices.flat)}
            shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
            ref = [expected[rank_of[s.device]] for s in shards]
        del host
        results: dict[str, dict[str, Any]] = {impl: {"impl": impl} for impl in runner.impls}
        errors: dict[str, str] = {}

        def on_error(impl: str, e: BaseException, errors: dict[str, str] = errors) -> None:
            errors[impl] = _one_line(e)

        # compile and check the first call of each, then time all of them round-robin
        fns: dict[str, Callable[[], Any]] = {}
        firsts: dict[str, list[np.ndarray]] = {}
        inter: dict[str, int | None] = {}
        for impl in runner.impls:
            tick(f"{pt.op} {format_size(pt.nbytes)} {impl}")
            try:
                fn = runner.prepare(impl, pt, x)
                firsts[impl] = local_pieces(jax.block_until_ready(fn()))
                fns[impl] = fn
                inter[impl] = inter_fabric_bytes(impl, pt, fn, ctx)
            except Exception as e:  # keep sweeping; the row says what failed
                on_error(impl, e)
        # The wire floor (--netns --link-gbit, several hosts): gloo moving the link bound's
        # bytes along the ring, timed with the others (see Runner.wire_fn).
        if link_s is not None and ctx.process_count > 1 and fns:
            per_rank = spec.link_bytes(pt.nbytes, ctx.hosts, ctx.n // ctx.hosts) * ctx.hosts
            wire = runner.wire_fn(per_rank / ctx.n)
            jax.block_until_ready(wire())
            fns[WIRE] = wire
        cpu: dict[str, list[float]] = {}
        # Several processes: every call starts on all of them together (outside the timing).
        # Without it, a process that one call lets go early (a one-way exchange's sender) waits
        # in the next call, which may be the other implementation's: its time is then charged
        # to that one, and the interleaved medians compare skews, not collectives.
        align = (lambda: align_processes("collectives")) if ctx.process_count > 1 else None
        times, last = time_interleaved(
            fns,
            pt.iters,
            max(0, pt.warmup - 1),
            on_error=on_error,
            cpu=cpu,
            align=align,
            batch=pt.batch,
        )
        wire_s = ctx.max_across(median(times[WIRE])) if WIRE in times else None
        wire_cpu = ctx.sum_across(median(cpu[WIRE])) if WIRE in cpu else None
        for impl, r in results.items():
            if impl in errors or impl not in fns:
                r.update(time_us=None, algbw_gbs=None, busbw_gbs=None, wrong=None)
                r["error"] = errors.get(impl, "not run")
                continue
            wrong: int | None = None
            maxerr: float | None = None
            if ref is not None:
                checks = [
                    count_wrong(o, ref, tol) for o in (firsts[impl], local_pieces(last[impl]))
                ]
                wrong = max(w for w, _ in checks)
                maxerr = max(e for _, e in checks)
            t = ctx.max_across(median(times[impl]))
            # CPU time of every process together per call, over the call's time: the cores the
            # call kept busy (this machine's core count bounds it; at that bound a faster
            # implementation is one that burns less CPU, not one that waits less).
            cpu_s = ctx.sum_across(median(cpu[impl]))
            algbw = pt.nbytes / t / 1e9
            r.update(
                time_us=t * 1e6,
                algbw_gbs=algbw,
                busbw_gbs=algbw * spec.busbw_factor(ctx.n),
                wrong=None if wrong is None else ctx.sum_across(wrong),
                max_abs_err=None if maxerr is None else ctx.max_across(maxerr),
                min_us=ctx.max_across(min(times[impl])) * 1e6,
                mean_us=ctx.max_across(float(np.mean(times[impl]))) * 1e6,
                error=ref_error,
                inter_fabric_bytes=inter.get(impl),
                traffic_bytes=traffic,
                stream_gbs=stream,
                mem_share=(traffic / t / 1e9 / stream) if stream else None,
                cpu_us=cpu_s * 1e6,
                cores=cpu_s / t,
                link_gbit=ctx.link_gbit,
                link_bound_us=None if link_s is None else link_s * 1e6,
                link_share=None if link_s is None else link_s / t,
                wire_us=None if wire_s is None else wire_s * 1e6,
                wire_share=None if wire_s is None else wire_s / t,
                wire_cpu_us=None if wire_cpu is None else wire_cpu * 1e6,
            )
        del firsts, last
        step()
        del x
        emit(pt, results)
        base = results.get("strata", {}).get("time_us")
        for impl, r in results.items():
            row = {
                "op": pt.op,
                "dtype": pt.dtype.name,
                "size_bytes": pt.nbytes,
                "count": pt.count,
                "ranks": ctx.n,
                "processes": ctx.process_count,
                "iters": pt.iters,
                "warmup": pt.warmup,
                "batch": pt.batch,
                **r,
                "tol": tol,
                "speedup_strata": (
                    r["time_us"] / base if base and r.get("time_us") and impl != "strata" else None
                ),
            }
            rows.append(row)
    return rows


def inter_fabric_bytes(impl: str, pt: Point, fn: Callable[[], Any], ctx: Context) -> int | None:
    """Bytes per device one call hands to the inter-fabric engine (XLA's collectives, gloo):
    measured for strata (comm_stats' counter around one extra call; 0 inside one fabric), the
    whole input for jax.lax (gloo moves all of it; how much crosses hosts is gloo's choice).
    None with a single fabric."""
    sj = _strata()
    if sj is None or len(sj.topology()["fabrics"]) < 2:
        return None
    if impl != "strata":
        return pt.nbytes // ctx.n if pt.op == "all_gather" else pt.nbytes
    import jax

    before = sj.comm_stats()["inter_fabric_bytes"]
    jax.block_until_ready(fn())
    local = max(1, len(jax.local_devices()))
    return int(ctx.max_across(float(sj.comm_stats()["inter_fabric_bytes"] - before) / local))


def make_table(impls: Sequence[str], link: bool = False) -> Table:
    cols = [
        Column("size(B)", 12),
        Column("count", 11),
        Column("dtype", 9),
        Column("op", 12),
    ]
    if link:
        cols.append(Column("link(us)", 10, ".1f"))
        cols.append(Column("wire(us)", 10, ".1f"))
        cols.append(Column("wcpu(ms)", 8, ".1f"))
    groups: list[tuple[str, int]] = [("", len(cols))]
    for impl in impls:
        cols += [
            Column("time(us)", 11, ".1f"),
            Column("algbw", 7, ".2f"),
            Column("busbw", 7, ".2f"),
            Column("%mem", 5, ".0f"),
            Column("#wrong", 7),
            Column("inter(B)", 10),
            Column("cores", 5, ".2f"),
        ]
        if link:
            cols.append(Column("cpu(ms)", 7, ".1f"))
            cols.append(Column("%link", 5, ".0f"))
            cols.append(Column("%wire", 5, ".0f"))
        groups.append((f" {impl} ", 10 if link else 7))
    others = [i for i in impls if i != "strata"] if "strata" in impls else []
    for o in others:
        cols.append(Column(f"{o}/strata", max(12, len(o) + 7)))
    if others:
        groups.append((" speedup ", len(others)))
    cols.append(Column("stream", 7, ".2f"))
    groups.append(("", 1))
    return Table(cols, groups)


def table_row(
    table: Table, pt: Point, results: dict[str, dict[str, Any]], link_us: float | None = None
) -> str:
    link = link_us is not None
    wires = [r.get("wire_us") for r in results.values() if r.get("wire_us")]
    vals: list[Any] = [pt.nbytes, pt.count, pt.dtype.name, pt.op]
    wcpus = [r.get("wire_cpu_us") for r in results.values() if r.get("wire_cpu_us")]
    vals += (
        [link_us, wires[0] if wires else None, wcpus[0] / 1e3 if wcpus else None] if link else []
    )
    for r in results.values():
        if r.get("time_us") is None:
            vals += ["error", None, None, None, None, None, None] + ([None] * 3 if link else [])
        else:
            inter = r.get("inter_fabric_bytes")
            share = r.get("mem_share")
            pct = None if share is None else 100 * share
            vals += [
                r["time_us"],
                r["algbw_gbs"],
                r["busbw_gbs"],
                pct,
                r["wrong"],
                inter,
                r["cores"],
            ]
            if link:
                vals.append(r["cpu_us"] / 1e3)
                for key in ("link_share", "wire_share"):
                    share = r.get(key)
                    vals.append(None if share is None else 100 * share)
    base = results.get("strata", {}).get("time_us")
    if base is not None or "strata" in results:
        for impl, r in results.items():
            if impl != "strata":
                t = r.get("time_us")
                vals.append(ratio_cell(t / base) if (t and base) else None)
    streams = [r.get("stream_gbs") for r in results.values() if r.get("stream_gbs")]
    vals.append(streams[0] if streams else None)
    return table.row(vals)


def ratio_cell(ratio: float) -> str:
    """A speedup column's cell: the other implementation's time over strata's, with ``<1``
    after it when strata was slower at that point (a loss shows at a glance in a sweep)."""
    return f"{ratio:.2f}" + (" <1" if ratio < 1 else "   ")


def print_losses(rows: Sequence[dict[str, Any]], write: Callable[[str], Any]) -> None:
    """One line per baseline: the points where strata was slower (speedup below 1.0x)."""
    for impl in dict.fromkeys(r["impl"] for r in rows if r["impl"] != "strata"):
        pts = [r for r in rows if r["impl"] == impl and r.get("speedup_strata") is not None]
        if not pts:
            continue
        low = [r for r in pts if r["speedup_strata"] < 1]
        listed = ", ".join(
            f"{r['op']} {format_size(r['size_bytes'])} {r['speedup_strata']:.2f}x" for r in low
        )
        write(
            f"# strata vs {impl}: {len(low)} of {len(pts)} points below 1.0x"
            + (f" (slower): {listed}" if low else "")
        )


def print_errors(rows: Sequence[dict[str, Any]], write: Callable[[str], Any]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for r in rows:
        if r.get("error"):
            key = (r["impl"], r["op"], r["error"])
            if key not in seen:
                seen.add(key)
                write(f"# error: {r['impl']} {r['op']} {r['dtype']}: {r['error']}")


def print_summary(
    rows: Sequence[dict[str, Any]], impls: Sequence[str], write: Callable[[str], Any]
) -> None:
    write("#")
    total_wrong = sum(r["wrong"] or 0 for r in rows)
    for impl in impls:
        bw = [r["busbw_gbs"] for r in rows if r["impl"] == impl and r.get("busbw_gbs") is not None]
        if bw:
            write(f"# {impl:8s} avg busbw: {float(np.mean(bw)):8.3f} GB/s over {len(bw)} points")
    write(f"# out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    print_losses(rows, write)


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> bool:
    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for r in rows:
        if r.get("busbw_gbs") is None:
            continue
        panel = panels.setdefault(f"{r['op']} {r['dtype']}, {r['ranks']} ranks", {})
        xs, ys = panel.setdefault(r["impl"], ([], []))
        xs.append(r["size_bytes"])
        ys.append(r["busbw_gbs"])
    return plot_lines(
        path,
        panels,
        xlabel="size per rank (bytes)",
        ylabel="busbw (GB/s)",
        title="strata_jax collectives",
    )
