"""Finding (or building) libstrata_alloc.so and the C check program for the tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent
LAUNCH_PY = ROOT / "strata_jax" / "launch.py"
LAUNCH_ENV_PY = ROOT / "strata_jax" / "_src" / "launch_env.py"
ALLOC_SRC = ROOT / "native" / "alloc"


def launch_module() -> ModuleType:
    """The launcher's environment contract (strata_jax/_src/launch_env.py: alloc_library_path,
    rank_env, distributed_env): the importable one if the package imports, else the source
    file itself (standard library only)."""
    try:
        from strata_jax._src import launch_env as mod

        return mod
    except Exception:  # noqa: BLE001 - any import problem of the package: use the file itself
        spec = importlib.util.spec_from_file_location("strata_launch_env_src", LAUNCH_ENV_PY)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def build_alloc_library(out_dir: Path) -> str:
    """Compiles native/alloc/*.cc into out_dir/libstrata_alloc.so with the system C++ compiler."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler to build libstrata_alloc.so")
    out = out_dir / "libstrata_alloc.so"
    sources = sorted(str(p) for p in ALLOC_SRC.glob("*.cc"))
    subprocess.run(
        [
            cxx,
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c++17",
            f"-I{ROOT / 'native'}",
            *sources,
            "-o",
            str(out),
            "-ldl",
            "-lpthread",
        ],
        check=True,
    )
    return str(out)


def find_or_build_alloc_library(out_dir: Path) -> str:
    """$STRATA_ALLOC_LIB, the package's or a build folder's copy, else a fresh build."""
    found = launch_module().alloc_library_path()
    return found if found else build_alloc_library(out_dir)


def build_check_program(out_dir: Path) -> str:
    """Compiles tests/alloc_helpers/alloc_check.c with the system C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler for the allocator checks")
    out = out_dir / "alloc_check"
    subprocess.run(
        [
            cc,
            "-O1",
            "-g",
            "-pthread",
            "-fno-builtin",
            "-Wno-alloc-size-larger-than",
            f"-I{ROOT / 'native'}",
            str(HELPERS / "alloc_check.c"),
            "-o",
            str(out),
            "-ldl",
        ],
        check=True,
    )
    return str(out)
