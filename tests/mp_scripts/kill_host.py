"""Every rank of the last simulated host SIGKILLs itself mid-run while all ranks loop on a psum
across hosts (``launch --hosts 2 [--netns]``): the survivors must fail fast (strata's timeout
is 20 s here) and the launcher must name the dead ranks. Prints ``step 2 ok`` first."""

import os
import signal

import strata_jax as sj

sj.init()

import jax  # noqa: E402  (after init: it configures the backend)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sj.set_timeout(20)
# Leftovers a host's processes make: a /dev/shm segment and a file in the run dir, both inside
# the simulated host's private tmpfs, gone with it.
for d in ("/dev/shm", os.environ["STRATA_RUN_DIR"]):
    with open(os.path.join(d, f"strata-test-{os.getpid()}"), "wb") as fh:
        fh.write(b"x" * 4096)
topo = sj.topology()
last_host = topo["fabric"] == len(topo["fabrics"]) - 1
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
x = jax.make_array_from_callback(
    (jax.device_count() * 1024,), NamedSharding(mesh, P("x")), lambda i: np.ones(1024, np.float32)
)
for step in range(100_000):
    y = f(x)
    y.block_until_ready()
    if step == 2:
        print(f"step {step} ok", flush=True)
        if last_host:
            os.kill(os.getpid(), signal.SIGKILL)
