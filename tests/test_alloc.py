"""Tests of libstrata_alloc.so, the registration-on-allocation allocator (LD_PRELOAD).

The checks themselves are in tests/alloc_helpers/alloc_check.c (one process per case, so each
starts from a fresh pool and its own environment); this file builds it and runs it under
LD_PRELOAD, then checks the library from Python (numpy, jax, dlopen without preload).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from alloc_helpers.common import (
    build_check_program,
    find_or_build_alloc_library,
    launch_module,
)

MiB = 1 << 20


@pytest.fixture(scope="session")
def alloc_lib(tmp_path_factory) -> str:
    return find_or_build_alloc_library(tmp_path_factory.mktemp("alloc_lib"))


@pytest.fixture(scope="session")
def check_prog(tmp_path_factory) -> str:
    return build_check_program(tmp_path_factory.mktemp("alloc_check"))


def _env(lib: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_ALLOC_")}
    env.pop("LD_PRELOAD", None)
    if lib:  # as the launcher and strata-run preload it (a path with a space included)
        env = launch_module().preload_env(env, lib)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# These cases count segments and bytes from an empty pool: at the default threshold (64K)
# libstdc++'s emergency exception-handling arena (72 KiB, allocated when the library loads and
# never freed) would sit in the first shared segment for the life of the process.
_EMPTY_POOL = {"STRATA_ALLOC_THRESHOLD": "128K"}

CASES = [
    ("active", {}),
    ("align", {}),
    ("realloc", {}),
    ("threads", {}),
    ("threads", {"STRATA_ALLOC_THRESHOLD": "8K", "STRATA_ALLOC_CACHE_BYTES": "0"}),
    ("sizes", {}),
    ("foreign", {}),
    ("reuse", {**_EMPTY_POOL}),
    ("lookup", {}),
    ("fork", {}),
    ("cache", {"STRATA_ALLOC_CACHE_BYTES": "64M", **_EMPTY_POOL}),
    ("cache_zero", {"STRATA_ALLOC_CACHE_BYTES": "0", **_EMPTY_POOL}),
    ("callback", {"STRATA_ALLOC_CACHE_BYTES": "0", **_EMPTY_POOL}),
    ("threshold", {"STRATA_ALLOC_THRESHOLD": "128K"}),
    ("disabled", {"STRATA_ALLOC_DISABLE": "1"}),
    (
        "reserve",
        {
            "STRATA_ALLOC_SEGMENT_BYTES": "4M",
            "STRATA_ALLOC_RESERVE_BYTES": "8M",
            "STRATA_ALLOC_CACHE_BYTES": "24M",
        },
    ),
]


@pytest.mark.parametrize(
    "case,extra", CASES, ids=[f"{c}-{'-'.join(e.values()) or 'default'}" for c, e in CASES]
)
def test_check_program(alloc_lib, check_prog, case, extra):
    r = _run([check_prog, case], _env(alloc_lib, **extra))
    assert r.returncode == 0, f"{case}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    assert f"ok {case}" in r.stdout


_STATS_PY = """
import ctypes
lib = ctypes.CDLL(None)

class Info(ctypes.Structure):
    _fields_ = [("segment_id", ctypes.c_uint64), ("fd", ctypes.c_int), ("base", ctypes.c_void_p),
                ("size", ctypes.c_size_t), ("offset", ctypes.c_size_t)]

class Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "segments segment_bytes bytes_in_use bytes_cached pool_allocs pool_frees libc_allocs "
        "segments_created segments_released segments_announced threshold cache_cap").split()]

def lookup(ptr, n):
    info = Info()
    hit = lib.strata_alloc_lookup(ctypes.c_void_p(ptr), ctypes.c_size_t(n), ctypes.byref(info))
    return hit, info

def stats():
    s = Stats()
    lib.strata_alloc_stats(ctypes.byref(s))
    return s
