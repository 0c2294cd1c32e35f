"""An expert rank that receives nothing, across processes (``launch -n 2``).

E=2, K=1, every token to expert 0 (on rank 0; rank 1's expert gets no rows), C=8, expert
f(x) = 3x: y, dL/dx and dL/dw (L = sum y) against numpy on every shard.
Prints ``OK moe-idle <checks> checks`` or exits 3.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import strata_jax as sj

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_reference import moe_idle_expert_reference  # noqa: E402

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(60)
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
R, T, H, E, C = mesh.devices.size, 4, 8, 2, 8
rng = np.random.default_rng(28)
x = rng.standard_normal((R * T, H)).astype(np.float32)
w = rng.random((R * T, 1)).astype(np.float32)
idx = np.zeros((R * T, 1), np.int32)


def put(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x")), lambda i: a[i])


def body(x, idx, w):
    recv, lay = sj.moe.dispatch(x, idx, num_experts=E, axis_name="x", capacity=C)
    return sj.moe.combine(3.0 * recv, lay, w)


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
xg, ig, wg = put(x), put(idx), put(w)
y = f(xg, ig, wg)
gx, gw = jax.jit(jax.grad(lambda x, i, w: f(x, i, w).sum(), argnums=(0, 2)))(xg, ig, wg)
want = moe_idle_expert_reference(x, w)
checks = 0
for name, got, exp in zip(("y", "dx", "dw"), (y, gx, gw), want, strict=True):
    for s in got.addressable_shards:
        g = np.asarray(s.data, np.float64)
        if g.shape != exp[s.index].shape or not np.allclose(g, exp[s.index], rtol=1e-5, atol=1e-5):
            print(f"MISMATCH {name} on device {s.device.id}: {g} vs {exp[s.index]}", flush=True)
            sys.exit(3)
        checks += 1
print(f"OK moe-idle {checks} checks", flush=True)
