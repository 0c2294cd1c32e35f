"""``python -m strata_jax.wrap SCRIPT [ARGS]``: run an unmodified JAX script on strata.

For a script that does not know strata_jax (plain ``jax.jit`` with shardings, ``pmap``,
``shard_map``, Flax, optax...): it imports strata_jax before jax (so XLA's collectives between
processes run on strata's engine), calls :func:`strata_jax.init` (``jax.distributed`` and the
shared-memory fabric, from the launcher's or mpirun/srun's environment), then runs SCRIPT as
``__main__`` with ARGS as its ``sys.argv[1:]``, as ``python SCRIPT ARGS`` would. A
``jax.distributed.initialize(...)`` the script makes itself then returns at once: the
processes are already connected (its arguments must not name another job).

``python -m strata_jax.launch -n 4 --wrap SCRIPT`` starts each rank this way; under mpirun or
srun: ``mpirun -n 4 python -m strata_jax.wrap SCRIPT``.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    """Entry point: init(), then SCRIPT as ``__main__``; exits with usage on no SCRIPT."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m strata_jax.wrap SCRIPT [ARGS...]")
        sys.exit(0 if args else 2)
    script = args[0]
    if not os.path.isfile(script):
        print(f"strata_jax.wrap: no script {script!r}", file=sys.stderr)
        sys.exit(2)

    import strata_jax  # noqa: I001  (before jax: the engine between processes is chosen here)

    strata_jax.init()

    import jax

    real = jax.distributed.initialize

    def initialize(*a, **kw) -> None:
        """jax.distributed.initialize after strata_jax.init(): already connected."""
        if jax.distributed.is_initialized():
            return None
        return real(*a, **kw)

    jax.distributed.initialize = initialize
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
