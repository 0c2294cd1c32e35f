"""Many independent strata collectives in one program, run again and again (they
once hung: independent calls started in different orders on different ranks).

XLA CPU starts independent thunks in whatever order they become ready, differently on each
rank. Before every strata call took the previous one's result as an extra operand
(program_order.py: chain), two ranks of one fabric could each wait in a different
call for the other: under ``launch -n 4 --hosts 2`` this program timed out in 3 of 3 runs.

Usage: python -m strata_jax.launch -n 4 --hosts 2 independent_calls.py [iterations]
Prints ``OK independent <iterations>`` per rank; exits non-zero on a wrong value or an error.
"""

from __future__ import annotations

import sys

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(20)
ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 100
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
mesh = Mesh(np.array(devs), ("x",))
spec = NamedSharding(mesh, P("x"))
K = 24  # independent calls: psum, pmax, tiled all_gather, tiled psum_scatter in turn
SIZES = [256 * (1 + (i * 7) % 13) for i in range(K)]  # per device: 1 to 13 KiB of f32


def body(*xs):
    outs = []
    for i, x in enumerate(xs):
        kind = i % 4
        if kind == 0:
            outs.append(sj.psum(x * (i + 1), "x"))
        elif kind == 1:
            outs.append(sj.pmax(x + i, "x"))
        elif kind == 2:  # XLA work after the call, as in a model: slice, tile
            outs.append(sj.all_gather(x, "x", tiled=True)[: x.shape[0]])
        else:
            outs.append(jnp.tile(sj.psum_scatter(x, "x", tiled=True), N))
    return tuple(outs)


def expected(i: int, g: np.ndarray) -> np.ndarray:
    """The global result of call i on the global input g (N blocks of SIZES[i])."""
    blocks = g.reshape(N, -1)
    kind = i % 4
    if kind == 0:
        return np.tile((blocks * (i + 1)).sum(0), N)
    if kind == 1:
        return np.tile((blocks + i).max(0), N)
    if kind == 2:  # the gathered array's first block, on every device
        return np.tile(blocks[0], N)
    pieces = blocks.sum(0).reshape(N, -1)  # psum_scatter: piece d of the sum, tiled N times
    return np.concatenate([np.tile(pieces[d], N) for d in range(N)])


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * K, out_specs=(P("x"),) * K))
rng = np.random.default_rng(0)  # the same global inputs on every rank
gs = [rng.integers(-8, 8, size=s * N).astype(np.float32) for s in SIZES]
xs = [jax.make_array_from_callback(g.shape, spec, lambda idx, g=g: g[idx]) for g in gs]
for it in range(ITERS):
    out = f(*xs)
    if it % 25 == 0:
        jax.block_until_ready(out)
for i, o in enumerate(out):
    want = expected(i, gs[i])
    per = want.size // N
    for s in o.addressable_shards:
        d = devs.index(s.device)
        got = np.asarray(s.data)
        if not np.array_equal(got, want[d * per : (d + 1) * per]):
            print(f"FAIL call {i} on device {s.device.id}: {got[:4]} vs {want[d * per :][:4]}")
            sys.exit(1)
print(f"OK independent {ITERS}", flush=True)
