"""Ranks that fail at start (``launch -n 3``).

Ranks 1 and 2 raise right after init (printing ``FAILING <unix time>`` first); rank 0 enters an
all_gather they never join. The argument is a token the test finds leftover processes by.
"""

from __future__ import annotations

import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if jax.process_index() in (1, 2):
    print(f"FAILING {time.time():.3f}", flush=True)
    raise RuntimeError(f"failed at start on rank {jax.process_index()}")
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
f = jax.jit(
    jax.shard_map(lambda v: sj.all_gather(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
)
x = jax.make_array_from_callback(
    (n,), NamedSharding(mesh, P("x")), lambda i: np.ones(n, np.float32)[i]
)
print(f(x), flush=True)
