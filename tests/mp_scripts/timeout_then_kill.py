"""A peer that never arrives, then a peer killed with SIGKILL (run with -n 2).

Rank 0 calls a psum that rank 1 never joins: it must fail with a timeout naming rank 1, not
hang. Then rank 1 kills itself with SIGKILL while rank 0 waits in another collective; the
launcher stops rank 0 and must leave no file behind (checked by the test).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import strata_jax as sj

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from strata_jax._src.jax_compat import distributed  # noqa: E402

client = distributed.global_state.client
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.make_array_from_callback(
    (2, 1000),
    jax.sharding.NamedSharding(mesh, P("x")),
    lambda idx: np.ones((2, 1000), np.float32)[idx],
)
f.lower(x).compile()
pid = jax.process_index()
if pid == 0:
    sj.set_timeout(2.0)
    t = time.monotonic()
    try:
        f(x).block_until_ready()
        print("NO-TIMEOUT", flush=True)
        sys.exit(4)
    except Exception as e:  # XlaRuntimeError
        msg = str(e)
        ok = "timed out" in msg and "rank(s) [1]" in msg and "psum" in msg
        print(
            f"TIMEOUT-{'OK' if ok else 'BAD'} after {time.monotonic() - t:.1f} s: {msg[:300]}",
            flush=True,
        )
    client.key_value_set("test/go", "1")
    sj.set_timeout(60.0)
    g = jax.jit(
        jax.shard_map(lambda v: sj.pmax(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    )
    g(x).block_until_ready()  # rank 1 dies instead of joining: the launcher ends this
    print("UNREACHABLE", flush=True)
else:
    client.blocking_key_value_get("test/go", 60_000)
    time.sleep(0.5)  # let rank 0 enter its next collective
    print("KILLING MYSELF", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
