"""A plain JAX data-parallel training script that knows nothing of strata_jax: it calls
jax.distributed.initialize() and trains with jit + NamedSharding (XLA's partitioner all-reduces
the gradients). tests/test_engine.py runs it with ``python -m strata_jax.launch --wrap``."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

jax.distributed.initialize()
mesh = Mesh(np.array(jax.devices()), ("data",))
n = jax.device_count()
rng = np.random.default_rng(0)
w = jax.device_put(rng.standard_normal((16, 4)).astype(np.float32), NamedSharding(mesh, P()))
batch = NamedSharding(mesh, P("data"))
x = jax.device_put(rng.standard_normal((8 * n, 16)).astype(np.float32), batch)
y = jax.device_put(rng.standard_normal((8 * n, 4)).astype(np.float32), batch)


@jax.jit
def step(w, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)
    return loss, w - 0.1 * grad


for _ in range(3):
    loss, w = step(w, x, y)
    print("loss", float(loss))
