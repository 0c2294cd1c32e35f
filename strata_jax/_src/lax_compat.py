"""Running existing ``jax.lax`` collectives on strata: ``use_for_jax_lax()``, ``enable()``,
``disable()``.

Much of a real program's communication sits in libraries written against ``jax.lax`` (optax's
and flax's ``jax.lax.pmean``, user helpers). While enabled, the ``jax.lax`` collectives that
strata implements (psum, pmean, pmax, pmin, all_gather, psum_scatter, all_to_all, ppermute, and
ragged_all_to_all once strata_jax has it) dispatch, at trace time, to strata_jax's function of
the same name and signature. Where strata cannot run a call it goes to the original jax.lax
function, with one RuntimeWarning per cause: ``axis_index_groups``, positional axes, an axis
name that is not a manual mesh axis of the enclosing ``jax.shard_map`` (vmap axis names, no
shard_map at all), a partly automatic shard_map (``axis_names=`` a subset of the mesh), and
inputs typed ``unreduced``/``reduced`` (JAX's reduced-precision-free sharding types, whose
collectives only jax.lax implements).

How: the ``jax.lax`` attributes are replaced once, at the first ``enable()``, by dispatchers
that read a JAX config state (``strata_use_for_jax_lax``). The state is part of jit's cache
key, so a function traced with it off is traced again with it on and vice versa, and the
context manager is thread-local like every ``jax.config`` context manager. With the state off a
dispatcher calls the original at once. Not caught: names bound before the first ``enable()`` /
``use_for_jax_lax()`` of the process (``from jax.lax import psum`` at the top of a module
imported earlier), and JAX's own internal uses of its collectives, which never go through the
``jax.lax`` namespace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator

import jax
from jax._src import config, core

from strata_jax._src import collectives, ragged

# The jax.lax collectives as jax defines them, captured before any patching.
ORIGINAL: dict[str, Callable] = {
    name: getattr(jax.lax, name)
    for name in (
        "psum",
        "pmean",
        "pmax",
        "pmin",
        "all_gather",
        "psum_scatter",
        "all_to_all",
        "ppermute",
        "ragged_all_to_all",
    )
    if hasattr(jax.lax, name)
}

_state = config.bool_state(
    "strata_use_for_jax_lax",
    False,
    help="Run jax.lax collectives inside jax.shard_map on strata_jax (strata_jax.enable()).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)

_lock = threading.Lock()
_installed = False
_warned: set[str] = set()


def _strata_functions() -> dict[str, Callable]:
    public = {n: getattr(m, n) for m in (collectives, ragged) for n in m.__all__}
    return {n: public[n] for n in ORIGINAL if n in public}


def _leaves_typed_unreduced_or_reduced(x) -> bool:
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, core.Tracer):
            mat = core.typeof(leaf).mat
            if mat.unreduced or mat.reduced:
                return True
    return False


def fallback_cause(axis_name, axis_index_groups, x) -> str | None:
    """Why strata cannot run this call (the warning's text), or None when it can."""
    if axis_index_groups is not None:
        return "axis_index_groups is given (strata groups are mesh axes)"
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if any(isinstance(a, int) for a in axes):
        return "a positional (integer) axis is reduced"
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    if mesh.empty or not manual:
        return "the call is not inside jax.shard_map (e.g. a vmap axis name)"
    if manual != set(mesh.axis_names):
        return "the enclosing jax.shard_map is partly automatic (axis_names= a subset of the mesh)"
    if any(a not in manual for a in axes):
        env = core.get_axis_env()
        if not all(a in manual or env.axis_exists(a) for a in axes):
            return None  # an unbound name (a typo): strata raises its NameError saying so
        return "an axis name is not a mesh axis of the enclosing jax.shard_map (a vmap axis name)"
    if _leaves_typed_unreduced_or_reduced(x):
        return "an input is typed unreduced/reduced (only jax.lax implements those types)"
    return None


def _warn_once(name: str, cause: str) -> None:
    with _lock:
        if cause in _warned:
            return
        _warned.add(cause)
    warnings.warn(
        f"strata_jax.use_for_jax_lax: jax.lax.{name} ran on jax.lax because {cause}; "
        "this warning is shown once per cause.",
        RuntimeWarning,
        stacklevel=4,
    )


def _dispatcher(name: str, original: Callable, strata_fn: Callable) -> Callable:
    sig = inspect.signature(original)
    first = next(iter(sig.parameters))

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if not _state.value:
            return original(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let jax.lax raise its own error
        a = bound.arguments
        cause = fallback_cause(a.get("axis_name"), a.get("axis_index_groups"), a[first])
        if cause is not None:
            _warn_once(name, cause)
            return original(*args, **kwargs)
        return strata_fn(*args, **kwargs)

    dispatch.__strata_original__ = original
    return dispatch


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        for name, fn in _strata_functions().items():
            setattr(jax.lax, name, _dispatcher(name, ORIGINAL[name], fn))
        _installed = True


def enable() -> None:
    """Runs ``jax.lax`` collectives inside ``jax.shard_map`` on strata from now on (process-wide).

    See :func:`use_for_jax_lax` for what is and is not redirected. Functions already traced
    are traced again on their next call (the setting is part of jit's cache key).
    """
    _install()
    jax.config.update("strata_use_for_jax_lax", True)


def disable() -> None:
    """Undoes :func:`enable`: ``jax.lax`` collectives run on jax.lax again."""
    jax.config.update("strata_use_for_jax_lax", False)


def is_enabled() -> bool:
    """Whether ``jax.lax`` collectives currently dispatch to strata (in this thread)."""
    return bool(_state.value)


@contextlib.contextmanager
def use_for_jax_lax(enabled: bool = True) -> Iterator[None]:
    """Context manager: ``jax.lax`` collectives traced inside it run on strata.

    ``jax.lax.psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather`` (``to=`` included),
    ``psum_scatter``, ``all_to_all``, ``ppermute`` (and ``ragged_all_to_all`` when strata_jax
    provides it) called while tracing inside ``jax.shard_map`` (``jax.pmap`` included, which
    JAX runs as a shard_map) lower to strata's custom calls, with jax.lax's semantics. Calls
    strata cannot run (``axis_index_groups``, positional axes, vmap axis names, partly
    automatic shard_map, inputs typed unreduced/reduced) run on jax.lax, with one
    RuntimeWarning per cause. Thread-local; nests; ``use_for_jax_lax(False)`` turns it off
    inside an enabled region.

    Example::

        with strata_jax.use_for_jax_lax():
            grads = train_step(params, batch)   # its jax.lax.pmean runs on strata

    Not caught: a collective bound to a name before the first ``use_for_jax_lax()``/``enable()``
    of the process (``from jax.lax import psum`` in a module imported earlier). A function
    jitted and traced outside is traced again inside (the setting is part of jit's cache key).
    """
    _install()
    with _state(bool(enabled)):
        yield
