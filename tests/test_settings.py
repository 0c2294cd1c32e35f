"""The settings strata reads from the environment are checked at the first strata call: a value
it cannot read is a ValueError naming the variable and what to give, never a silent default."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "name",
    ["STRATA_LL_BYTES", "STRATA_LL_STAGE_BYTES", "STRATA_STREAM_BYTES", "STRATA_TWO_SHOT_BYTES"],
)
def test_byte_settings_are_checked(monkeypatch, name):
    """A byte setting the native library reads itself takes digits with a K/M/G suffix; any
    other value (``1.5M``, ``-1``, ``foo``) is an error at the first strata call naming the
    variable, where it used to turn the path off without a word (a new user's ``1G``)."""
    from strata_jax._src import runtime

    for good, n in (("0", 0), ("4096", 4096), ("64K", 65536), ("1m", 1 << 20), ("2G", 2 << 30)):
        monkeypatch.setenv(name, good)
        assert runtime.env_bytes(name, 7, "") == n
    monkeypatch.delenv(name)
    assert runtime.env_bytes(name, 7, "") == 7
    for bad in ("1.5M", "-1", "foo", "1T", "M"):
        monkeypatch.setenv(name, bad)
        monkeypatch.setattr(runtime, "_env_checked", False)
        with pytest.raises(ValueError, match=f"{name}='{re.escape(bad)}': give a number of bytes"):
            runtime.native()
    monkeypatch.delenv(name)
    runtime.native()  # checked again, and fine
    assert runtime._env_checked


def test_native_byte_settings_read_suffixes():
    """The native library reads STRATA_STREAM_BYTES and STRATA_TWO_SHOT_BYTES with K/M/G
    suffixes, as strata_jax checks them: ``1G`` used to be read as 1 byte (``atoll``), which
    turned every copy into a streaming one where a measurement meant the opposite."""
    code = (
        "import strata_jax; from strata_jax._src.runtime import native; "
        "print(native().get_stream_bytes(), native().get_two_shot_bytes())"
    )
    env = dict(os.environ, STRATA_STREAM_BYTES="3M", STRATA_TWO_SHOT_BYTES="2K")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(3 << 20), str(2 << 10)]


@pytest.mark.parametrize(
    "name,bad,message",
    [
        ("STRATA_ALLOC_THRESHOLD", "abc", "give a number of bytes"),
        ("STRATA_ALLOC_CACHE_BYTES", "1.5G", "give a number of bytes"),
        ("STRATA_ALLOC_RESERVE_BYTES", "-1", "give a number of bytes"),
        ("STRATA_TIMEOUT_S", "abc", "a number > 0"),
        ("STRATA_TIMEOUT_S", "0", "a number > 0"),
        ("STRATA_TIMEOUT_S", "inf", "a number > 0"),
    ],
)
def test_allocator_and_timeout_settings_are_checked(monkeypatch, name, bad, message):
    """The allocator falls back to its default on a size it cannot read, and the timeout to 300 s
    (a new user's ``STRATA_ALLOC_THRESHOLD=abc`` ran silently with 64K): both are an error at
    the first strata call naming the variable; the values they take pass."""
    from strata_jax._src import runtime

    monkeypatch.setenv(name, bad)
    monkeypatch.setattr(runtime, "_env_checked", False)
    with pytest.raises(ValueError, match=f"{name}='{re.escape(bad)}': .*{message}"):
        runtime.native()
    good = "12.5" if name == "STRATA_TIMEOUT_S" else "64KB"
    monkeypatch.setenv(name, good)
    monkeypatch.setattr(runtime, "_env_checked", False)
    runtime.native()
    assert runtime._env_checked
