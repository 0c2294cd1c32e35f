"""The operators benchmarks/collectives.py times, as nccl-tests counts them: each one's family,
bus-bandwidth factor, memory traffic and link bound (:class:`OpSpec`), the per-shard program
applying it with strata_jax or jax.lax (:func:`make_body`), fresh random inputs and numpy's
result to check every implementation against (:func:`numpy_reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

AXIS = "x"


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
