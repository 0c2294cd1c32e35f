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
over each other implementation (``time_other / time_strata``), ``<1`` after each point where
strata was slower, and the summary lists those points per baseline. A progress bar runs on stderr
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
deadlocks XLA CPU (see DESIGN.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

try:
    import _common as C
except ImportError:  # imported as a module from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common as C

AXIS = "x"
IMPLS = ("strata", "xla", "mpi", "mpi4jax")
CHILD_ENV = "STRATA_BENCH_CHILD"  # set on the processes this script re-launches under --procs
LINK_ENV = "STRATA_BENCH_LINK_GBIT"  # the link rate of this launch (--netns --link-gbit)
RESULT_ENV = "STRATA_BENCH_RESULT"  # a file where a re-launched run writes its JSON's path
WIRE = "_wire"  # the wire floor's program among the timed ones (Runner.wire_fn)
MPI_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    name: str
    # nccl-tests family: allreduce, allgather, reducescatter, alltoall, sendrecv, broadcast
    kind: str
    divisible: bool  # count must be a multiple of N
    reduces: bool  # float results may differ by rounding (summation order)

    def busbw_factor(self, n: int) -> float:
        if self.kind == "allreduce":
            return 2 * (n - 1) / n
        if self.kind in ("allgather", "reducescatter", "alltoall"):
            return (n - 1) / n
        return 1.0

    def min_traffic(self, nbytes: int, n: int) -> int:
        """Bytes the op must move through memory, all n ranks together (the algorithm's floor):
        every input byte read once and every output byte written once. size = nbytes as in
        nccl-tests (all_gather: the output per rank; psum_scatter: the input per rank)."""
        if self.kind in ("allgather", "broadcast"):
            return (n + 1) * nbytes  # inputs total nbytes (broadcast: the root's), n outputs
        if self.kind == "reducescatter":
            return (n + 1) * nbytes  # n inputs of nbytes, outputs total nbytes
        return 2 * n * nbytes  # allreduce, alltoall, sendrecv: n inputs and n outputs

    def link_bytes(self, nbytes: int, hosts: int, per_host: int) -> float:
        """The fewest bytes each host must send to the others (and receive from them) for this
        op, size = nbytes as in nccl-tests, with ``hosts`` hosts of ``per_host`` ranks each and
        shared memory free inside a host (derivation: docs/guide/hosts.md, "The link bound").
        all-reduce: 2(H-1)/H * size (a host's partial sums are one buffer of size; the
        bandwidth-optimal all-reduce of H nodes); all_gather (size = output) and psum_scatter
        (size = input): (H-1)/H * size; all_to_all: L(H-1)/H * size (every row a rank sends to
        another host crosses, nothing combines); ppermute (ring): size (one pair leaves each
        host); pbroadcast: size (each host but the source's must receive it)."""
        h, s = hosts, float(nbytes)
        if h < 2:
            return 0.0
        if self.kind == "allreduce":
            return 2 * (h - 1) / h * s
        if self.kind in ("allgather", "reducescatter"):
            return (h - 1) / h * s
        if self.kind == "alltoall":
            return per_host * (h - 1) / h * s
        return s  # sendrecv (ring: one pair leaves each host), broadcast

    def in_count(self, count: int, n: int) -> int:
        """Per-rank input elements for a `count`-element size buffer."""
        return count // n if self.kind == "allgather" else count


OPS: dict[str, OpSpec] = {
    "psum": OpSpec("psum", "allreduce", False, True),
    "pmean": OpSpec("pmean", "allreduce", False, True),
    "pmax": OpSpec("pmax", "allreduce", False, False),
    "pmin": OpSpec("pmin", "allreduce", False, False),
    "all_gather": OpSpec("all_gather", "allgather", True, False),
    "psum_scatter": OpSpec("psum_scatter", "reducescatter", True, True),
    "all_to_all": OpSpec("all_to_all", "alltoall", True, False),
    "ppermute": OpSpec("ppermute", "sendrecv", False, False),
    "pbroadcast": OpSpec("pbroadcast", "broadcast", False, False),
}


def make_body(lib: Any, op: str, n: int) -> Callable[[Any], Any]:
    """The per-shard function applying `op` over AXIS with `lib` (strata_jax or jax.lax)."""
    if op in ("psum", "pmean", "pmax", "pmin"):
        f = getattr(lib, op)
        return lambda x: f(x, AXIS)
    if op == "all_gather":
        return lambda x: lib.all_gather(x, AXIS, axis=0, tiled=True)
    if op == "psum_scatter":
        return lambda x: lib.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
    if op == "all_to_all":
        return lambda x: lib.all_to_all(x, AXIS, 0, 0, tiled=True)
    if op == "ppermute":
        perm = [(i, (i + 1) % n) for i in range(n)]
        return lambda x: lib.ppermute(x, AXIS, perm)
    if op == "pbroadcast":
        return lambda x: lib.pbroadcast(x, AXIS, 0)
    raise ValueError(op)


class _LaxForBench:
    """jax.lax, except pbroadcast, which has no CPU lowering: its documented equivalent."""

    def __getattr__(self, name: str) -> Any:
        import jax

        return getattr(jax.lax, name)

    @staticmethod
    def pbroadcast(x: Any, axis_name: str, source: int) -> Any:
        import jax
        import jax.numpy as jnp

        is_bool = x.dtype == jnp.bool_
        y = x.astype(jnp.uint8) if is_bool else x
        y = jax.lax.psum(jnp.where(jax.lax.axis_index(axis_name) == source, y, 0), axis_name)
        return y.astype(jnp.bool_) if is_bool else y


# --------------------------------------------------------------------------------------------------
# Context: what the per-process body needs (single process with N devices, or P processes)
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Inputs and checking
# --------------------------------------------------------------------------------------------------


def random_array(
    rng: np.random.Generator, n_total: int, dtype: np.dtype, n_ranks: int
) -> np.ndarray:
    """Fresh random data: floats in [-1, 1); ints small enough that a sum over ranks fits."""
    if dtype == np.bool_:
        return rng.integers(0, 2, n_total, dtype=np.uint8).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        hi = min(int(info.max) // n_ranks, 1 << 20)
        lo = 0 if info.min == 0 else -hi
        return rng.integers(lo, hi, n_total, dtype=dtype, endpoint=True)
    if np.issubdtype(dtype, np.complexfloating):
        real = np.float64 if dtype.itemsize == 16 else np.float32
        re_ = rng.random(n_total, dtype=real) * 2 - 1
        im_ = rng.random(n_total, dtype=real) * 2 - 1
        return (re_ + 1j * im_).astype(dtype)
    gen = np.float64 if dtype == np.float64 else np.float32
    x = rng.random(n_total, dtype=gen)
    x *= 2
    x -= 1
    return x.astype(dtype, copy=False)


def float_tolerance(dtype: np.dtype, n: int, amax: float) -> float:
    """Bound on |a - b| for two sums of n terms |x| <= amax in any order, each with (n-1) roundings.

    Each sum is within (n-1) * u * n * amax of the exact one (u = eps/2), so the two are within
    (n-1) * n * eps * amax. Accumulating in higher precision (strata for bf16/f16) only tightens it.
    """
    import ml_dtypes  # a jax dependency; its finfo also knows bfloat16 and the float8s

    eps = float(ml_dtypes.finfo(dtype).eps) if dtype.kind == "V" else float(np.finfo(dtype).eps)
    return max(1, n - 1) * n * eps * amax


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]


def local_pieces(arr: Any) -> list[np.ndarray]:
    """This process's shards of `arr`, in device-id order, as numpy arrays."""
    shards = getattr(arr, "addressable_shards", None)
    if shards is None:
        return [np.asarray(arr)]
    return [np.asarray(s.data) for s in sorted(shards, key=lambda s: s.device.id)]


def count_wrong(
    out: list[np.ndarray], ref: list[np.ndarray], tol: float | None
) -> tuple[int, float]:
    """(#elements differing, max |difference|) between local pieces; exact when tol is None."""
    wrong, maxerr = 0, 0.0
    for a, b in zip(out, ref, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return max(a.size, b.size, 1), float("inf")
        if a.size == 0:
            continue
        if tol is None:
            a2 = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)
            b2 = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1)
            wrong += int(np.count_nonzero((a2 != b2).any(axis=1)))  # bitwise equal
            if wrong and a.dtype.kind in "iub":
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                maxerr = max(maxerr, float(d.max()))
        else:
            wide = np.complex128 if a.dtype.kind == "c" else np.float64
            d = np.abs(a.astype(wide) - b.astype(wide))
            wrong += int(np.count_nonzero(~(d <= tol)))  # NaN counts as wrong
            maxerr = max(maxerr, float(np.nanmax(d)) if np.isfinite(d).any() else float("inf"))
    return wrong, maxerr


