"""Measures where strata's all-reduce should switch from one-shot to two-shot.

One-shot: every rank reduces all peers' inputs into its own output (n*S bytes read per rank,
no work split). Two-shot: rank r reduces chunk r once and streams it into every output
(S bytes read per rank, but every rank writes to every peer). The crossover depends on the
machine; this script times both on the same inputs, interleaved call by call, and prints the
smallest size from which two-shot wins at every larger size: the value to use for
STRATA_TWO_SHOT_BYTES / strata_jax.set_two_shot_threshold().

    python benchmarks/allreduce_switch.py --devices 8 --min-bytes 4K --max-bytes 4M
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _args import parse_size  # noqa: E402

import strata_jax as sj  # noqa: E402  (before the JAX backend exists)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--min-bytes", type=parse_size, default=4096)
    ap.add_argument("--max-bytes", type=parse_size, default=4 << 20)
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args(argv)

    import time

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", args.devices)
    n = args.devices
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    f = jax.jit(
        jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    )
    rng = np.random.default_rng(0)
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= args.factor
    print(
        f"# all-reduce switch point, {n} in-process devices, float32, median of "
        f"{args.iters} interleaved calls"
    )
    print(f"# {'bytes':>10} {'one-shot us':>12} {'two-shot us':>12} {'two/one':>8}")
    wins = []
    old = sj.get_two_shot_threshold()
    try:
        for size in sizes:
            x = jax.device_put(
                rng.standard_normal(n * size // 4).astype(np.float32), NamedSharding(mesh, P("x"))
            )
            times: dict[int, list[float]] = {0: [], 1: []}
            for i in range(args.iters + 5):
                for mode in (0, 1):
                    sj.set_two_shot_threshold(1 << 62 if mode == 0 else 0)
                    t = time.perf_counter()
                    f(x).block_until_ready()
                    if i >= 5:
                        times[mode].append(time.perf_counter() - t)
            one, two = (float(np.median(times[m])) * 1e6 for m in (0, 1))
            wins.append(two < one)
            print(f"  {size:>10} {one:>12.1f} {two:>12.1f} {two / one:>8.2f}")
    finally:
        sj.set_two_shot_threshold(old)
    switch = next((sizes[i] for i in range(len(sizes)) if all(wins[i:])), None)
    print(
        f"# two-shot wins from {switch} bytes per rank upward"
        if switch
        else "# two-shot never wins at every larger size in this range"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
