"""Timing: medians of blocking calls, implementations alternated call by call
(:func:`time_interleaved`), processes aligned before each timed step, the job's per-step time
(its slowest process), and the machine's memory bandwidth (STREAM's "add", run by XLA) to place
a result against. jax is imported inside the functions that need it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def time_calls(
    fn: Callable[..., Any],
    args: Sequence[Any],
    iters: int,
    warmup: int = 2,
    block: Callable[[Any], Any] | None = None,
) -> tuple[list[float], Any]:
    """Call ``fn(*args)`` ``warmup`` times, then ``iters`` times, each blocked to completion.

    Every call is waited for before the next is dispatched: dispatching many multi-device launches
    ahead can deadlock XLA CPU (strata_jax/_src/runtime.py: configure_launch_threads). Returns the
    per-call times in seconds and the last output. ``block`` defaults to ``jax.block_until_ready``.
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
