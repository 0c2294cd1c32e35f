"""A job that holds its fabric open for a test to probe from another user.

Run with ``launch -n 2``; argument: a file to wait for. After a psum over registered memory,
rank 0 prints ``HOLD <pid> <run dir> <memfd fd numbers, comma separated> <buffer address>``
and every rank waits (at most 60 s) for the file, then runs one more psum and prints ``OK``.
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

go_file = sys.argv[1]
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
blocks = np.ones(n * (1 << 20), np.float32)  # 4 MiB per rank: served from registered segments
x = jax.make_array_from_callback(blocks.shape, NamedSharding(mesh, P("x")), lambda i: blocks[i])
y = f(x)
y.block_until_ready()
memfds = []
for fd in os.listdir("/proc/self/fd"):
    try:
        if "memfd:" in os.readlink(f"/proc/self/fd/{fd}"):
            memfds.append(fd)
    except OSError:
        pass
addr = y.addressable_shards[0].data.unsafe_buffer_pointer()
if jax.process_index() == 0:
    run_dir = os.environ.get("STRATA_RUN_DIR", "-")
    print(f"HOLD {os.getpid()} {run_dir} {','.join(memfds) or '-'} {addr}", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go_file) and time.monotonic() < deadline:
    time.sleep(0.05)
ok = bool((np.asarray(f(x).addressable_shards[0].data) == n).all())
print("OK" if ok else "WRONG", flush=True)
sys.exit(0 if ok else 5)
