"""The one door to JAX's internals: what strata_jax reaches inside ``jax._src``, and what each
supported JAX release changed there.

strata_jax supports jax/jaxlib 0.10.2 through 0.12.1 (``TESTED``; both ends run in CI). Its
primitives, lowering rules and the lowerings it wraps (program order, the jax.lax hooks, the
all-reduce combiner) need JAX's internal modules; every other module of strata_jax imports them
from here, by these names, so a JAX release that moves something is met in this file alone.
What moved between the ends of the range, and how it is met:

- ``jax._src.core.ClosedJaxpr``: a class wrapping a ``Jaxpr`` and its consts up to 0.10; an alias
  of ``Jaxpr`` from 0.11.0 (a ``Jaxpr`` carries its consts; ``.jaxpr`` returns itself); removed
  in 0.12.0. :data:`ClosedJaxpr`, :func:`is_jaxpr`, :func:`map_closed`, :func:`as_closed`.
- ``core.Jaxpr(constvars, invars, ...)``: from 0.11 constvars given without consts become plain
  leading inputs, so a jaxpr is never rebuilt field by field here, only with ``Jaxpr.replace``
  (which keeps the consts on every release).
- ``mlir.ir_consts`` takes ``const_lowering`` from 0.12.1 (consts hoisted to the entry
  function resolve to its arguments): :func:`ir_consts`.
- ``mlir.register_lowering`` gained the keyword ``shard_map_collective_rule`` in 0.12.1; a rule
  registered again without it keeps JAX's, so :func:`register_lowering` passes only what it
  is given.
- jax.lax's collective primitives: 0.11 adds ``pxor``, ``pbroadcast_dynamic``,
  ``pmax_scatter``/``pmin_scatter``, ``unreduced_pmax``/``unreduced_pmin``; 0.12 drops
  ``psum_start``, ``pbroadcast_start``, ``unreduced_psum_start`` and
  ``unreduced_reduce_scatter_start``. :func:`lax_primitive` returns None for a name the running
  release lacks.
- ``jax_use_rgv3`` (0.11.0, on): jax.lax's own psum/all_gather/psum_scatter/all_to_all lower
  with a mesh-axes replica-group attribute; strata builds its own XLA collectives
  (``hierarchy/``) with dense replica groups, which every release accepts.
- ``jax_raise_on_ppermute_sort_diff`` (0.11.1, on): ``jax.lax.ppermute`` over several axes in an
  order other than the mesh's raises (it used to sort the group into mesh order, which JAX
  calls a wrong answer). ``strata_jax.ppermute`` accepts any order and indexes the group in
  the order given (as ``axis_index``) on every release; ``jax.lax.ppermute`` under
  ``use_for_jax_lax()`` does what the running release does (:func:`jax_ppermute_order`).
- The non-Shardy shard_map lowering is folded into one rule in 0.12.1; strata wraps whatever
  rule is registered (:func:`lowering_rule`), never a named private function.
- The FFI C API moved from 0.3 (jaxlib 0.10) to 0.5 (0.12), keeping old versions working: the
  extension builds against the FFI headers of the jaxlib it is built with (CMakeLists.txt).
- ``xla_bridge.register_backend_initialization_hook``: removed in 0.11.0;
  :func:`on_backend_created` wraps the CPU backend's factory there.
- Open MPI 5's mpirun: JAX 0.11+ finds its coordinator through mpi4py by itself, 0.10 only
  when asked (:func:`cluster_detection_kwargs`).
- Removed in 0.11.0 and not used here: ``jax.core.abstract_token`` (``jax.ffi`` has it), the
  ``jax.lax.pvary`` shim (``jax.lax.pcast(x, axes, to="varying")`` is used instead).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import ad_checkpoint, config, core, custom_derivatives, distributed, pjit, xla_bridge
from jax._src import shard_map as _shard_map
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import parallel as lax_parallel
from jax._src.lax.control_flow import conditionals, loops
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.sharding_impls import SPMDAxisContext, UnspecifiedValue

__all__ = [
    "JAX_VERSION",
    "cond_p",
    "custom_jvp_call_p",
    "jit_p",
    "remat_p",
    "scan_p",
    "shard_map_p",
    "while_p",
    "BROKEN",
    "TESTED",
    "ClosedJaxpr",
    "SPMDAxisContext",
    "UnspecifiedValue",
    "ad",
    "as_closed",
    "backends_created",
    "batching",
    "cluster_detection_kwargs",
    "config",
    "core",
    "cpu_async_dispatch",
    "distributed",
    "held_back_atexit",
    "hlo",
    "ir",
    "ir_consts",
    "is_closed",
    "is_jaxpr",
    "jax_ppermute_order",
    "lax_parallel",
    "lax_primitive",
    "lowering_rule",
    "map_closed",
    "on_backend_created",
    "open_jaxpr",
    "mlir",
    "pe",
    "register_lowering",
    "warn_if_untested",
    "xla_bridge",
]


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


JAX_VERSION: tuple[int, ...] = _version(jax.__version__)
# The releases the test suite runs on in CI (both ends); pyproject.toml accepts everything from
# the first on, with no upper bound (a newer release gets one warning: ``warn_if_untested``).
TESTED: tuple[str, str] = ("0.10.2", "0.12.1")
# Releases known to break strata_jax (pyproject.toml leaves them out), and how.
BROKEN: dict[str, str] = {
    "0.11.2": "its XLA segfaults compiling a shard_map program whose custom call has an empty "
    "operand (a zero-size collective, MoE with no tokens)",
}


def warn_if_untested() -> None:
    """One UserWarning when the running jax or jaxlib is newer than the newest tested release
    (nothing is changed: the user's JAX stays as installed)."""
    import jaxlib

    newest = _version(TESTED[1])
    found = {name: v for name, v in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__))}
    for name, v in found.items():
        if v in BROKEN:
            warnings.warn(
                f"strata_jax does not work with {name} {v}: {BROKEN[v]}. Use another release "
                f"(tested: {TESTED[0]} to {TESTED[1]}).",
                UserWarning,
                stacklevel=3,
            )
            return
    # Any release after the newest tested one, a patch release too: JAX's x.y.z releases
    # break things as well (0.11.1's ppermute rule, 0.11.2's XLA crash, 0.12.1's lowering).
    newer = {name: v for name, v in found.items() if _version(v) > newest}
    if newer:
        what = ", ".join(f"{name} {v}" for name, v in newer.items())
        warnings.warn(
            f"strata_jax is tested with jax/jaxlib {TESTED[0]} to {TESTED[1]}; this is {what}. "
            "It may work; if something fails, pin jax and jaxlib to a tested release "
            f'(pip install "jax<={TESTED[1]}" "jaxlib<={TESTED[1]}") and report it.',
            UserWarning,
            stacklevel=3,
        )


