"""strata_jax.ragged_all_to_all across processes against the numpy oracle.

Run under the launcher: ``python -m strata_jax.launch -n P check_ragged.py``. Every process
builds the same random plans from a fixed seed, feeds its own shard, and checks its result
and its operand/output gradients against numpy; small rows (staged) and rows above the
allocator's threshold (zero-copy). Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import numpy as np

import strata_jax as sj

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import put as put_on  # noqa: E402  (tests/mp_checks.py)
from mp_checks import start  # noqa: E402
from ragged_reference import ragged_grad_reference, ragged_reference, random_plan  # noqa: E402

info, devs, mesh = start(timeout_s=60)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

R = len(devs)
spec = P("x")
rng = np.random.default_rng(1234)
checks = 0


def put(a: np.ndarray):
    return put_on(mesh, a)


def check(name, out, want):
    global checks
    for s in out.addressable_shards:
        got = np.asarray(s.data)
        if not np.array_equal(got, want[s.index]):
            print(f"MISMATCH {name} on device {s.device.id}", flush=True)
            sys.exit(3)
        checks += 1


@partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)
def exchange(a, b, c, d, e, g):
    return sj.ragged_all_to_all(a[0], b[0], c[0], d[0], e[0], g[0], axis_name="x")[None]


# Beyond 16 ranks the large slices are one per sender of up to 100 KiB (the others empty):
# every process holds the global operand, output and their references, which with every slice
# drawn grow with R x R x 100 KiB (64 processes: 400 MiB each; the OOM killer ended the job).
for dtype, per, max_rows, trailing, filled in (
    ("float32", 1, 5, (3,), None),
    ("int16", 2, 4, (7,), None),
    # 200 KiB slices: above the allocator's threshold
    ("float64", 1, 400 if R <= 16 else 200, (64,), None if R <= 16 else 1),
):
    n_rows, m_rows, io, ss, oo, rs = random_plan(rng, R, per, max_rows, filled=filled)
    operand = rng.integers(-50, 50, (R, n_rows, *trailing)).astype(dtype)
    output = rng.integers(-50, 50, (R, m_rows, *trailing)).astype(dtype)
    want = np.stack(ragged_reference(operand, output, io, ss, oo, rs))
    plan = [put(a.astype(np.int32)) for a in (io, ss, oo, rs)]
    check(f"forward {dtype}", jax.jit(exchange)(put(operand), put(output), *plan), want)
    if dtype == "float64":
        w = rng.integers(-3, 4, output.shape).astype(dtype)
        wj = put(w)

        def loss(a, b, w, *plan):
            return jnp.sum(exchange(a, b, *plan) * w)

        ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(put(operand), put(output), wj, *plan)
        want_a, want_b = ragged_grad_reference(operand, w, io, ss, oo, R)
        check("grad operand", ga, want_a)
        check("grad output", gb, want_b)

# On 2 ranks: empty slices whose offsets point past the end move nothing.
if R == 2:
    operand = np.array([[1, 2, 3, 4], [11, 12, 13, 14]], np.float32)[..., None]
    output = np.full((2, 4, 1), -1, np.float32)
    plan = [
        np.array(v, np.int64)
        for v in ([[7, 1], [4, 6]], [[0, 2], [0, 0]], [[9, 1], [4, 5]], [[0, 0], [2, 0]])
    ]
    want = np.array([[-1, -1, -1, -1], [-1, 2, 3, -1]], np.float32)[..., None]
    got = jax.jit(exchange)(put(operand), put(output), *(put(a) for a in plan))
    check("empty slices past the end", got, want)

print(f"OK ragged {checks} checks (process {info['process_id']})", flush=True)
