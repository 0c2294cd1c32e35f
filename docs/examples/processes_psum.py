"""A complete script for several processes: each holds only its own part of a global array,
and a strata psum inside ``jax.shard_map`` sums over every device of every process::

    python -m strata_jax.launch -n 2 docs/examples/processes_psum.py
    python -m strata_jax.launch -n 2 --devices-per-proc 2 docs/examples/processes_psum.py
    mpirun -n 2 python docs/examples/processes_psum.py      # the same under mpirun or srun
    python docs/examples/processes_psum.py                   # one process, one device

What it shows: ``strata_jax.init()`` first (it joins the job and sets the device count before
JAX creates its backend), a mesh over every device of the job (``jax.devices()``, sorted so
that each process's own form one block), each process building its rows with
``jax.make_array_from_process_local_data`` (no process ever holds the whole array), and each
checking its result against numpy. Every process prints one line,
``process P of N: psum of (R, 8) float32 over D devices matches numpy``.
"""

from __future__ import annotations

import numpy as np

import strata_jax as sj

info = sj.init()  # before any other use of jax

import jax  # noqa: E402  (after init: it configures the backend)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROWS = 4  # rows per device
# Every process's devices, ordered so that each process's own form one block of the mesh (the
# block make_array_from_process_local_data fills from this process's rows).
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices), ("x",))
n, mine = len(devices), jax.local_device_count()
first = [d.process_index for d in devices].index(jax.process_index())

# The same seed everywhere, so that every process can build the reference; each process puts
# only its own devices' rows (rows first*ROWS ... (first + mine)*ROWS - 1) into the array.
full = np.random.default_rng(0).standard_normal((n * ROWS, 8)).astype(np.float32)
local = full[first * ROWS : (first + mine) * ROWS]
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)

f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
out = f(x)  # each device: the sum of every device's (ROWS, 8) block

want = full.reshape(n, ROWS, 8).sum(axis=0)
for shard in out.addressable_shards:
    np.testing.assert_allclose(np.asarray(shard.data), want, rtol=1e-5, atol=1e-5)
print(
    f"process {jax.process_index()} of {jax.process_count()}: psum of {want.shape} float32 over "
    f"{n} device{'s' if n != 1 else ''} matches numpy"
)
