"""Runs several check scripts of this folder one after another in one process of one job, so a
test module pays for starting the processes (importing JAX, ``strata_jax.init()``) once.

Usage (under the launcher): ``run_checks.py SCRIPT [ARGS...] [-- SCRIPT [ARGS...]]...``.
Each script runs as ``__main__`` with its own ``sys.argv``; its ``strata_jax.init()`` finds the
fabric already connected. Before each one ``== run_checks: SCRIPT`` is printed, so a test can
cut the output per script. The first script that raises ends the job (its traceback printed).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> None:
    groups, cur = [], []
    for a in argv:
        if a == "--":
            groups.append(cur)
            cur = []
        else:
            cur.append(a)
    groups.append(cur)
    for script, *args in (g for g in groups if g):
        path = HERE / script
        print(f"== run_checks: {script}", flush=True)
        sys.argv = [str(path), *args]
        if "jax" in sys.modules:  # each script starts from JAX's defaults (some enable x64)
            sys.modules["jax"].config.update("jax_enable_x64", False)
        runpy.run_path(str(path), run_name="__main__")
    print("== run_checks: all done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
