"""Puts libstrata_alloc in XLA's allocation path, whatever started the process.

Registration on allocation needs XLA's large buffers to come from the allocator's pool (memfd
fabric segments). Two ways get them there:

- ``preload``: ``LD_PRELOAD=libstrata_alloc.so`` (what ``python -m strata_jax.launch`` and the
  ``strata-run`` wrapper set): the library's malloc family is the process's.
- ``hook`` (default everywhere else): at ``import strata_jax``, the library is loaded into the
  running process and the relocation slots of ``posix_memalign``, ``free`` and ``realloc`` in
  jaxlib's ``libjax_common.so`` (where XLA CPU allocates and frees every buffer) are pointed at
  the pool (``strata_alloc_hook``, native/alloc/hook.cc). No restart, no environment to set: a
  plain ``python script.py``, ``mpirun python script.py``, ``srun``, a notebook all get it.
  Everything else in the process keeps glibc. Measured on this machine: ~1.5 ms, once.

``STRATA_ALLOC_HOOK`` chooses: unset or ``1`` hooks ``libjax_common.so``; ``0`` turns the hook
off (XLA's buffers then come from glibc and every byte a collective moves across processes is
staged); any other value is a comma-separated list of library name fragments to hook instead.
"""

from __future__ import annotations

import ctypes
import os

from strata_jax._src import launch_env

ENV_HOOK = "STRATA_ALLOC_HOOK"
DEFAULT_HOOK_LIBRARIES = ("libjax_common.so",)

# mode: "preload" | "hook" | "off"; reason: why "off" ("" otherwise); fix: what to change.
state: dict = {"mode": None, "reason": "", "fix": "", "library": None, "slots": 0}


def _preloaded(libc: ctypes.CDLL) -> tuple[bool, bool]:
    """(preloaded, active) for a libstrata_alloc.so already in the global symbol scope."""
    if not hasattr(libc, "strata_alloc_active"):
        return False, False
    pre = bool(libc.strata_alloc_preloaded()) if hasattr(libc, "strata_alloc_preloaded") else True
    return pre, bool(libc.strata_alloc_active())


def install() -> dict:
    """Makes the pool serve XLA's buffers (preloaded already, or hooked now); returns ``state``.

    Called once by ``import strata_jax``, after jaxlib is loaded. Never raises: when the
    allocator cannot serve XLA, ``state["mode"]`` is ``"off"`` with the reason and the fix, and
    ``strata_jax.init()`` reports it in one line and registers in ``staging`` mode.
    """
    if state["mode"] is not None:
        return state
    libc = ctypes.CDLL(None)
    preloaded, active = _preloaded(libc)
    if preloaded:
        if active:
            state.update(mode="preload", library=os.environ.get("LD_PRELOAD", ""))
        else:
            state.update(
                mode="off",
                reason="libstrata_alloc.so is preloaded but STRATA_ALLOC_DISABLE is set",
                fix="unset STRATA_ALLOC_DISABLE",
            )
        return state
    setting = os.environ.get(ENV_HOOK, "1").strip()
    if setting == "0":
        state.update(
            mode="off",
            reason=f"{ENV_HOOK}=0",
            fix=f"unset {ENV_HOOK}, or start each process as `strata-run python script.py`",
        )
        return state
    off = os.environ.get("STRATA_ALLOC_DISABLE", "")
    if off and off != "0":
        state.update(
            mode="off", reason="STRATA_ALLOC_DISABLE is set", fix="unset STRATA_ALLOC_DISABLE"
        )
        return state
    import jax  # noqa: F401  (loads jaxlib's libjax_common.so, the library to hook)

    path = launch_env.alloc_library_path()
    if path is None:
        state.update(
            mode="off",
            reason=f"{launch_env.ALLOC_LIBRARY_NAME} not found",
            fix=f"reinstall strata_jax, or set {launch_env.ENV_ALLOC_LIB} to its path",
        )
        return state
    names = DEFAULT_HOOK_LIBRARIES if setting in ("", "1") else tuple(setting.split(","))
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)  # the extension finds it by dlsym
        slots = sum(max(0, int(lib.strata_alloc_hook(n.strip().encode()))) for n in names if n)
        ok = slots > 0 and bool(lib.strata_alloc_active())
    except (OSError, AttributeError) as e:
        slots, ok = 0, False
        why = f"{path}: {e}"
    else:
        why = f"no allocation slot found in {', '.join(names)}"
    if ok:
        state.update(mode="hook", library=path, slots=slots)
    else:
        state.update(
            mode="off",
            reason=f"hooking the allocator failed ({why})",
            fix="start each process as `strata-run python script.py` (LD_PRELOAD)",
        )
    return state


def describe() -> str:
    """One line: how (or why not) the allocator serves XLA's buffers."""
    m = state["mode"]
    if m == "preload":
        return "libstrata_alloc preloaded (LD_PRELOAD)"
    if m == "hook":
        return "libstrata_alloc hooked into libjax_common.so (no LD_PRELOAD needed)"
    if m == "off":
        return f"no allocator: {state['reason']}"
    return "allocator not set up (strata_jax not imported yet)"
