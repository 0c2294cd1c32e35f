"""What the multi-process check scripts (tests/mp_scripts/) share: ranks that disagree on a call
must all fail fast, naming what differs, instead of returning a value or waiting for the timeout.
Also the pieces every script starts with: init and the mesh, global arrays, shard_map, a
failure's exit. Imported by the scripts from the tests folder (they put it on ``sys.path``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import strata_jax as sj

X = P("x")  # the scripts' one mesh axis, sharded


def local_ones(mesh, spec, n: int, devices: Sequence) -> jax.Array:
    """A global array over ``mesh`` (sharding ``spec``) whose shards on this process's devices
    are ``n`` float32 ones each: with another ``n`` on another process the ranks disagree."""
    rank = jax.process_index()
    local = [d for d in devices if d.process_index == rank]
    sharding = spec if isinstance(spec, NamedSharding) else NamedSharding(mesh, spec)
    return jax.make_array_from_single_device_arrays(
        (len(devices) * n,), sharding, [jax.device_put(np.ones(n, np.float32), d) for d in local]
    )


def expect_fast_failure(
    fn: Callable,
    args: Sequence,
    names: Sequence[str],
    fail: Callable[[str], None],
    label: str,
    within_s: float = 2.0,
) -> tuple[str, float]:
    """Runs ``fn(*args)`` to its end, a call the ranks disagree on: it must raise a collective
    error within ``within_s`` seconds whose message holds every string of ``names``; ``fail``
    is called with what went wrong otherwise. Returns the message and the seconds it took."""
    t = time.monotonic()
    try:
        jax.block_until_ready(fn(*args))
    except sj.COLLECTIVE_ERRORS as e:
        dt = time.monotonic() - t
        msg = str(e)
        if not all(s in msg for s in names) or dt > within_s:
            fail(f"{label} after {dt:.2f} s: {msg[:600]}")
        return msg, dt
    fail(f"{label} returned a value")
    raise AssertionError("unreachable")


def fail(msg: str) -> None:
    """The end of a check script that found something wrong: a FAIL line naming this process,
    exit status 3."""
    print(f"FAIL rank {jax.process_index()}: {msg}", flush=True)
    sys.exit(3)


def start(timeout_s: float | None = None) -> tuple[dict, list, Mesh]:
    """``strata_jax.init()``, the collective timeout, and the mesh ``x`` over every device of
    the job in id order: (init's answer, the devices, the mesh)."""
    info = sj.init()
    if timeout_s is not None:
        sj.set_timeout(timeout_s)
    devs = sorted(jax.devices(), key=lambda d: d.id)
    return info, devs, Mesh(np.array(devs), ("x",))


def put(mesh: Mesh, a: np.ndarray, spec=X) -> jax.Array:
    """The global array ``a`` on ``mesh`` (each process makes its own shards from it)."""
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def shard_mapped(mesh: Mesh, body, out_spec=X, spec=X):
    """``body`` as a jitted shard_map over ``mesh``."""
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec))


def psum_until_killed(elems: int, steps: int, killed: bool) -> None:
    """``steps`` psums of ``elems`` float32 ones per device over every device of the job; after
    the third, a ``step 2 ok`` line and, where ``killed``, this process SIGKILLs itself (the
    others must then fail fast, not loop on)."""
    import os
    import signal

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
    f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=X, out_specs=P()))
    x = put(mesh, np.ones(jax.device_count() * elems, np.float32))
    for step in range(steps):
        f(x).block_until_ready()
        if step == 2:
            print(f"step {step} ok", flush=True)
            if killed:
                os.kill(os.getpid(), signal.SIGKILL)


def report(out: dict, ok: bool) -> None:
    """A check script's result as one ``RESULT <json>`` line (one write: the lines of several
    ranks interleave), then its exit status (0 when ``ok``)."""
    import json

    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.exit(0 if ok else 1)


def on_devices(devs: Sequence) -> tuple[Mesh, Callable, Callable]:
    """The mesh ``x`` over ``devs`` (in that order), with :func:`shard_mapped` and :func:`put`
    bound to it: (mesh, shard_map of a body, global array of a numpy array)."""
    mesh = Mesh(np.array(devs), ("x",))
    return (
        mesh,
        lambda body, out_spec=X: shard_mapped(mesh, body, out_spec),
        lambda a: put(mesh, a),
    )
