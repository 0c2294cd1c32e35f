"""Minimal reproduction, without strata, of XLA CPU's dispatch-ahead deadlock, and its fix.

`for _ in range(1000): y = f(y)` with f a jitted shard_map psum over N in-process CPU devices,
one block at the end, is the shape of every training loop under JAX's async dispatch. On XLA
CPU it deadlocks: every multi-device launch is gang-scheduled (it needs all N threads of the
"XLAPjRtCpuClient" pool at once), the pool has max(PJRT_NPROC or cores, N) threads, and each
launch takes a per-device in-flight slot (32) on a pool thread, blocking that thread once
Python is ~33 launches ahead. The oldest launch then gets only N-1 threads, its collective
waits for the missing participant and XLA aborts after 40 s ("only 7 of 8 arrived"). With at
least 2N pool threads a blocked slot waiter cannot starve a launch. strata_jax sets
PJRT_NPROC=max(64, 2N) at import, before the backend exists.

    python benchmarks/dispatch_ahead.py            # runs each configuration in a subprocess
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
if os.environ.get("REPRO_IMPORT_STRATA") == "1":
    import strata_jax  # noqa: F401
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
n, calls = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_num_cpu_devices", n)
mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x") / n, mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
y = jnp.ones((n * 64,), jnp.float32)
t = time.time()
for _ in range(calls):
    y = f(y)
print("completed", float(y[0]), f"{time.time() - t:.2f}s", "PJRT_NPROC=",
      os.environ.get("PJRT_NPROC"), flush=True)
"""


def run_case(name: str, env_extra: dict[str, str], devices: int, calls: int, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    env.update(env_extra)
    t = time.time()
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(devices), str(calls)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = (p.stdout + p.stderr).strip().splitlines()
        last = next(
            (
                line
                for line in reversed(out)
                if "completed" in line or "arrived" in line or "Error" in line
            ),
            out[-1] if out else "",
        )
        verdict = "ok" if p.returncode == 0 else f"exit {p.returncode}"
        return f"{name:<38} {verdict:<8} {time.time() - t:6.1f}s  {last[:110]}"
    except subprocess.TimeoutExpired:
        return f"{name:<38} {'HUNG':<8} {time.time() - t:6.1f}s  (killed after {timeout:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=90.0)
    args = ap.parse_args(argv)
    n = args.devices
    print(
        f"# {args.calls} chained jax.lax.psum calls on {n} in-process CPU devices, one block "
        f"at the end ({os.cpu_count()} cores)"
    )
    cases = [
        ("jax.lax, PJRT_NPROC unset", {}),
        (f"jax.lax, PJRT_NPROC={n}", {"PJRT_NPROC": str(n)}),
        (f"jax.lax, PJRT_NPROC={2 * n}", {"PJRT_NPROC": str(2 * n)}),
        ("jax.lax after `import strata_jax`", {"REPRO_IMPORT_STRATA": "1"}),
    ]
    for name, extra in cases:
        print(run_case(name, extra, n, args.calls, args.timeout), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
