"""The native extension ``strata_jax._strata``: loaded, and its XLA FFI targets registered, here.

This is the one module that imports the extension. It imports nothing of strata_jax (the
extension is found by its full name, never read back from the package's ``__init__``), so
every module may use it without an import cycle; ``runtime.native()`` is the front door the
rest of the package calls (it adds the launch-pool check at first use). Its handlers are
registered lazily, at the first lowering or setting that needs them, as before. A missing
extension is reported once, at ``import strata_jax``, by the package's ``__init__``, and so is
an extension built for a newer jaxlib than the running one (:func:`check_installed`).
"""

from __future__ import annotations

import importlib
import os
import re
from types import ModuleType

NAME = "strata_jax._strata"

_module: ModuleType | None = None


def _installed_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib, read from its own headers."""
    import jax

    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


def check_build(module: ModuleType) -> None:
    """ImportError when the extension was built against a newer XLA FFI API than the running
    jaxlib's (it would refuse every handler at the first call): what to rebuild."""
    import jaxlib

    info = module.build_info()
    built, running = tuple(info["ffi_api"]), _installed_ffi_api()
    if running is not None and built > running:
        raise ImportError(
            f"strata_jax's native extension was built against jaxlib {info['jaxlib']}'s XLA FFI "
            f"headers (API {built[0]}.{built[1]}), newer than this jaxlib {jaxlib.__version__} "
            f"(API {running[0]}.{running[1]}), which refuses its handlers. Rebuild it against "
            "the jaxlib installed now: pip install --no-cache-dir --force-reinstall --no-deps "
            "<strata_jax source> (the build takes the FFI headers of the installed jaxlib; where "
            "that jaxlib is outside the environment's own site-packages, as in a venv made with "
            "--system-site-packages, add --no-build-isolation after `pip install "
            "scikit-build-core nanobind`: pip's isolated build does not see it)."
        )


def check_installed() -> None:
    """:func:`check_build` on the extension, without registering its handlers: run at
    ``import strata_jax``, so a build for a newer jaxlib fails there, with the fix, and not at
    the first strata call inside a traced program (importing the module costs about 0.5 ms).

    Raises:
      ImportError: the extension was built against a newer jaxlib's FFI API.
    """
    check_build(importlib.import_module(NAME))


def load() -> ModuleType:
    """The extension module, imported and its FFI handlers registered on first call.

    Raises:
      ImportError: the extension was built against a newer jaxlib's FFI API
        (:func:`check_build`).
    """
    global _module
    if _module is None:
        import jax

        module = importlib.import_module(NAME)
        check_build(module)
        for name, capsule in module.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
        _module = module
    return _module


def loaded() -> ModuleType | None:
    """The extension if :func:`load` ran, else None (never loads it)."""
    return _module