def numpy_reference(op: str, host: np.ndarray, n: int) -> list[np.ndarray] | None:
    """Each rank's expected output of ``make_body(op)`` on the global input ``host`` (rank r's
    input is block r), from numpy alone; None where numpy's meaning is not the op's (max/min of
    complex numbers, a sum of booleans, a mean of complex numbers). Sums are taken in float64 /
    complex128 / int64 and rounded once: within ``float_tolerance`` of any summation order."""
    x = host.reshape(n, -1)
    c = x.shape[1]
    kind = host.dtype.kind
    if op == "pmean":  # psum / n, as jax.lax: an integer (bool: int32) sum wraps, then float32
        if kind in "iub":
            acc = np.int32 if kind == "b" else host.dtype
            red = x.sum(axis=0, dtype=acc).astype(np.float32) / np.float32(n)
            return [red] * n
        if kind == "c":
            return None
        return [(x.astype(np.float64).sum(axis=0) / n).astype(host.dtype)] * n
    if op in ("psum", "pmax", "pmin", "psum_scatter"):
        if kind == "b" and op in ("psum", "psum_scatter"):
            return None
        if kind == "c" and op in ("pmax", "pmin"):
            return None
        if op in ("pmax", "pmin"):
            red = (np.max if op == "pmax" else np.min)(x, axis=0)
        else:
            # bfloat16 and the other ml_dtypes floats have kind "V": summed in float64 too
            wide = {"c": np.complex128, "i": np.int64, "u": np.uint64}.get(kind, np.float64)
            red = x.astype(wide).sum(axis=0).astype(host.dtype)
        if op == "psum_scatter":
            return list(red.reshape(n, c // n))
        return [red] * n
    if op == "all_gather":
        return [host] * n
    if op == "all_to_all":
        blocks = x.reshape(n, n, c // n)  # [source, destination, chunk]
        return [blocks[:, r].reshape(-1) for r in range(n)]
    if op == "ppermute":  # make_body's ring: rank i sends to i + 1
        return [x[(r - 1) % n] for r in range(n)]
    if op == "pbroadcast":  # make_body's source: rank 0
        return [x[0]] * n
    raise ValueError(op)


# --------------------------------------------------------------------------------------------------
# Per-process body
# --------------------------------------------------------------------------------------------------


@dataclass
class Point:
    op: str
    dtype: np.dtype
    count: int  # elements of the size buffer
    nbytes: int  # size in bytes (nccl-tests' size)
    iters: int  # timed samples
    warmup: int
    batch: int = 1  # consecutive calls per timed sample (C.time_interleaved)


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
    C.auto_iters) are timed as at least 3 samples of up to ``batch`` consecutive calls."""
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
        it = iters if iters is not None else C.auto_iters(nbytes)
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
        self.libs: dict[str, Any] = {"xla": _LaxForBench(), "mpi": _LaxForBench()}
        if "strata" in impls:
            self.libs["strata"] = _strata
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
        stream = C.stream_add_gbs(ctx.mesh, traffic)
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
            tick(f"{pt.op} {C.format_size(pt.nbytes)} {impl}")
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
        align = (lambda: C.align_processes("collectives")) if ctx.process_count > 1 else None
        times, last = C.time_interleaved(
            fns,
            pt.iters,
            max(0, pt.warmup - 1),
            on_error=on_error,
            cpu=cpu,
            align=align,
            batch=pt.batch,
        )
        wire_s = ctx.max_across(C.median(times[WIRE])) if WIRE in times else None
        wire_cpu = ctx.sum_across(C.median(cpu[WIRE])) if WIRE in cpu else None
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
            t = ctx.max_across(C.median(times[impl]))
            # CPU time of every process together per call, over the call's time: the cores the
            # call kept busy (this machine's core count bounds it; at that bound a faster
            # implementation is one that burns less CPU, not one that waits less).
            cpu_s = ctx.sum_across(C.median(cpu[impl]))
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
    if _strata is None or len(_strata.topology()["fabrics"]) < 2:
        return None
    if impl != "strata":
        return pt.nbytes // ctx.n if pt.op == "all_gather" else pt.nbytes
    import jax

    before = _strata.comm_stats()["inter_fabric_bytes"]
    jax.block_until_ready(fn())
    local = max(1, len(jax.local_devices()))
    return int(ctx.max_across(float(_strata.comm_stats()["inter_fabric_bytes"] - before) / local))


# --------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------


def make_table(impls: Sequence[str], link: bool = False) -> C.Table:
    cols = [
        C.Column("size(B)", 12),
        C.Column("count", 11),
        C.Column("dtype", 9),
        C.Column("op", 12),
    ]
    if link:
        cols.append(C.Column("link(us)", 10, ".1f"))
        cols.append(C.Column("wire(us)", 10, ".1f"))
        cols.append(C.Column("wcpu(ms)", 8, ".1f"))
    groups: list[tuple[str, int]] = [("", len(cols))]
    for impl in impls:
        cols += [
            C.Column("time(us)", 11, ".1f"),
            C.Column("algbw", 7, ".2f"),
            C.Column("busbw", 7, ".2f"),
            C.Column("%mem", 5, ".0f"),
            C.Column("#wrong", 7),
            C.Column("inter(B)", 10),
            C.Column("cores", 5, ".2f"),
        ]
        if link:
            cols.append(C.Column("cpu(ms)", 7, ".1f"))
            cols.append(C.Column("%link", 5, ".0f"))
            cols.append(C.Column("%wire", 5, ".0f"))
        groups.append((f" {impl} ", 10 if link else 7))
    others = [i for i in impls if i != "strata"] if "strata" in impls else []
    for o in others:
        cols.append(C.Column(f"{o}/strata", max(12, len(o) + 7)))
    if others:
        groups.append((" speedup ", len(others)))
    cols.append(C.Column("stream", 7, ".2f"))
    groups.append(("", 1))
    return C.Table(cols, groups)


def table_row(
    table: C.Table, pt: Point, results: dict[str, dict[str, Any]], link_us: float | None = None
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
            f"{r['op']} {C.format_size(r['size_bytes'])} {r['speedup_strata']:.2f}x" for r in low
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
    return C.plot_lines(
        path,
        panels,
        xlabel="size per rank (bytes)",
        ylabel="busbw (GB/s)",
        title="strata_jax collectives",
    )


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


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
        "-b", "--min-bytes", "--minbytes", type=C.parse_size, default=8,
        help="smallest size per rank (default 8)",
    )  # fmt: skip
    p.add_argument(
        "-e", "--max-bytes", "--maxbytes", type=C.parse_size, default="64M",
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
        a.ops = C.parse_list(a.op, list(OPS))
        a.impls = C.parse_list(a.impl, IMPLS)
        a.sizes = C.size_sweep(a.min_bytes, a.max_bytes, a.factor)
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
            f"| {op} | {C.format_size(size)} | {ms(bound)} | {wires} | {pct(sg, 'link_share')} |"
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
    allocator = C.reexec_with_allocator(not args.no_preload and not multi)

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
        dtypes = [np.dtype(jnp.dtype(d)) for d in C.parse_list(args.dtype)]
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

    info = C.machine_info()
    info["strata_jax"] = "imported" if _strata is not None else f"unavailable: {_STRATA_ERROR!r}"
    write("# strata_jax collectives benchmark (nccl-tests style)")
    C.print_machine(info, write)
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
        " time_other / time_strata, for every baseline run, '<1' after a point where strata"
        " was slower (listed again at the end)"
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
    bar = C.progress(len(points), "collectives", enable=main_proc and not args.no_progress)
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
        C.write_csv(out / f"{stem}.csv", rows)
        C.write_json(
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
