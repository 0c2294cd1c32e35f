"""Shared helpers for the strata_jax benchmarks.

Nothing here imports jax at module level, so a benchmark can import this module before it decides
how (and whether) to import ``strata_jax``, which must come before jax creates its CPU backend.

Contents:
  * arguments: :func:`parse_size`, :func:`format_size`, :func:`parse_list`, :func:`size_sweep`
  * timing: :func:`time_calls`, :func:`median`
  * the machine's memory bandwidth: :func:`stream_add_gbs` (STREAM's "add", run by XLA)
  * output: :class:`Table` (nccl-tests-style fixed-width rows), :func:`write_csv`,
    :func:`write_json`, :func:`progress`, :func:`plot_lines`
  * machine description: :func:`machine_info`, :func:`print_machine`
  * the allocator: :func:`reexec_with_allocator`
  * the communication-free bound of a workload: :func:`no_exchange`
  * configurations: :func:`add_preset` (``--preset paper``)
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count: ``"8"``, ``"4K"``, ``"64M"``, ``"1G"``, ``"16MiB"`` (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 64M, 1G)")
    return int(float(m.group(1)) * _SIZE_MULT[m.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Human form of a byte count in binary units: 8 B, 4 KiB, 64 MiB."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult:
            v = nbytes / mult
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes:.0f} B"


def parse_list(
    text: str, choices: Sequence[str] | None = None, *, all_word: str = "all"
) -> list[str]:
    """Parse a comma list (``"a,b"``); ``all_word`` expands to every choice; validates choices."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if choices is not None:
        if all_word in items:
            return list(choices)
        bad = [t for t in items if t not in choices]
        if bad:
            raise ValueError(f"unknown value(s) {bad}; choose from {list(choices)} or {all_word!r}")
    # de-duplicate, keep order
    return list(dict.fromkeys(items))


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes min, min*factor, min*factor**2, ... <= max (nccl-tests' ``-b/-e/-f``); ascending."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad sweep: min={min_bytes} max={max_bytes} factor={factor}")
    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


PRESET_PLACES = ("one_process", "launch")


def processes_env() -> dict[str, Any] | None:
    """This run's processes when there are several, else None (one process, in-process devices).

    Under ``strata_jax.launch``: its environment. Under mpirun or srun (a cluster launcher's
    variables, :func:`strata_jax.launch.cluster_env`): ``num_processes`` and ``process_id`` from
    them and ``local_device_count`` from ``JAX_NUM_CPU_DEVICES`` (default 1); the script then
    calls ``strata_jax.init()``, which starts ``jax.distributed`` from the same variables.
    Returns ``{"num_processes", "process_id", "local_device_count", "by"}`` (``by``:
    ``"strata_jax.launch"`` or the launcher's size variable). Safe before jax is imported.
    """
    from strata_jax.launch import cluster_env, distributed_env  # noqa: PLC0415 (no jax yet)

    d = distributed_env()
    if d is not None:
        return {**d, "by": "strata_jax.launch"}
    var, n, rank = cluster_env()
    if n < 2:
        return None
    devices = os.environ.get("JAX_NUM_CPU_DEVICES", "1")
    return {
        "num_processes": n,
        "process_id": rank,
        "local_device_count": int(devices) if devices.isdigit() else 1,
        "by": var,
    }


def preset_place() -> str:
    """Where this run is, for :func:`add_preset`: ``"launch"`` with several processes (under
    ``strata_jax.launch``, mpirun or srun), else ``"one_process"`` (in-process devices). Reads
    the launchers' environment only: safe before jax is imported."""
    return "one_process" if processes_env() is None else "launch"


def preset_flags(values: dict[str, Any]) -> str:
    """A preset's values as the command-line flags they stand for: ``--d-model 256 --batch 1``."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())


def add_preset(
    parser: Any,
    presets: dict[str, dict[str, dict[str, Any]]],
    argv: Sequence[str] | None,
    why: str = "",
) -> None:
    """Add ``--preset NAME`` to ``parser`` and, when ``argv`` names one, make its values the
    parser's defaults (``parser.set_defaults``): flags given on the command line still win,
    wherever they stand. Call before ``parser.parse_args(argv)``.

    ``presets[name][place]`` maps argparse destinations to values, for each place of
    :data:`PRESET_PLACES` (``"one_process"``: in-process devices; ``"launch"``: several
    processes, under ``strata_jax.launch``, mpirun or srun): a preset may pick its
    configuration by how the run is placed.
    ``--help`` lists every preset's flags per place (after ``--preset NAME``, the defaults shown
    are the preset's). After parsing, ``args.preset`` is the name (or None) and
    ``args.preset_place`` the place it was picked for and ``args.preset_flags`` its values as
    flags, so the JSON written from ``vars(args)`` records all three.
    """
    import argparse  # noqa: PLC0415

    lines = []
    for name, places in presets.items():
        for place in PRESET_PLACES:
            where = "one process" if place == "one_process" else "several processes: launch, mpirun"
            lines.append(f"{name} ({where}): {preset_flags(places[place])}")
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        default=None,
        help=f"a named configuration; its values become the defaults, so flags given "
        f"explicitly still override them. {why} " + "; ".join(lines),
    )
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default=None)
    known, _ = pre.parse_known_args(argv)
    place = preset_place()
    parser.set_defaults(preset_place=place if known.preset else None, preset_flags=None)
    if known.preset:
        values = presets[known.preset][place]
        parser.set_defaults(preset_flags=preset_flags(values), **values)


def preset_line(args: Any, presets: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    """The header line of a run made with ``--preset`` (None without): its name, the place it
    was picked for and its flags (explicit flags on the command line override them)."""
    if not getattr(args, "preset", None):
        return None
    where = "one process" if args.preset_place == "one_process" else "several processes"
    values = presets[args.preset][args.preset_place]
    mine = {k: getattr(args, k) for k in values if getattr(args, k) != values[k]}
    over = f"; overridden on the command line: {preset_flags(mine)}" if mine else ""
    return f"# preset     : {args.preset} ({where}): {preset_flags(values)}{over}"


def auto_iters(nbytes: int, budget: float = 5e8, lo: int = 5, hi: int = 200) -> int:
    """Iterations for one timed point: ``clamp(budget / bytes, lo, hi)``."""
    return int(min(hi, max(lo, budget // max(nbytes, 1))))


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def time_calls(
    fn: Callable[..., Any],
    args: Sequence[Any],
    iters: int,
    warmup: int = 2,
    block: Callable[[Any], Any] | None = None,
) -> tuple[list[float], Any]:
    """Call ``fn(*args)`` ``warmup`` times, then ``iters`` times, each blocked to completion.

    Every call is waited for before the next is dispatched: dispatching many multi-device launches
    ahead can deadlock XLA CPU (see DESIGN.md). Returns the per-call times in seconds and the last
    output. ``block`` defaults to ``jax.block_until_ready``.
    """
    if block is None:
        import jax

        block = jax.block_until_ready
    out = None
    for _ in range(warmup):
        out = block(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = block(fn(*args))
        times.append(time.perf_counter() - t0)
    return times, out


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    iters: int,
    warmup: int = 2,
    block: Callable[[Any], Any] | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
    cpu: dict[str, list[float]] | None = None,
    align: Callable[[], Any] | None = None,
    batch: int = 1,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time several implementations round-robin: call 1 of each, call 2 of each, ...

    Interleaving removes the bias of running one implementation after the other (memory state,
    page-cache and frequency drift favour whoever runs second). Each call is blocked to completion.
    An implementation that raises is dropped (``on_error(name, exc)``; re-raised without it).
    Returns per-name call times (seconds) and last outputs. ``cpu``: filled with each timed
    call's CPU time of this process, all threads, user + system (seconds,
    ``time.process_time``): CPU time over wall time says how many cores a call kept busy.
    ``align``: called before every call, outside the timing (e.g. :func:`align_processes`, so
    that the processes start each call together and no implementation is charged the wait
    for a process that the previous call let finish late).

    ``batch`` > 1: each of the ``iters`` samples is ``batch`` consecutive calls of one
    implementation, timed together and divided by ``batch`` (its CPU time likewise), after
    ``align`` and one more call of the same implementation outside the timing; the
    implementations still alternate sample by sample. This is how nccl-tests and the OSU
    micro-benchmarks time a collective across processes (one barrier, then a loop of calls):
    a barrier between the processes (``align_processes`` goes through the jax.distributed
    coordinator) lets them go 50-150 us apart on this machine, and a single call timed after
    it measures that skew, the same for every implementation, as much as the collective
    (measured: a 1 MiB ppermute between 2 processes, 94 us back to back, 232 us after the
    barrier). The untimed call lets the collective itself bring the processes together.
    """
    if block is None:
        import jax

        block = jax.block_until_ready
    live = dict(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, Any] = {}
    batch = max(1, batch)
    for i in range(warmup + iters):
        for name, fn in list(live.items()):
            if align is not None:
                align()
            calls = batch if i >= warmup else 1  # warm-up rounds: one call each
            try:
                if calls > 1:
                    outs[name] = block(fn())
                c0 = time.process_time()
                t0 = time.perf_counter()
                for _ in range(calls):
                    outs[name] = block(fn())
                dt = (time.perf_counter() - t0) / calls
                dc = (time.process_time() - c0) / calls
            except Exception as e:
                if on_error is None:
                    raise
                on_error(name, e)
                del live[name]
                continue
            if i >= warmup:
                times[name].append(dt)
                if cpu is not None:
                    cpu.setdefault(name, []).append(dc)
    return times, outs


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


_ALIGN_CALLS = 0


def align_processes(tag: str) -> None:
    """Under ``strata_jax.launch`` (several processes): wait until every process reaches this
    call (the jax.distributed coordinator's barrier; names are numbered per call, so every
    process must make the same calls in the same order). One process: returns at once.

    The workloads call it before every timed step, outside the timing, so that every process
    starts the step together: ``nocomm`` has no exchange to hold the processes together, and a
    process that ran ahead would otherwise charge its wait to the next implementation's step.
    """
    global _ALIGN_CALLS
    import jax

    if jax.process_count() == 1:
        return
    from strata_jax._src.jax_compat import distributed

    if distributed.global_state.client is None:  # processes not joined by jax.distributed
        return
    _ALIGN_CALLS += 1
    distributed.global_state.client.wait_at_barrier(f"bench/{tag}/{_ALIGN_CALLS}", 300_000)


def slowest_process(times: Sequence[float]) -> list[float]:
    """Per-step time of the whole job: the largest over the processes of each process's time
    for that step (``times[i]``: this process's seconds for step ``i``; every process passes the
    same number of steps). Collective: every process must call it. One process: ``times``.

    A step is done when its slowest process is done; without an exchange (``nocomm``) the
    first process may finish early, so its own time alone would flatter the bound."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return list(times)
    from jax.experimental import multihost_utils

    allt = np.asarray(multihost_utils.process_allgather(np.asarray(times, np.float32)))
    return [float(v) for v in allt.reshape(jax.process_count(), -1).max(axis=0)]


def _plain_allocator() -> str:
    """What serves XLA's buffers without LD_PRELOAD: the hook ``import strata_jax`` installs
    (strata_jax/_src/allocator.py), or glibc when it is off or strata_jax is not imported."""
    mod = sys.modules.get("strata_jax._src.allocator")
    if mod is None or mod.state["mode"] != "hook":
        why = mod.state["reason"] if mod is not None else "strata_jax not imported"
        return f"glibc ({why}): large XLA buffers are fresh mmapped pages every call"
    return "libstrata_alloc hooked into jaxlib at import strata_jax: XLA buffers from its pool"


def reexec_with_allocator(enabled: bool = True) -> str:
    """Re-run this script under ``LD_PRELOAD=libstrata_alloc.so`` unless it already is, then
    return a line for the header saying which allocator serves XLA's buffers.

    The deployment shape (``python -m strata_jax.launch`` preloads it too): every large XLA
    buffer, of every implementation in the process, comes from the pool's reused, already
    registered memory. Without it glibc serves each large buffer from a fresh mmap, and the
    first-touch page faults (about 2 us per 4 KiB page here) dominate every implementation at
    large sizes. Must run before jax (or anything that allocates large buffers) is imported;
    a no-op when ``enabled`` is false or the library is not found (the line says so).
    """
    if "strata_alloc" in os.environ.get("LD_PRELOAD", ""):
        cap = os.environ.get("STRATA_ALLOC_CACHE_BYTES", "1G")
        return (
            f"libstrata_alloc (LD_PRELOAD, cache {cap}): XLA buffers of every implementation "
            "from its pool"
        )
    if not enabled:
        if processes_env() is not None:
            why = "several processes: the launcher's or mpirun/srun's setting applies"
        else:
            why = "--no-preload, or not run as a script"
        return f"no LD_PRELOAD ({why}): " + _plain_allocator()
    try:
        from strata_jax.launch import alloc_library_path  # no jax backend created yet
    except Exception as e:
        return f"glibc (strata_jax.launch not importable: {type(e).__name__})"
    lib = alloc_library_path()
    if not lib:
        return "glibc (libstrata_alloc.so not found)"
    pre = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{lib}:{pre}" if pre else lib
    # A sweep keeps several sets of 8 x 64 MiB buffers alive (input, reference, each
    # implementation's last output) and frees 512 MiB a call: past the default 1 GiB cap on
    # cached free memory the pool would release and remake segments every call, i.e. fresh
    # pages again. Your own setting wins.
    os.environ.setdefault("STRATA_ALLOC_CACHE_BYTES", "4G")
    sys.stdout.flush()
    # orig_argv keeps the interpreter's own flags (-O, -W, -X, -u); argv alone would drop them.
    args = sys.orig_argv[1:] if hasattr(sys, "orig_argv") else sys.argv
    os.execv(sys.executable, [sys.executable, *args])
    raise AssertionError("unreachable")


def add_expert_chunk_args(group) -> None:
    """``--expert-chunk`` and ``--baseline-expert-chunk`` (train_moe.py, serve_moe.py)."""
    group.add_argument(
        "--expert-chunk",
        type=expert_chunk_arg,
        default=128,
        help="run each expert MLP in chunks of this many rows and skip the chunks no token "
        "was routed to (moe_mlp(expert_chunk=...); strata's low-latency path: on its receive "
        "counts; not strata_ragged, whose ragged_dot covers the received rows only); 'none': "
        "over every capacity row",
    )
    group.add_argument(
        "--baseline-expert-chunk",
        type=expert_chunk_arg,
        default=128,
        help="--expert-chunk for the XLA baselines (xla_sort, xla, nocomm): their blocks per "
        "source rank hold fewer rows each, so their best setting can differ (at 8 experts per "
        "device 'none' measured faster for xla_sort)",
    )
    group.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        help="turn off the in-process re-run under LD_PRELOAD=libstrata_alloc.so (preload: "
        "%(default)s; without it plain glibc: XLA's large buffers of every impl are fresh "
        "mmapped pages each step); under strata_jax.launch the launcher's setting applies",
    )


def allocator_for_script(preload: bool, argv: list[str] | None, script: str) -> str:
    """:func:`reexec_with_allocator` for a benchmark's ``main(argv)``: re-runs only when
    ``script`` (its ``__file__``) is what Python runs (the re-run repeats the command line) and
    not with several processes: ``strata_jax.launch``'s have the launcher's setting, and under
    mpirun/srun the hook ``import strata_jax`` installs serves XLA's buffers (``strata-run``
    preloads it instead)."""
    as_script = argv is None and Path(sys.argv[0]).resolve() == Path(script).resolve()
    return reexec_with_allocator(preload and as_script and processes_env() is None)


def expert_chunk_arg(value: str) -> int | None:
    """argparse type of ``--expert-chunk``: a positive int, or ``none``."""
    if value.strip().lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        import argparse  # noqa: PLC0415

        raise argparse.ArgumentTypeError(
            f"--expert-chunk must be a positive number of rows or 'none', got {value!r}"
        )
    return n


_STREAM_CACHE: dict[tuple[int, int], float] = {}


def stream_add_step(mesh: Any, traffic_bytes: int) -> tuple[Callable[[], Any], int]:
    """One step of STREAM's "add" kernel (McCalpin, https://www.cs.virginia.edu/stream/), run by
    XLA itself on every device of ``mesh`` at once, and the bytes one step moves.

    ``a = a + b`` over float32 arrays sharded across the mesh (``traffic_bytes / 3`` bytes each,
    all devices together), ``a`` donated so the sum is written in place: every byte of ``a`` and
    ``b`` is read once and every byte of ``a`` written once, the 3 units STREAM counts, with no
    hidden read-for-ownership. Returns ``(step, bytes)``: ``step()`` runs one add and returns
    the (unblocked) result; time it like any other implementation, e.g. inside
    ``time_interleaved``, after two warm-up calls (which touch the pages). bandwidth in GB/s =
    ``bytes / seconds / 1e9``. All devices run together, so it is the rate of all cores, i.e. of
    the memory; small sizes run from cache, so their "bandwidth" is the cache's.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = int(mesh.devices.size)
    per = max(16, int(traffic_bytes) // 3 // 4 // n)  # float32 elements per device
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    shape = (n * per,)
    state = {
        "a": jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)(),
        "b": jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=sharding)(),
    }
    add = jax.jit(lambda x, y: x + y, donate_argnums=0, out_shardings=sharding)

    def step() -> Any:
        state["a"] = add(state["a"], state["b"])
        return state["a"]

    return step, 3 * 4 * n * per


