"""The native extension ``strata_jax._strata``: loaded, and its XLA FFI targets registered, here.

This is the one module that imports the extension. It imports nothing of strata_jax (the
extension is found by its full name, never read back from the package's ``__init__``), so
every module may use it without an import cycle; ``runtime.native()`` is the front door the
rest of the package calls (it adds the launch-pool check at first use). The extension is
loaded lazily, at the first lowering or setting that needs it, as before. A missing extension
is reported once, at ``import strata_jax``, by the package's ``__init__``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

NAME = "strata_jax._strata"

_module: ModuleType | None = None


def load() -> ModuleType:
    """The extension module, imported and its FFI handlers registered on first call."""
    global _module
    if _module is None:
        import jax

        module = importlib.import_module(NAME)
        for name, capsule in module.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
        _module = module
    return _module


def loaded() -> ModuleType | None:
    """The extension if :func:`load` ran, else None (never loads it)."""
    return _module
