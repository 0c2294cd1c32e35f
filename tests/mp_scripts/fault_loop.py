"""A loop of checked psums that a test disturbs from outside (SIGSTOP, SIGKILL) (fault campaign).

Arguments: elements per rank, number of calls, optionally a file to wait for after a
failure (so the job stays up while the test examines the other ranks). Prints ``PID <rank>
<pid>``, ``LOOPING`` once compiled and warmed up, then per rank either ``DONE <rank> <calls>``,
``FAILED <rank> call <i> after <s>: <message>`` or ``WRONG <rank> call <i>`` (a value was
returned, and it was wrong); ``FDS <rank> <n>`` (open fds when warm) and, after a failure,
``FDS-AFTER <rank> <n>``. Exit codes: 0 done, 3 failed, 5 wrong. With ``FAULT_LEAD=r`` the
other ranks sleep 20 ms before each call, so rank r is nearly always inside a call, its buffer
published to (and being read by) its peers.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

elems, calls = int(sys.argv[1]), int(sys.argv[2])
go_file = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
rank = jax.process_index()
print(f"PID {rank} {os.getpid()}", flush=True)
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
s_total = n * (n + 1) / 2


def step(v):
    # psum of the blocks 1..n, scaled back to this rank's own block: the output equals the
    # input exactly, so calls chain on the device and the loop spends its time in the psum.
    return sj.psum(v, "x") * ((jax.lax.axis_index("x") + 1) / s_total)


def fds() -> tuple[int, int]:
    """(open fds other than the staged form's bounce buffers, bounce buffers): a staged call
    (shm_ll.h) keeps its bounce buffer until every peer has read it, so a rank stopped before
    reading leaves its peers one more buffer, which they reuse once it reads (or never, if it
    dies): bounded, and counted apart."""
    names = []
    for d in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{d}"))
        except OSError:
            pass
    bounces = sum("strata_bounce" in n for n in names)
    return len(names) - bounces, bounces


f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
blocks = np.repeat(np.arange(1, n + 1, dtype=np.float32), elems)
x = jax.make_array_from_callback(blocks.shape, NamedSharding(mesh, P("x")), lambda i: blocks[i])
x = f(x).block_until_ready()
print(f"FDS {rank} {fds()[0]}", flush=True)
print("LOOPING", flush=True)
failed = False
lead = int(os.environ.get("FAULT_LEAD", "-1"))
for i in range(calls):
    if lead >= 0 and rank != lead:
        time.sleep(0.02)  # the lead rank arrives first and waits with its buffer published
    t = time.monotonic()
    try:
        x = f(x).block_until_ready()
        if i % 16 == 15 or i == calls - 1:  # a strided sample, copied off the device
            got = np.asarray(x.addressable_shards[0].data[::4099])
        else:
            got = None
    except Exception as e:
        msg = " ".join(str(e).split())[:600]
        print(f"FAILED {rank} call {i} after {time.monotonic() - t:.1f}: {msg}", flush=True)
        failed = True
        break
    if got is not None and not (got == rank + 1).all():
        print(f"WRONG {rank} call {i}: {np.unique(got)[:5]}", flush=True)
        sys.exit(5)
if not failed:
    print(f"DONE {rank} {calls}", flush=True)
    sys.exit(0)
print(f"BOUNCES-AFTER {rank} {fds()[1]}", flush=True)
print(f"FDS-AFTER {rank} {fds()[0]}", flush=True)
if go_file:
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.05)
sys.exit(3)