def stream_add_gbs(mesh: Any, traffic_bytes: int, repeats: int = 7) -> float:
    """Memory bandwidth of the machine behind ``mesh``'s devices for ``traffic_bytes`` of
    traffic, in GB/s (1e9 B/s): ``stream_add_step`` timed alone, median of ``repeats`` after two
    warm-ups; the max over processes when several run the mesh (every process must call it).
    Cached per (mesh size, traffic) within the process. To place an implementation against the
    bandwidth under the same conditions, time ``stream_add_step`` in the same alternations
    instead (benchmarks/moe.py does).
    """
    import jax
    import numpy as np

    n = int(mesh.devices.size)
    key = (n, max(16, int(traffic_bytes) // 3 // 4 // n))
    if key in _STREAM_CACHE:
        return _STREAM_CACHE[key]
    step, moved = stream_add_step(mesh, traffic_bytes)
    times = []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        if r >= 2:
            times.append(time.perf_counter() - t0)
    t = median(times)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        t = float(np.max(multihost_utils.process_allgather(np.asarray(t, np.float64))))
    gbs = moved / t / 1e9
    _STREAM_CACHE[key] = gbs
    return gbs


# --------------------------------------------------------------------------------------------------
# Tables and files
# --------------------------------------------------------------------------------------------------


@dataclass
class Column:
    header: str
    width: int
    fmt: str = ""  # format spec for numbers, e.g. ".2f"; "" = str()


@dataclass
class Table:
    """Fixed-width text table in the style of nccl-tests (right-aligned columns, '#' headers).

    ``groups`` are optional labels printed above runs of columns, e.g. one per implementation.
    """

    columns: list[Column]
    groups: list[tuple[str, int]] = field(default_factory=list)  # (label, number of columns)
    sep: str = "  "

    def _cell(self, col: Column, value: Any) -> str:
        if value is None:
            s = "-"
        elif isinstance(value, float) and col.fmt:
            s = "nan" if value != value else format(value, col.fmt)
        else:
            s = str(value)
        return s.rjust(col.width)

    def header_lines(self) -> list[str]:
        lines = []
        if self.groups:
            parts = []
            i = 0
            for label, n in self.groups:
                cols = self.columns[i : i + n]
                w = sum(c.width for c in cols) + len(self.sep) * (n - 1)
                parts.append(label.center(w, "-") if label else " " * w)
                i += n
            lines.append("#" + self.sep.join(parts))
        lines.append("#" + self.sep.join(c.header.rjust(c.width) for c in self.columns))
        return lines

    def row(self, values: Sequence[Any]) -> str:
        return " " + self.sep.join(
            self._cell(c, v) for c, v in zip(self.columns, values, strict=True)
        )


def speed_sentence(name: str, t_this: float, base: str, t_base: float, goal: float = 1.3) -> str:
    """One line that says which side is faster: "# speed: strata step is 1.97x faster than
    xla (271.9 vs 535.0 ms median; goal >= 1.3x faster: met)". Times in seconds."""
    s = t_base / t_this
    return (
        f"# speed: {name} step is {max(s, 1 / s):.2f}x {'faster' if s >= 1 else 'slower'} than "
        f"{base} ({1e3 * t_this:.1f} vs {1e3 * t_base:.1f} ms median; goal >= {goal:g}x "
        f"faster: {'met' if s >= goal else 'not met'})"
    )


def communication_share(
    t_base: float,
    t_strata: float,
    t_nocomm: float,
    base: str,
    what: str = "step",
    t_meet: float | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """How much of the baseline's time is exchange, and how much of that strata removes.

    ``share = (t_base - t_nocomm) / t_base``: the baseline's time spent exchanging, measured
    against ``nocomm`` (the baseline's computation with every exchange free);
    ``removed = (t_base - t_strata) / (t_base - t_nocomm)``: the part of that time strata
    does not spend (1 = as fast as free exchanges; above 1 when strata's own computation is
    also cheaper; undefined, None, when nocomm is not faster than the baseline). Times in
    seconds (medians of the same turns). Returns the two ``#`` lines and the numbers for the
    JSON (``comm_share``, ``strata_removes``, the three times).

    With ``t_meet`` (the ``meet`` impl: nocomm whose exchanges still make the ranks meet, see
    :func:`no_exchange`) a third line splits the exchange time: ``meeting = (t_meet - t_nocomm)
    / (t_base - t_nocomm)`` is the part spent waiting for the slowest rank, which no synchronous
    exchange avoids, and ``removed_moving = (t_base - t_strata) / (t_base - t_meet)`` is how much
    of the rest (moving the bytes) strata removes (JSON: ``meet_s``, ``meeting_share``,
    ``strata_removes_of_moving``; None where undefined).
    """
    exch = t_base - t_nocomm
    share = exch / t_base if t_base > 0 else float("nan")
    removed = (t_base - t_strata) / exch if exch > 0 else None
    lines = [
        f"# communication: the {base} {what} spends {100 * share:.0f}% of its time exchanging "
        f"(against nocomm: {1e3 * t_base:.2f} vs {1e3 * t_nocomm:.2f} ms median)",
        (
            f"# strata removes {100 * removed:.0f}% of that time (({base} - strata) / "
            f"({base} - nocomm) = ({1e3 * t_base:.2f} - {1e3 * t_strata:.2f}) / "
            f"({1e3 * t_base:.2f} - {1e3 * t_nocomm:.2f}); goal >= 85%: "
            f"{'met' if removed >= 0.85 else 'not met'}"
            + (
                "; above 100%: strata's step also computes less than the baseline's)"
                if removed > 1
                else ")"
            )
            if removed is not None
            else f"# strata removes: undefined (nocomm is not faster than {base} here)"
        ),
    ]
    data = {
        "baseline": base,
        "what": what,
        "baseline_s": t_base,
        "strata_s": t_strata,
        "nocomm_s": t_nocomm,
        "comm_share": share,
        "strata_removes": removed,
    }
    if t_meet is not None:
        meeting = (t_meet - t_nocomm) / exch if exch > 0 else None
        moving = t_base - t_meet
        # Below 2% of the baseline's time the ratio is noise over noise (800% in a short run).
        removed_moving = (t_base - t_strata) / moving if moving > 0.02 * t_base else None
        lines.append(
            f"# meeting: with the ranks still meeting at every exchange but no bytes moved "
            f"(meet, {1e3 * t_meet:.2f} ms median) "
            + (
                f"{100 * meeting:.0f}% of the exchange time is waiting for the slowest rank, "
                f"which no synchronous exchange avoids"
                if meeting is not None
                else "the split is undefined (nocomm is not faster than the baseline)"
            )
            + (
                f"; strata removes {100 * removed_moving:.0f}% of the rest (({base} - strata) / "
                f"({base} - meet))"
                if removed_moving is not None
                else f"; meet is within 2% of {base}'s time: moving the bytes costs too little "
                "here to say how much of it strata removes"
            )
        )
        data.update(meet_s=t_meet, meeting_share=meeting, strata_removes_of_moving=removed_moving)
    return lines, data


def bound_sentence(t_nocomm: float, base: str, t_base: float) -> str:
    """The communication-free bound, in the words of :func:`speed_sentence`. Times in seconds."""
    return (
        f"# bound: {base} with free communication (nocomm) is {t_base / t_nocomm:.2f}x faster "
        f"than {base} ({1e3 * t_nocomm:.1f} vs {1e3 * t_base:.1f} ms median): the most that any "
        f"faster exchange can give {base}'s computation at these sizes"
    )


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write dict rows to CSV; the header is the union of keys in first-seen order."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(keys), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


class _NoBar:
    """Stand-in for a tqdm bar when tqdm is missing or output is disabled."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(s: str) -> None:
        print(s, flush=True)


def progress(total: int, desc: str = "", enable: bool = True) -> Any:
    """A tqdm progress bar on stderr (tqdm is in the optional ``bench`` extra); a no-op without it.

    Print through ``bar.write(line)`` so table rows and the bar do not interleave.
    """
    if enable:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
            bar.write = lambda s: tqdm.write(s, file=sys.stdout)  # type: ignore[method-assign]
            return bar
        except ImportError:
            pass
    return _NoBar()


NO_MATPLOTLIB = "no plot: matplotlib is not installed (pip install '.[bench]')"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed (the
    ``bench`` extra brings it); callers say so with :data:`NO_MATPLOTLIB`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_lines(
    path: Path,
    panels: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx2: bool = True,
) -> bool:
    """One subplot per panel, one line per series: ``panels[panel][series] = (xs, ys)``.

    Uses matplotlib's Agg backend; returns False (and writes nothing) if matplotlib is missing.
    """
    plt = pyplot()
    if plt is None:
        return False
    n = max(1, len(panels))
    ncols = min(n, 3)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax, (name, series) in zip(list(axes.flat)[: len(panels)], panels.items(), strict=True):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if logx2:
            ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# Machine description
# --------------------------------------------------------------------------------------------------

ENV_VARS = (
    "PJRT_NPROC",
    "NPROC",
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "JAX_NUM_CPU_DEVICES",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return format_size(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return "?"


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _cmdline(pid: int) -> tuple[list[str], int] | None:
    """(argv, parent pid) of a process, from /proc; None if it cannot be read."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], int(stat.rsplit(")", 1)[1].split()[1])


def run_command() -> str:
    """How this benchmark was started, as the user typed it (what the docs print above each
    generated table).

    A benchmark may run under the launcher (``python -m strata_jax.launch -n 4 <script>``), or
    start the launcher or its own children itself (``collectives.py --procs 4``,
    ``registration.py``): the outermost of this process's ancestors (up to 6 up) that runs
    the launcher or this same script is taken; else this process's own ``python <script>
    <args>``.
    """
    script = os.path.basename(sys.argv[0])
    best = [sys.executable, sys.argv[0], *sys.argv[1:]]
    pid = os.getppid()
    for _ in range(6):
        if pid <= 1:
            break
        found = _cmdline(pid)
        if found is None:
            break
        words, pid = found
        launched = any(w == "strata_jax.launch" or w.endswith("strata-launch") for w in words)
        if launched or any(os.path.basename(w) == script for w in words[1:2]):
            best = words
    if best and os.path.basename(best[0]).startswith("python"):
        best = ["python", *best[1:]]
    return shlex.join(
        os.path.relpath(w) if w.endswith(".py") and os.path.isabs(w) else w for w in best
    )


# What "+dirty" looks at: the code a benchmark measures, not the docs around it.
CODE_PATHS = ("strata_jax", "native", "benchmarks", "CMakeLists.txt", "pyproject.toml")


def git_commit() -> str | None:
    """The commit of the checkout the benchmark runs from (``+dirty`` if it has uncommitted
    changes to the tracked files of :data:`CODE_PATHS`), or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(here.parent),
                "status",
                "--porcelain",
                "--untracked-files=no",
                *CODE_PATHS,
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info(extra_env_prefixes: Sequence[str] = ("STRATA_",)) -> dict[str, Any]:
    """CPU model, cores, memory, versions and the environment variables that change behaviour,
    with the command, the git commit and the load average (1, 5, 15 min) at the time of the call.

    Call after jax is imported if jax's own facts (devices) are wanted; it is imported lazily here.
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    env.update(
        {k: v for k, v in os.environ.items() if any(k.startswith(p) for p in extra_env_prefixes)}
    )
    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": run_command(),
        "commit": git_commit(),
        "load_avg": list(os.getloadavg()),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "memory": _mem_total(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            m: _version(m)
            for m in ("jax", "jaxlib", "numpy", "strata_jax", "mpi4jax")
            if _version(m) is not None
        },
        "env": env,
    }
    if "jax" in sys.modules:
        import jax

        try:
            devs = jax.devices()
            info["jax_backend"] = jax.default_backend()
            info["jax_devices"] = len(devs)
            info["jax_local_devices"] = jax.local_device_count()
            info["jax_processes"] = jax.process_count()
        except Exception as e:  # backend failed to start: report, do not die here
            info["jax_devices_error"] = repr(e)
    return info


def print_machine(info: dict[str, Any], write: Callable[[str], Any] = print) -> None:
    if "command" in info:
        load = ", ".join(f"{v:.2f}" for v in info.get("load_avg", []))
        write(f"# command    : {info['command']}")
        write(f"# commit     : {info.get('commit')}  date {info['date']}  load average {load}")
    write(f"# host       : {info['host']}  ({info['platform']})")
    write(
        f"# cpu        : {info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), "
        f"{info['memory']} RAM"
    )
    vers = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    write(f"# versions   : python {info['python']}, {vers}")
    if "jax_devices" in info:
        write(
            f"# jax        : backend {info['jax_backend']}, {info['jax_devices']} devices, "
            f"{info['jax_processes']} process(es), {info['jax_local_devices']} local"
        )
    env = info["env"]
    envs = " ".join(f"{k}={v}" for k, v in env.items()) if env else "(none set)"
    write(f"# env        : {envs}")


# --------------------------------------------------------------------------------------------------
# The communication-free bound
# --------------------------------------------------------------------------------------------------

NOCOMM_DESC = (
    "the baseline's computation with every jax.lax exchange replaced by identity (wrong "
    "results: the bound no communication library can beat at this size)"
)


def _meeting(axis_name: Any) -> Callable[[Any], Any]:
    """Identity on a pytree that waits until every rank of ``axis_name`` has reached it: one
    strata psum of its arrays' first elements (float32, one per array: bytes that do not count),
    on which each array's first element then depends (+ 0), so everything after the exchange
    waits for it in the compiled program too, and no two meetings merge. Its VJP meets again,
    as the exchange it replaces has one in the backward pass (all_to_all's transpose is an
    all_to_all; psum's cotangent crosses back in shard_map). Leaves that are not JAX arrays
    (``psum(1, axis)``) pass through untouched, as in nocomm; with no array leaf there is no
    meeting."""
    import jax
    import jax.numpy as jnp

    import strata_jax

    def meet(xs: list[Any]) -> list[Any]:
        real = [i for i, x in enumerate(xs) if x.size and x.dtype != jax.dtypes.float0]
        if not real:
            return xs
        firsts = [xs[i].reshape(-1)[:1].astype(jnp.float32) for i in real]
        tok = strata_jax.psum(jnp.concatenate(firsts), axis_name)
        out = list(xs)
        for j, i in enumerate(real):
            # The data depend on the meeting: + 0 from the psum's result (nan_to_num: 0 whatever
            # the sum is), one elementwise pass that XLA fuses into the next loop fusion where
            # it can. An optimization barrier would not do: XLA:CPU drops it when compiling,
            # and the work after the exchange ran before the meeting; updating one element in
            # place made XLA copy the array twice.
            zero = jnp.nan_to_num(tok[j] * 0.0).astype(xs[i].dtype)
            out[i] = xs[i] + zero
        return out

    f = jax.custom_vjp(meet)
    f.defvjp(lambda xs: (meet(xs), None), lambda _, g: (meet(list(g)),))

    def apply(tree: Any) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        if not idx:
            return tree
        for i, x in zip(idx, f([leaves[i] for i in idx]), strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    return apply


@contextlib.contextmanager
def no_exchange(meet: bool = False):
    """While a program is traced: ``jax.lax.all_to_all``, ``psum`` and ``pmean`` return their
    operand unchanged (the shape-preserving exchanges the workloads use: all_to_all with equal
    split and concat axes). The program then does the baseline's computation and no
    communication; its step time is the bound that no communication library can beat at this
    size (the ``nocomm`` impl of train_moe.py, train_recsys.py and serve_moe.py). Its values are
    wrong by design and are never compared.

    ``meet=True`` (the ``meet`` impl): each replaced exchange still makes the ranks of its axis
    meet (:func:`_meeting`: a 1-element strata psum, forward and backward), so the step pays
    the synchronisation of every exchange but moves no bytes. ``meet - nocomm`` is the part of
    the exchange time that is waiting for the slowest rank (with more ranks than cores: for a
    core), which no synchronous exchange avoids; ``baseline - meet`` is what moving the bytes
    costs."""
    import jax

    def all_to_all(x, axis_name, split_axis, concat_axis, **kw):
        if split_axis != concat_axis:
            raise ValueError(
                "no_exchange: all_to_all with split_axis != concat_axis changes the shape"
            )
        return _meeting(axis_name)(x) if meet else x

    def reduce(x, axis_name, **kw):
        return _meeting(axis_name)(x) if meet else x

    saved = {k: getattr(jax.lax, k) for k in ("all_to_all", "psum", "pmean")}
    jax.lax.all_to_all = all_to_all
    jax.lax.psum = jax.lax.pmean = reduce
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(jax.lax, k, v)
