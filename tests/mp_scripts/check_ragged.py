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


# Small rows: every process holds the global operand, output and reference (they are small).
for dtype, per, max_rows, trailing in (("float32", 1, 5, (3,)), ("int16", 2, 4, (7,))):
    n_rows, m_rows, io, ss, oo, rs = random_plan(rng, R, per, max_rows)
    operand = rng.integers(-50, 50, (R, n_rows, *trailing)).astype(dtype)
    output = rng.integers(-50, 50, (R, m_rows, *trailing)).astype(dtype)
    want = np.stack(ragged_reference(operand, output, io, ss, oo, rs))
    plan = [put(a.astype(np.int32)) for a in (io, ss, oo, rs)]
    check(f"forward {dtype}", jax.jit(exchange)(put(operand), put(output), *plan), want)

# Rows above the allocator's threshold (slices of up to 200 KiB, zero-copy), and their
# gradients. Each rank's operand, output and weights are drawn from a seed of (array, rank), so
# a process makes only its own devices' rows and the rows sent to them: the global arrays and
# references in every process grew with R x R (ragged's share of a process was ~140 MiB at 96
# processes, and the OOM killer ended the job). Beyond 16 ranks the large slices are one per
# sender (the others empty), so that a rank's rows stay ~100-600 whatever R.
DT, TRAIL = np.float64, (64,)
n_rows, m_rows, io, ss, oo, rs = random_plan(
    rng, R, 1, 400 if R <= 16 else 200, filled=None if R <= 16 else 1
)
mine = [i for i, d in enumerate(devs) if d.process_index == jax.process_index()]


def rows(kind: int, r: int) -> np.ndarray:
    """Rank r's operand (kind 0), output (1) or output weights (2), the same in every process."""
    shape = (n_rows if kind == 0 else m_rows, *TRAIL)
    return np.random.default_rng([1234, kind, r]).integers(-50, 50, shape).astype(DT)


def put_rows(kind: int) -> jax.Array:
    n = n_rows if kind == 0 else m_rows
    return jax.make_array_from_callback(
        (R, n, *TRAIL),
        jax.sharding.NamedSharding(mesh, spec),
        lambda idx: np.stack([rows(kind, r) for r in range(R)[idx[0]]]),
    )


class local_want:  # noqa: N801
    """Indexed like the global reference, holding only fn(r) for this process's ranks r (check()
    reads the addressable shards only)."""

    def __init__(self, fn):
        self.by_rank = {r: fn(r) for r in mine}

    def __getitem__(self, idx):
        return np.stack([self.by_rank[r] for r in range(R)[idx[0]]])


def forward_ref(d: int) -> np.ndarray:  # receiver d's result (ragged_reference's rule)
    res = rows(1, d)
    for j in range(R):
        size, o, s = int(ss[j, d]), int(oo[j, d]), int(io[j, d])
        assert int(rs[d, j]) == size, "send_sizes/recv_sizes disagree"
        if size:
            res[o : o + size] = rows(0, j)[s : s + size]
    return res


def grad_operand_ref(j: int) -> np.ndarray:  # sender j's rows get the weights where they land
    g = np.zeros((n_rows, *TRAIL), DT)
    for d in range(R):
        s, o, c = int(io[j, d]), int(oo[j, d]), int(ss[j, d])
        if c:
            g[s : s + c] = rows(2, d)[o : o + c]
    return g


def grad_output_ref(d: int) -> np.ndarray:  # receiver d keeps its weights where nothing lands
    g = rows(2, d)
    for j in range(R):
        o, c = int(oo[j, d]), int(ss[j, d])
        g[o : o + c] = 0
    return g


if R <= 8:  # the per-rank references against the global oracle (small enough to hold)
    g_op, g_out, g_w = (np.stack([rows(k, r) for r in range(R)]) for k in (0, 1, 2))
    g_da, g_db = ragged_grad_reference(g_op, g_w, io, ss, oo, R)
    for r, want_r in enumerate(ragged_reference(g_op, g_out, io, ss, oo, rs)):
        assert np.array_equal(forward_ref(r), want_r), "forward_ref disagrees with the oracle"
        assert np.array_equal(grad_operand_ref(r), g_da[r]), "grad_operand_ref disagrees"
        assert np.array_equal(grad_output_ref(r), g_db[r]), "grad_output_ref disagrees"

plan = [put(a.astype(np.int32)) for a in (io, ss, oo, rs)]
operand_j, output_j, w_j = put_rows(0), put_rows(1), put_rows(2)
check("forward float64", jax.jit(exchange)(operand_j, output_j, *plan), local_want(forward_ref))


def loss(a, b, w, *plan):
    return jnp.sum(exchange(a, b, *plan) * w)


ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(operand_j, output_j, w_j, *plan)
check("grad operand", ga, local_want(grad_operand_ref))
check("grad output", gb, local_want(grad_output_ref))
del ga, gb, operand_j, output_j, w_j

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
