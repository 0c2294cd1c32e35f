"""Sizes alternating across the one-shot/two-shot switch, shared by tests/test_unusual_inputs.py
(in one process) and mp_scripts/switch_scan.py (across processes).

A jitted scan whose every step psums four arrays of 4 B, 8 MiB, 1028 B and 3 MiB (f32), on both
sides of the one-shot/two-shot switch. Step s on rank r holds a[i] = r + ((s + i) mod 5): small
integers, so every sum is exact in f32 and each step's expected value, n(n-1)/2 + n ((s + i) mod 5),
differs from its neighbours' (a result paired with another step's call would be counted as wrong).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SWITCH_SIZES = (1, 2 << 20, 257, 786432)  # f32 elements: 4 B, 8 MiB, 1028 B, 3 MiB
SWITCH_THRESHOLD = 65536  # STRATA_TWO_SHOT_BYTES of the check


def switch_scan(psum, mesh, steps: int):
    """jit(shard_map(scan)) returning, per device, the wrong elements of each step: i32[n*steps]."""
    n = mesh.devices.size

    def body(start):
        r = jax.lax.axis_index("x").astype(jnp.float32)

        def step(carry, s):
            wrong = jnp.int32(0)
            for size in SWITCH_SIZES:
                pat = ((s + jnp.arange(size, dtype=jnp.int32)) % 5).astype(jnp.float32)
                got = psum(r + pat, "x")
                wrong += jnp.sum(got != n * (n - 1) / 2 + n * pat, dtype=jnp.int32)
            return carry, wrong

        _, wrong = jax.lax.scan(step, 0, start[0] + jnp.arange(steps, dtype=jnp.int32))
        return wrong

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
