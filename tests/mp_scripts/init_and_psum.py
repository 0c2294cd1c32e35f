"""init() and one psum checked against numpy: the smallest job, for the limit tests
(tests/test_limits.py) to start under a lowered limit. Prints ``OK <rank>`` on success."""

from __future__ import annotations

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

devs = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(np.array(devs), ("x",))
x = np.random.default_rng(0).standard_normal((len(devs), 70000)).astype(np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
out = f(arr)
for s in out.addressable_shards:
    np.testing.assert_allclose(np.asarray(s.data)[0], x.sum(0), rtol=1e-5, atol=1e-5)
print(f"OK {jax.process_index()}", flush=True)
