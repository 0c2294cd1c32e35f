"""A healthy job whose processes exit at different times (``launch -n 3``).

One psum over every process, checked against numpy; then rank 1 exits at once, rank 0 after
0.5 s (by then rank 1's link has closed) and rank 2 after 2.5 s. Rank 0 must take the normal
jax.distributed shutdown (rank 1 left cleanly, it is not a broken job) and wait there for
rank 2: no "not waiting longer" line, no SIGABRT, exit code 0 everywhere. Prints
``OK clean exit <rank>``.
"""

from __future__ import annotations

import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
x = np.arange(1, n + 1, dtype=np.float32)
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
got = f(jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")), lambda i: x[i]))
assert np.array_equal(np.asarray(got.addressable_data(0)), [x.sum()]), got
rank = jax.process_index()
print(f"OK clean exit {rank}", flush=True)
time.sleep({0: 0.5, 1: 0.0}.get(rank, 2.5))
