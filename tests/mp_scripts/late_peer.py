"""A peer late at ``strata_jax.init()`` (``launch -n 2``, or ``mpirun -n 2``).

Every rank calls ``jax.distributed.initialize`` itself and creates its JAX backend
(``jax.devices()``); then rank 1 sleeps ``argv[1]`` seconds before ``strata_jax.init(timeout_s=
argv[2])`` while rank 0 calls it at once. If init returns, a psum over both processes is
checked against numpy and ``OK late_peer`` printed. ``argv[3]`` (optional) is where init fails:
``arrive`` (default: a late arrival), ``never`` (rank 1 never calls init; it sleeps),
``die`` (rank 1 exits with code 7 instead of calling init). With ``argv[4] == "strata"``
nobody calls ``jax.distributed.initialize`` by hand: init() starts it (the launcher's usual
way), so the late peer misses ``jax.distributed``'s own connection wait. ``argv[5]``
(optional, default 1) is the late rank: 0 makes the coordinator itself the late one.
"""

from __future__ import annotations

import os
import sys
import time

import jax

from strata_jax import launch

late, timeout = float(sys.argv[1]), float(sys.argv[2])
how = sys.argv[3] if len(sys.argv) > 3 else "arrive"
by_hand = (sys.argv[4] if len(sys.argv) > 4 else "hand") == "hand"
late_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
env = launch.distributed_env()  # None under mpirun: jax.distributed detects Open MPI itself
if by_hand:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if env is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=env["coordinator_address"],
            num_processes=env["num_processes"],
            process_id=env["process_id"],
        )
    jax.devices()  # the backend exists before strata_jax.init, as in the report

import numpy as np  # noqa: E402

import strata_jax as sj  # noqa: E402

rank = env["process_id"] if env else int(os.environ["OMPI_COMM_WORLD_RANK"])
if rank == late_rank:
    if how == "die":
        time.sleep(late)
        print("DYING", flush=True)
        os._exit(7)
    time.sleep(late if how == "arrive" else 3600)
t0 = time.monotonic()
try:
    sj.init(timeout_s=timeout)
except Exception as e:
    print(f"INIT FAILED after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}", flush=True)
    raise

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
x = np.arange(1, n + 1, dtype=np.float32)
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
got = f(jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")), lambda i: x[i]))
got = np.asarray(got.addressable_data(0))
assert np.array_equal(got, [x.sum()]), got
print(f"OK late_peer psum {got[0]:g}", flush=True)
