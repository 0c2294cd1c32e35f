"""Sizes alternating across the one-shot/two-shot switch, across processes: a 200-step scan
psumming 4 B, 8 MiB, 1028 B and 3 MiB per step.

Run with ``STRATA_TWO_SHOT_BYTES=65536`` under ``launch -n 4``; argument: the number of steps.
Prints ``OK switch <steps> steps wrong=0`` per rank, or exits 3 naming the wrong count.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import strata_jax as sj

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from two_shot_switch import switch_scan  # noqa: E402  (tests/two_shot_switch.py)

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
assert sj.get_two_shot_threshold() == 65536, sj.get_two_shot_threshold()
mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
n = mesh.devices.size
start = jax.make_array_from_callback(
    (n,), NamedSharding(mesh, P("x")), lambda i: np.zeros(n, np.int32)[i]
)
wrong = switch_scan(sj.psum, mesh, steps)(start)
total = sum(int(np.asarray(s.data).sum()) for s in wrong.addressable_shards)
print(f"{'OK' if total == 0 else 'BAD'} switch {steps} steps wrong={total}", flush=True)
sys.exit(0 if total == 0 else 3)
