"""A rank that never comes, on the second of two simulated hosts.

Run as ``python -m strata_jax.launch -n 4 --hosts 2 stuck_rank_hosts.py`` (one device per
process): a mesh ("host", "x") of 2 x 2, a psum over "x" (inside each host's fabric), once small
(the low-latency path) and once 1 MiB (the general path). Process 3 never calls them; process 2,
its partner on host 1, must time out (STRATA_TIMEOUT_S=3 here) with a message naming the job's
process indices, 2 and 3, and device 3: the fabric numbers its processes 0 and 1 on each host,
which said "process 0" for process 2 before. Processes 0 and 1 (host 0) get the right sums.
Prints ``RAISED <bytes> <message>`` on process 2, ``OK <bytes>`` on processes 0 and 1, and
``DEVICE <id>`` and ``DONE`` on every process.
"""

from __future__ import annotations

import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

TIMEOUT_S = 3.0
sj.set_timeout(TIMEOUT_S)
pid = jax.process_index()
devs = sorted(jax.devices(), key=lambda d: d.id)
assert [d.process_index for d in devs] == [0, 1, 2, 3], devs
print(f"DEVICE {devs[pid].id}", flush=True)
mesh = Mesh(np.array(devs).reshape(2, 2), ("host", "x"))
spec = P(("host", "x"))
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
rng = np.random.default_rng(7)
for count in (64, 1 << 18):  # 256 B per device (low-latency path), then 1 MiB
    a = rng.standard_normal((4, count)).astype(np.float32)
    x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i, a=a: a[i])
    if pid == 3:
        continue  # never calls: its partner on host 1 must time out
    try:
        out = f(x)
        local = np.asarray(out.addressable_shards[0].data)
        host = pid // 2
        want = a[2 * host] + a[2 * host + 1]
        np.testing.assert_allclose(local[0], want, rtol=1e-5, atol=1e-5)
        print(f"OK {count * 4}", flush=True)
    except sj.COLLECTIVE_ERRORS as e:
        print(f"RAISED {count * 4} " + str(e).replace("\n", " "), flush=True)
if pid == 3:
    time.sleep(2 * TIMEOUT_S + 3)  # alive (not disconnected) while process 2 waits for it
print("DONE", flush=True)
