"""``strata-run COMMAND [ARGS]``: run COMMAND with ``libstrata_alloc.so`` preloaded.

Goes after a cluster launcher, e.g. ``mpirun -n 4 strata-run python train.py`` or
``srun strata-run python train.py``: it prepends the allocator library to ``LD_PRELOAD`` (as
``python -m strata_jax.launch`` does for its ranks) and replaces itself with COMMAND (exec: same
process id, so mpirun/srun see their own child). It is optional: ``import strata_jax`` hooks the
allocator into jaxlib without it (see ``strata_jax/_src/allocator.py``); preloading makes every
large allocation of the process fabric memory, not only XLA's, for the cases where the hook
cannot be used (``STRATA_ALLOC_HOOK=0``, a jaxlib that allocates elsewhere).

This module uses only the standard library (it must not import jax).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from strata_jax._src.launch_env import preload_env
from strata_jax.launch import ALLOC_LIBRARY_NAME, ENV_ALLOC_LIB, alloc_library_path

__all__ = ["main", "preload_env"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``strata-run``: execs the command; returns only on error (exit code)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print("usage: strata-run COMMAND [ARGS...]", file=sys.stderr)
        return 0 if args else 2
    lib = alloc_library_path()
    if lib is None:
        print(
            f"strata-run: {ALLOC_LIBRARY_NAME} not found (set {ENV_ALLOC_LIB} or reinstall "
            "strata_jax)",
            file=sys.stderr,
        )
        return 1
    try:
        os.execvpe(args[0], args, preload_env(dict(os.environ), lib))
    except OSError as e:
        print(f"strata-run: cannot run {args[0]!r}: {e}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
