"""Rank 3 (the other fabric of ranks 0-1 under ``--hosts 2``) is SIGKILLed mid-run while every
rank loops on a psum across fabrics: the launcher must name it and exit non-zero."""

import os
import signal

import strata_jax as sj

sj.init()

import jax  # noqa: E402  (after init: it configures the backend)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(20)
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
x = jax.make_array_from_callback(
    (jax.device_count() * 8,), NamedSharding(mesh, P("x")), lambda i: np.ones(8, np.float32)
)
for step in range(1000):
    y = f(x)
    y.block_until_ready()
    if step == 2:
        print(f"step {step} ok", flush=True)
        if jax.process_index() == 3:
            os.kill(os.getpid(), signal.SIGKILL)
