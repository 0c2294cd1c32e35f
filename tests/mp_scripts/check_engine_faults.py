"""Failures of XLA's collectives on strata's engine, under ``launch -n 2``: ranks that disagree
on an all-reduce's size or a collective-permute's, a rank late past the timeout, then a rank
that dies inside a collective. Prints one ``FAULT <name> <seconds> <message>`` line per
failure seen (rank 0's view), ``RECOVERED`` after the disagreements (the next call is right),
and rank 1 SIGKILLs itself at the end while rank 0 waits in an all-reduce."""

import os
import signal
import time

import strata_jax as sj

sj.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

r, n = jax.process_index(), jax.process_count()
mesh = Mesh(np.array(jax.devices()), ("x",))


def local(a):
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), a, (a.size * n,))


def smap(f):
    return jax.jit(shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


psum = smap(lambda v: jax.lax.psum(v, "x"))
ring = smap(lambda v: jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)]))


def expect_failure(name, f, x, expected_wait=0.0):
    """Runs f(x) and prints ``FAULT <name> <seconds> <message>`` (seconds: how long it took past
    `expected_wait`), True; or ``NOFAULT <name>``, False."""
    t = time.perf_counter()
    try:
        f(x).block_until_ready()
    except sj.COLLECTIVE_ERRORS as e:
        msg = str(e).replace("\n", " ")
        print(f"FAULT {name} {time.perf_counter() - t - expected_wait:.2f} {msg[:700]}", flush=True)
        return True
    print(f"NOFAULT {name}", flush=True)
    return False


# Sizes that differ: an all-reduce, then a collective-permute (point to point).
expect_failure("all_reduce_size", psum, local(np.ones(409600 if r == 0 else 409598, np.float32)))
expect_failure("permute_size", ring, local(np.ones(4096 if r == 0 else 4098, np.float32)))
y = psum(local(np.full(1000, r + 1.0, np.float32)))
ok = np.all(np.asarray(y.addressable_shards[0].data) == sum(range(1, n + 1)))
print("RECOVERED" if ok else "WRONG", flush=True)

# A rank late past the timeout (rank 0 fails naming the op; rank 1, late, fails at once).
sj.set_timeout(2.0)
if r == 1:
    time.sleep(3.5)
expect_failure("late", psum, local(np.ones(1000, np.float32)))
sj.set_timeout(30.0)

# A rank that dies inside a collective's wait.
x = local(np.ones(1000, np.float32))
if r == 1:
    time.sleep(1.0)
    print("KILLING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if expect_failure("dead", psum, x, expected_wait=1.0):  # rank 1 dies 1 s in
    os._exit(3)
