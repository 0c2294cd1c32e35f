"""A stuck rank (``launch -n 2``, ``STRATA_TIMEOUT_S=5``).

Ten psum steps; rank 1 sleeps 120 s at step 5. Rank 0 prints ``RAISED <unix time> after <s>:
<message>`` and re-raises, so the launcher stops the job.
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
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.make_array_from_callback(
    (n, 1000), NamedSharding(mesh, P("x")), lambda i: np.ones((n, 1000), np.float32)[i]
)
for step in range(10):
    if step == 5 and jax.process_index() == 1:
        print("SLEEPING", flush=True)
        time.sleep(120)
    t = time.monotonic()
    try:
        f(x).block_until_ready()
    except Exception as e:
        print(f"RAISED {time.time():.3f} after {time.monotonic() - t:.1f}: {e}", flush=True)
        raise
    print(f"step {step} ok", flush=True)
print("FINISHED", flush=True)