def jax_ppermute_order() -> str:
    """How the running release's ``jax.lax.ppermute`` indexes a group over several mesh axes
    named in an order other than the mesh's (``axis_name=("b", "a")`` on an ``("a", "b")``
    mesh): ``"mesh"`` up to 0.11.0 (it sorted the group into mesh order, which 0.11.1 calls a
    wrong answer: ``axis_index`` counts in the given order); ``"raise"`` from 0.11.1 while
    ``jax_raise_on_ppermute_sort_diff`` is on (the default: it raises at lowering);
    ``"given"`` from 0.11.1 with it off (the order of ``axis_name``, as ``axis_index``)."""
    flag = getattr(config, "raise_on_ppermute_sort_diff", None)
    if flag is None:
        return "mesh"
    return "raise" if flag.value else "given"


def cluster_detection_kwargs() -> dict:
    """What ``jax.distributed.initialize`` needs to find an mpirun job that its default
    detection misses: Open MPI 5's mpirun (PRRTE) gives no ORTE URI, so JAX finds the
    coordinator through mpi4py; JAX 0.11+ hands over to mpi4py by itself, 0.10 only when asked
    (``cluster_detection_method="mpi4py"``), which this returns where mpi4py is installed."""
    ompi5 = "OMPI_COMM_WORLD_SIZE" in os.environ and "OMPI_MCA_orte_hnp_uri" not in os.environ
    if JAX_VERSION < (0, 11) and ompi5 and importlib.util.find_spec("mpi4py") is not None:
        return {"cluster_detection_method": "mpi4py"}
    return {}


# --- the backend -----------------------------------------------------------------------


def on_backend_created(callback: Callable[[Any], None]) -> None:
    """Calls ``callback(backend)`` when JAX creates a backend from now on (backends that exist
    already are the caller's to look at: :func:`backends_created`).

    Up to 0.10 through xla_bridge's backend initialization hooks; they are removed in 0.11.0,
    so there the registered CPU backend factory is wrapped instead (the CPU backend is the one
    strata needs to see). Registering the same callback twice calls it once.
    """
    hooks = getattr(xla_bridge, "_backend_initialization_hooks", None)
    if hooks is not None:
        if callback not in hooks:
            hooks.append(callback)
        return
    reg = xla_bridge._backend_factories.get("cpu")
    if reg is None or getattr(reg.factory, "_strata_callback", None) is callback:
        return
    original = reg.factory

    def factory(*args, **kwargs):
        backend = original(*args, **kwargs)
        if backend is not None:
            callback(backend)
        return backend

    factory._strata_callback = callback
    reg.factory = factory


def cpu_async_dispatch() -> bool:
    """The value of ``jax_cpu_enable_async_dispatch`` (a flag jax.config has no attribute for)."""
    return bool(xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value)


@contextlib.contextmanager
def held_back_atexit(name: str) -> Iterator[list]:
    """While JAX creates its backend: keeps back the ``atexit.register`` of a function called
    ``name`` (XLA's MPI collectives register their ``Finalize``), handing it to the caller in
    the yielded list instead; every other registration goes through."""
    real = xla_bridge.atexit
    held: list = []

    class _Atexit:
        def __getattr__(self, attr):
            return getattr(real, attr)

        def register(self, fn, *args, **kwargs):
            if getattr(fn, "__name__", "") == name and not args and not kwargs:
                held.append(fn)
                return fn
            return real.register(fn, *args, **kwargs)

    xla_bridge.atexit = _Atexit()
    try:
        yield held
    finally:
        xla_bridge.atexit = real


