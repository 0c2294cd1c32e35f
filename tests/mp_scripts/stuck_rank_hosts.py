"""A rank that never comes, on the second of two simulated hosts.

Run as ``python -m strata_jax.launch -n 4 --hosts 2 stuck_rank_hosts.py`` (one device per
process): psums over "x" (inside each host's fabric) of a mesh ("host", "x") of 2 x 2 that
process 3 never calls; process 2, its partner on host 1, must time out (STRATA_TIMEOUT_S=3 here)
with a message naming the job's process indices, 2 and 3, and device ids: the fabric numbers its
processes 0 and 1 on each host, which said "process 0" for process 2 before. Three calls:
``ll`` (256 B, the low-latency path), ``general`` (1 MiB on a second group, the two devices of
each host in the other order, with the low-latency path off for it: the general path), and
``across`` (a psum over all 4 devices, which runs as steps within each host: process 2 names
process 3; host 0's processes may name each other, and the message says why). Processes 0 and 1
get the right sums for the first two. Prints ``RAISED <call> <message>`` on the processes that
raise, ``OK <call>`` where a call returns right, ``DEVICE <id>`` on every process and ``DONE``
on processes 0, 2 and 3 (the job then ends with process 1 aborted by jax.distributed).
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
rng = np.random.default_rng(7)


def call(name: str, order: list[int], count: int, axes) -> None:
    mesh = Mesh(np.array(devs)[order].reshape(2, 2), ("host", "x"))
    spec = P(("host", "x"))
    f = jax.jit(jax.shard_map(lambda v: sj.psum(v, axes), mesh=mesh, in_specs=spec, out_specs=spec))
    a = rng.standard_normal((4, count)).astype(np.float32)
    x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
    if pid == 3:
        return  # never calls: its partner on host 1 must time out
    try:
        local = np.asarray(f(x).addressable_shards[0].data)
        pos = order.index(pid)
        group = range(4) if axes == ("host", "x") else (pos - pos % 2, pos - pos % 2 + 1)
        np.testing.assert_allclose(local[0], sum(a[g] for g in group), rtol=1e-5, atol=1e-5)
        print(f"OK {name}", flush=True)
    except sj.COLLECTIVE_ERRORS as e:
        print(f"RAISED {name} " + str(e).replace("\n", " "), flush=True)


t0 = time.monotonic()
call("ll", [0, 1, 2, 3], 64, "x")
sj.set_low_latency_threshold(0)  # the next group's first call: the general path
call("general", [1, 0, 3, 2], 1 << 18, "x")
# 512 KiB per rank: too large for its shards to cross inside the check's message
# (STRATA_CHECK_CARRY_BYTES), so host 0 checks, then meets its partner in a strata step and
# names it. A smaller call crosses inside the check's all_gather, where host 0's processes
# wait in XLA's collective for process 2, as process 1 does here.
call("across", [0, 1, 2, 3], 1 << 17, ("host", "x"))
# Every process alive until process 2 has timed out three times (process 3 not disconnected,
# process 0's coordination service up). Process 1 stays in "across": its gloo step waits for
# process 3 until the job ends, and jax.distributed then aborts it.
time.sleep(max(0.0, t0 + 3 * TIMEOUT_S + 4 - time.monotonic()))
print("DONE", flush=True)
