"""What the multi-process check scripts (tests/mp_scripts/) share: ranks that disagree on a call
must all fail fast, naming what differs, instead of returning a value or waiting for the timeout.
Imported by the scripts from the tests folder (they put it on ``sys.path``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

import strata_jax as sj


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
