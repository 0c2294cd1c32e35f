"""strata_jax.moe low-latency dispatch/combine across processes against numpy.

Run under the launcher: ``python -m strata_jax.launch -n P check_moe_low_latency.py``. Every
process builds the same global tokens, routing and weights from a fixed seed, feeds its own
shards, and checks its output shards: receive rows up to the counts, counts, and the combined
rows, for T in {1, 3, 8, 64, 128} x K in {1, 2, 4} (pull, the default), and push. Exits
non-zero on the first mismatch (rows past the counts must be zero).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import strata_jax as sj

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_reference import ref_plan  # noqa: E402  (tests/moe_reference.py)
from mp_checks import put as put_on  # noqa: E402
from mp_checks import start  # noqa: E402  (tests/mp_checks.py)

info, devs, mesh = start(timeout_s=60)

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

R = len(devs)
spec = P("x")
E_LOCAL, H = 2, 16
checks = 0


def put(a: np.ndarray):
    return put_on(mesh, a)


def fail(msg: str) -> None:
    print(f"MISMATCH {msg}", flush=True)
    sys.exit(3)


def case(seed: int, t: int, k: int, algo: str) -> None:
    global checks
    rng = np.random.default_rng(seed)
    n, e = R * t, R * E_LOCAL
    cap = R * t
    idx = rng.integers(-1, e, (n, k)).astype(np.int32)
    if k >= 2:
        idx[0, :2] = 1
    w = rng.random((n, k)).astype(np.float32)
    x = rng.standard_normal((n, H)).astype(np.float32)
    ey = rng.standard_normal((e, cap, H)).astype(np.float32)
    src, cidx, counts, _ = ref_plan(idx, e, cap)
    kept = cidx >= 0
    rows = np.where(kept[..., None], ey.reshape(-1, H).astype(np.float64)[np.maximum(cidx, 0)], 0)
    want_y = np.einsum("nk,nkh->nh", np.where(kept, w, 0.0), rows)

    def body(x, idx, w, ey):
        recv, cnt, h = sj.moe.low_latency_dispatch(x, idx, num_experts=e, axis_name="x", algo=algo)
        return recv, cnt, sj.moe.low_latency_combine(ey, h, w)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
    recv, cnt, y = f(*map(put, (x, idx, w, ey)))
    tag = f"T={t} K={k} {algo}"
    for s in cnt.addressable_shards:
        if not np.array_equal(np.asarray(s.data), counts[s.index]):
            fail(f"{tag} counts on device {s.device.id}")
    for s in recv.addressable_shards:
        got = np.asarray(s.data)
        e0 = s.index[0].start or 0
        for j in range(got.shape[0]):
            c = counts[e0 + j]
            if not np.array_equal(got[j, :c], x[src[e0 + j, :c]]) or got[j, c:].any():
                fail(f"{tag} recv of expert {e0 + j}")
    for s in y.addressable_shards:
        if not np.allclose(np.asarray(s.data), want_y[s.index], rtol=1e-4, atol=1e-4):
            fail(f"{tag} y on device {s.device.id}")
    checks += 1


seed = 0
# Beyond 8 ranks the largest token counts are left out: the reference's global expert arrays
# grow with ranks x capacity (every token), squared in the ranks.
for t in (1, 3, 8, 64, 128) if R <= 8 else (1, 3, 8):
    for k in (1, 2, 4):
        seed += 1
        case(seed, t, k, "pull")
case(100, 8, 4, "push")
case(101, 64 if R <= 8 else 8, 2, "push")
print(f"OK moe low-latency {checks} cases on {R} ranks, mode {info['registration']}", flush=True)
