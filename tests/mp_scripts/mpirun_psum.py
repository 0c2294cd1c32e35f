"""A large psum under any launcher (mpirun here): prints what init() and memory_stats() report.

Run as ``mpirun -n 2 python mpirun_psum.py`` (no strata launcher, no LD_PRELOAD unless the test
adds ``strata-run``). Checks the psum against numpy on fresh random inputs and prints one line
``RESULT <json>`` per process with the registration mode init() and memory_stats() report, the
allocator mode, and the zero-copy and staged byte counters after three 16 MiB psums.
"""

import os
import sys

import strata_jax

info = strata_jax.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import report  # noqa: E402  (tests/mp_checks.py)

n_proc, me = jax.process_count(), jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("x",))
count = (16 << 20) // 4  # 16 MiB of float32 per process: well above the allocator's threshold
f = jax.jit(
    jax.shard_map(lambda x: strata_jax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
)
# The psum's input is computed by XLA (as gradients are), not a numpy array XLA may borrow:
# jax's device_put aliases a 64-byte-aligned numpy buffer instead of copying it, and numpy's
# memory is glibc's under the hook (only LD_PRELOAD, e.g. strata-run, makes it pool memory).
double = jax.jit(lambda a: a * 2)
ok = True
for step in range(3):
    inputs = [
        np.random.default_rng([step, p]).standard_normal(count).astype(np.float32)
        for p in range(n_proc)
    ]
    x = double(jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), inputs[me]))
    got = np.asarray(f(x).addressable_shards[0].data)
    ok &= bool(np.allclose(got, 2 * np.sum(inputs, axis=0), rtol=1e-5, atol=1e-5))
ms = strata_jax.memory_stats()
out = {
    "process": me,
    "ok": ok,
    "init_registration": info["registration"],
    "init_allocator": info["allocator"],
    "registration": ms["registration"],
    "allocator_mode": ms["allocator_mode"],
    "zero_copy_bytes": ms["zero_copy_bytes"],
    "staged_bytes": ms["staged_bytes"],
}
report(out, ok)
