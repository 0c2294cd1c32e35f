"""A loop of checked psums that a test disturbs from outside (SIGSTOP, SIGKILL) (fault campaign).

Arguments: elements per rank, number of calls, optionally a file to wait for after a
failure (so the job stays up while the test examines the other ranks). Prints ``PID <rank>
<pid>``, ``LOOPING`` once compiled and warmed up, then per rank either ``DONE <rank> <calls>``,
``FAILED <rank> call <i> after <s>: <message>`` or ``WRONG <rank> call <i>`` (a value was
returned, and it was wrong); ``FDS <rank> <n>`` (open fds when warm) and, after a failure,
``FDS-AFTER <rank> <n>``. Exit codes: 0 done, 3 failed, 5 wrong.
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
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
blocks = np.repeat(np.arange(1, n + 1, dtype=np.float32), elems)
x = jax.make_array_from_callback(blocks.shape, NamedSharding(mesh, P("x")), lambda i: blocks[i])
want = np.float32(n * (n + 1) / 2)
f(x).block_until_ready()
print(f"FDS {rank} {len(os.listdir('/proc/self/fd'))}", flush=True)
print("LOOPING", flush=True)
failed = False
for i in range(calls):
    t = time.monotonic()
    try:
        got = np.asarray(f(x).addressable_shards[0].data)
    except Exception as e:
        msg = " ".join(str(e).split())[:600]
        print(f"FAILED {rank} call {i} after {time.monotonic() - t:.1f}: {msg}", flush=True)
        failed = True
        break
    if not (got == want).all():
        print(f"WRONG {rank} call {i}: {np.unique(got)[:5]}", flush=True)
        sys.exit(5)
if not failed:
    print(f"DONE {rank} {calls}", flush=True)
    sys.exit(0)
print(f"FDS-AFTER {rank} {len(os.listdir('/proc/self/fd'))}", flush=True)
if go_file:
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.05)
sys.exit(3)