def backends_created() -> bool:
    """Whether JAX has created its backends yet."""
    return bool(getattr(xla_bridge, "_backends", {}))


# --- jaxprs -----------------------------------------------------------------------------

# A jaxpr with its consts: core.ClosedJaxpr up to 0.10, core.Jaxpr from 0.11 (0.11 keeps the
# old name as an alias; 0.12 removes it).
ClosedJaxpr: type = getattr(core, "ClosedJaxpr", core.Jaxpr)


def is_jaxpr(v: Any) -> bool:
    """Whether ``v`` is a jaxpr (open or closed, on every release)."""
    return isinstance(v, (core.Jaxpr, ClosedJaxpr))


def is_closed(v: Any) -> bool:
    """Whether ``v`` is a closed jaxpr (on 0.11+ every jaxpr is)."""
    return isinstance(v, ClosedJaxpr)


def open_jaxpr(v: Any) -> core.Jaxpr:
    """The jaxpr of ``v``, closed or open (0.11+: ``v`` itself)."""
    return v.jaxpr if is_closed(v) else v


def map_closed(closed: Any, f: Callable[[core.Jaxpr], core.Jaxpr]) -> Any:
    """``closed`` with its jaxpr replaced by ``f(closed.jaxpr)`` and its consts kept.

    ``f`` must build its result with ``Jaxpr.replace`` (which keeps a 0.11+ jaxpr's consts).
    """
    if ClosedJaxpr is core.Jaxpr:  # 0.11+: one object; replace() kept the consts
        return f(closed.jaxpr)
    return core.ClosedJaxpr(f(closed.jaxpr), closed.consts)


def as_closed(jaxpr: Any) -> Any:
    """A closed jaxpr for ``jaxpr`` (a closed one is returned as it is)."""
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return pe.close_jaxpr(jaxpr)


# --- the higher-order primitives whose lowerings strata wraps (program_order.py) ------------------

cond_p = conditionals.cond_p
while_p = loops.while_p
scan_p = loops.scan_p
remat_p = ad_checkpoint.remat_p
jit_p = pjit.jit_p
custom_jvp_call_p = custom_derivatives.custom_jvp_call_p
shard_map_p = _shard_map.shard_map_p


def load_optional_modules() -> None:
    """Imports the modules that define higher-order primitives ``import jax`` may not load
    (custom_vmap, custom_linear_solve), so their primitives are registered; a module a release
    lacks is skipped."""
    for module in ("jax._src.custom_batching", "jax._src.lax.control_flow.solves"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


# --- lowering -----------------------------------------------------------------------------


def ir_consts(ctx, consts: Sequence[Any], avals: Sequence[Any]) -> list:
    """MLIR values of ``consts`` for the lowering context ``ctx`` (0.12.1+: consts hoisted to
    the entry function resolve to its arguments, through ``ctx.const_lowering``)."""
    if JAX_VERSION >= (0, 12, 1):
        return mlir.ir_consts(consts, avals, const_lowering=ctx.const_lowering)
    return mlir.ir_consts(consts, avals)


def lowering_rule(prim: core.Primitive, platform: str | None = None) -> Callable | None:
    """The lowering rule registered now for ``prim`` (the ``platform``'s own rule first, as
    JAX picks it), or None. strata wraps JAX's rules through this, never by private name."""
    entry = None
    if platform is not None:
        entry = mlir._platform_specific_lowerings[platform].get(prim)
    if entry is None:
        entry = mlir._lowerings.get(prim)
    return entry.rule if entry is not None else None


def register_lowering(
    prim: core.Primitive, rule: Callable, platform: str | None = None, cacheable: bool = True
) -> None:
    """``mlir.register_lowering`` with the arguments every supported release takes."""
    mlir.register_lowering(prim, rule, platform=platform, cacheable=cacheable)


def mark_uncacheable(prim: core.Primitive) -> None:
    """Makes JAX lower every application of ``prim`` afresh (not once per module)."""
    mlir._uncacheable_primitives.add(prim)


def registered_primitives(platform: str | None = None) -> list[core.Primitive]:
    """Every primitive that has a lowering rule for all platforms, or with ``platform`` one for
    that platform (``mlir._platform_specific_lowerings``, the same in every release)."""
    if platform is not None:
        return list(mlir._platform_specific_lowerings.get(platform, {}))
    return list(mlir._lowerings)


def lax_primitive(name: str) -> core.Primitive | None:
    """jax.lax's collective primitive ``<name>_p`` (e.g. ``"psum"``), or None where the running
    release has none (see this module's docstring for which release adds or drops which)."""
    return getattr(lax_parallel, f"{name}_p", None)