"""


def test_numpy_under_preload(alloc_lib):
    code = _STATS_PY + textwrap.dedent(
        """
        import numpy as np
        big = np.arange(4 << 20, dtype=np.float32)          # 16 MiB: from the pool
        small = np.arange(1000, dtype=np.float32)           # 4 KB: libc
        assert (big * 2).sum() == 2 * big.astype(np.float64).sum()
        hit, info = lookup(big.ctypes.data, big.nbytes)
        assert hit == 1 and info.fd >= 0 and info.base + info.offset == big.ctypes.data
        assert lookup(small.ctypes.data, small.nbytes)[0] == 0
        assert lib.strata_alloc_active() == 1
        grown = np.resize(big, 8 << 20)
        del big, grown
        s = stats()
        assert s.pool_allocs >= 2 and s.threshold == 64 << 10, (s.pool_allocs, s.threshold)
        assert lib.strata_alloc_check() == 0
        print("numpy ok")
        """
    )
    r = _run([sys.executable, "-c", code], _env(alloc_lib))
    assert r.returncode == 0, r.stderr
    assert "numpy ok" in r.stdout


def test_jax_buffers_come_from_the_pool(alloc_lib):
    code = _STATS_PY + textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        x = jnp.ones((1024, 1024), jnp.float32)
        y = (x @ x + 1).block_until_ready()
        assert float(y[0, 0]) == 1025.0
        hit, info = lookup(y.unsafe_buffer_pointer(), 4 << 20)
        assert hit == 1, "XLA's output buffer should be a pool block"
        assert lib.strata_alloc_check() == 0
        print("jax ok", stats().pool_allocs)
        """
    )
    r = _run([sys.executable, "-c", code], _env(alloc_lib), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "jax ok" in r.stdout


def test_loaded_without_preload_is_inert(alloc_lib):
    """dlopen'ed (not preloaded): the API answers, nothing is interposed, nothing is found."""
    code = textwrap.dedent(
        f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({alloc_lib!r})
        a = np.ones(4 << 20)
        assert lib.strata_alloc_active() == 0
        p = ctypes.c_void_p(a.ctypes.data)
        assert lib.strata_alloc_lookup(p, ctypes.c_size_t(8), None) == 0
        assert lib.strata_alloc_abi_version() == 1
        lib.strata_alloc_set_reserve.restype = ctypes.c_size_t
        assert lib.strata_alloc_set_reserve(ctypes.c_size_t(64 << 20)) == 0  # no reserve made
        print("inert ok")
        """
    )
    r = _run([sys.executable, "-c", code], _env(None))
    assert r.returncode == 0, r.stderr
    assert "inert ok" in r.stdout


def test_subprocess_and_shell_work_under_preload(alloc_lib):
    r = _run(["sh", "-c", "ls / >/dev/null && echo fine"], _env(alloc_lib))
    assert r.returncode == 0 and r.stdout.strip() == "fine", r.stderr


def test_alloc_library_path_override(alloc_lib, tmp_path, monkeypatch):
    mod = launch_module()
    monkeypatch.setenv("STRATA_ALLOC_LIB", alloc_lib)
    assert mod.alloc_library_path() == alloc_lib
    monkeypatch.setenv("STRATA_ALLOC_LIB", str(tmp_path / "missing.so"))
    assert mod.alloc_library_path() is None


def test_hook_without_preload_serves_xla_only(alloc_lib):
    """No LD_PRELOAD: ``import strata_jax`` points jaxlib's posix_memalign/free/realloc at the
    pool (native/alloc/hook.cc). XLA's buffers come from it; numpy keeps glibc; a buffer XLA
    made before the hook is freed through glibc; pool blocks are freed back to the pool."""
    code = (
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, numpy as np
            early = (jnp.ones((1024, 1024), jnp.float32) + 1).block_until_ready()  # glibc
            import strata_jax
            from strata_jax._src import allocator
            st = allocator.state
            assert st["mode"] == "hook" and st["slots"] > 0, st
            """
        )
        + _STATS_PY
        + textwrap.dedent(
            """
            assert lib.strata_alloc_active() == 1 and lib.strata_alloc_preloaded() == 0
            assert lib.strata_alloc_hooked() == 1
            assert lookup(early.unsafe_buffer_pointer(), 8)[0] == 0
            del early  # allocated by glibc before the hook, freed through the hooked free
            x = jnp.ones((1024, 1024), jnp.float32)
            for i in range(5):
                y = (x @ x + i).block_until_ready()
                assert float(y[0, 0]) == 1024.0 + i
                assert lookup(y.unsafe_buffer_pointer(), 4 << 20)[0] == 1, i
            a = np.ones(4 << 20)  # numpy: not hooked, glibc
            assert lookup(a.ctypes.data, 8)[0] == 0
            del y
            s = stats()
            assert s.pool_allocs >= 5 and s.pool_frees >= 4, (s.pool_allocs, s.pool_frees)
            assert lib.strata_alloc_check() == 0
            assert strata_jax.memory_stats()["allocator_mode"] == "hook"
            print("hook ok")
            """
        )
    )
    r = _run([sys.executable, "-c", code], _env(None, STRATA_ALLOC_LIB=alloc_lib), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "hook ok" in r.stdout


def test_hook_off_leaves_glibc(alloc_lib):
    code = textwrap.dedent(
        """
        import strata_jax, jax.numpy as jnp
        from strata_jax._src import allocator
        y = (jnp.ones((1024, 1024)) + 1).block_until_ready()
        ms = strata_jax.memory_stats()
        st = allocator.state
        assert st["mode"] == "off" and "STRATA_ALLOC_HOOK=0" in st["reason"], st
        assert ms["allocator"] is False and ms["allocator_mode"] == "off" and ms["pool_allocs"] == 0
        print("off ok")
        """
    )
    env = _env(None, STRATA_ALLOC_LIB=alloc_lib, STRATA_ALLOC_HOOK="0")
    r = _run([sys.executable, "-c", code], env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "off ok" in r.stdout
