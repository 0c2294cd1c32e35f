"""The workloads' step clock across processes (benchmarks/_timing.py): ``align_processes``
holds every process until the last one arrives, and ``slowest_process`` gives each step the
largest of the processes' times for it (what ``nocomm``, which has no exchange to hold the
processes together, must be charged under the launcher).

Run under the launcher: ``python -m strata_jax.launch -n P check_bench_timing.py``. The last
process arrives 0.4 s late at the barrier; each process reports its own rank-dependent times.
Prints "OK bench timing" per process; raises on a mismatch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import strata_jax as sj

sj.init()

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _timing import align_processes, slowest_process  # noqa: E402

rank, n = jax.process_index(), jax.process_count()
assert n > 1, "run under the launcher with 2 or more processes"
if rank == n - 1:
    time.sleep(0.4)
t0 = time.perf_counter()
align_processes("check")
waited = time.perf_counter() - t0
if rank == 0:
    assert waited > 0.3, f"rank 0 left the barrier after {waited:.3f} s, before the late process"
align_processes("check")  # a second barrier on the same tag: numbered, so it is a new one

mine = [0.001 * (rank + 1), 0.010 * (n - rank), 0.5]
got = slowest_process(mine)
want = [0.001 * n, 0.010 * n, 0.5]
assert len(got) == 3 and all(abs(g - w) < 1e-6 for g, w in zip(got, want, strict=True)), (got, want)
print(f"OK bench timing (rank 0 waited {waited:.2f} s)" if rank == 0 else "OK bench timing")
