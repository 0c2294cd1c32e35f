"""Which engine runs XLA's collectives, and what coverage() says: prints ``ENGINE <engine>``,
``WHY <why>`` and ``COVERAGE <line>`` for a jit + sharding psum of rank 0, and the value."""

import sys

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("x",))
n = jax.device_count()
x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")), lambda i: np.arange(n)[i])
total = jax.jit(lambda v: jnp.sum(v * 1.0), out_shardings=NamedSharding(mesh, P()))(x)
if jax.process_index() == 0:
    # One write per line (print() writes its arguments and the newline separately): gloo's own
    # "[Gloo] Rank 1 is connected to ..." line, written to the same pipe, once landed between
    # "ENGINE" and "gloo".
    for line in (
        f"ENGINE {info['engine']}",
        f"WHY {info['engine_why']}",
        f"COVERAGE {sj.coverage()[-1]}",
        f"TOTAL {float(total)}",
    ):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
