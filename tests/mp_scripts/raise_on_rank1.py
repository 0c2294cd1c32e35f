"""A rank raises after init while the others enter a psum: the launcher must name it fast."""

import strata_jax as sj

sj.init()

import jax  # noqa: E402  (after init: it configures the backend)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("x",))
if jax.process_index() == 1:
    raise RuntimeError("boom on rank 1")
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.make_array_from_callback(
    (jax.device_count(),), NamedSharding(mesh, P("x")), lambda i: np.ones(1, np.float32)
)
print(f(x))
