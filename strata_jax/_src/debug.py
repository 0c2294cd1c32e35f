"""``STRATA_DEBUG=INFO``: one stderr line per new communicator and per algorithm switch.

NCCL_DEBUG's idea at trace time: the first time this process traces a strata collective over a
group (mesh and axes) it logs the group, and whenever the all-reduce algorithm the size selects
(one-shot / two-shot, as the native library chooses it: ``set_two_shot_threshold``, and from
16 MiB only with two ranks) differs from the previous one for that operator it logs the
switch. Lines start with ``strata_jax INFO [rank R]``. Any other value
(or unset) logs nothing; the check costs one dict lookup per traced call.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from strata_jax._src import operators

_LEVELS = {"INFO": 1, "DEBUG": 2, "TRACE": 2}
_lock = threading.Lock()
_seen_groups: set = set()
_last_algo: dict[str, str] = {}


def level() -> int:
    """``STRATA_DEBUG``: 0 when unset or empty, 1 for ``INFO``, 2 for ``DEBUG``/``TRACE``
    (any case).

    Raises:
      ValueError: naming the variable and the levels to give, for any other value.
    """
    v = os.environ.get("STRATA_DEBUG", "").strip()
    if not v:
        return 0
    if v.upper() not in _LEVELS:
        raise ValueError(f"STRATA_DEBUG={v!r}: give INFO, DEBUG or TRACE, or leave it unset")
    return _LEVELS[v.upper()]


def _rank() -> int:
    try:
        import jax

        return jax.process_index()
    except Exception:  # noqa: BLE001 - no backend yet
        return 0


def log(msg: str) -> None:
    sys.stderr.write(f"strata_jax INFO [rank {_rank()}] {msg}\n")
    sys.stderr.flush()


def on_trace(api: str, x, axis_name) -> None:
    """Called by every public collective while tracing (collectives._profiled)."""
    if not level():
        return
    import jax

    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) if not mesh.empty else {}
    key = (tuple(shape.items()), axes)
    with _lock:
        new_group = key not in _seen_groups
        _seen_groups.add(key)
    size = int(np.prod([shape.get(a, 1) for a in axes]))
    if new_group:
        log(f"new communicator: axes {axes} ({size} ranks) of mesh {shape} (first: {api})")
    op = operators.BY_STATS.get(api)
    if op is None or "two_shot" not in op.algorithms:
        return
    from strata_jax._src import runtime

    leaves = [v for v in jax.tree_util.tree_leaves(x) if hasattr(v, "shape")]
    if not leaves:
        return
    nbytes = max(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves)
    threshold = runtime.get_two_shot_threshold()
    # The native library's own choice (coll/collectives.h: all_reduce_two_shot).
    algo = runtime.native().all_reduce_algorithm(size, nbytes).replace("_", "-")
    with _lock:
        prev = _last_algo.get(api)
        _last_algo[api] = algo
    if prev != algo:
        log(
            f"{api}: {algo} all-reduce for {nbytes} B per rank over {size} ranks (two-shot from "
            f"{threshold} B, with two ranks from {runtime.native().get_two_shot_pair_bytes()} B)"
            + (f", was {prev}" if prev else "")
        )
