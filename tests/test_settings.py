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


_TIMEOUT_GIVE = "give the seconds a collective waits for its peers, a number > 0"
_DELAY_GIVE = "give a whole number >= 0 (e.g. 200 milliseconds"
# (variable, a value it cannot read, the start of what the error says to give, a value it takes)
_REFUSED = [
    ("STRATA_ALLOC_THRESHOLD", "abc", "give a number of bytes", "64KB"),
    ("STRATA_ALLOC_CACHE_BYTES", "1.5G", "give a number of bytes", "64KB"),
    ("STRATA_ALLOC_RESERVE_BYTES", "-1", "give a number of bytes", "64KB"),
    ("STRATA_TIMEOUT_S", "abc", _TIMEOUT_GIVE, "12.5"),
    ("STRATA_TIMEOUT_S", "0", _TIMEOUT_GIVE, "12.5"),
    ("STRATA_TIMEOUT_S", "inf", _TIMEOUT_GIVE, "12.5"),
    ("STRATA_DIRECT_BYTES", "foo", "give a number of bytes, K/M/G allowed (e.g. 4K, the", "8K"),
    ("STRATA_STATS", "maybe", "give 1 or 0 (1, the default: per-operator counters; 0: off)", "0"),
    ("STRATA_THP", "x", "give 1 or 0", "0"),
    ("STRATA_INPROC_PAIRS", "x", "give 1 or 0", "1"),
    ("STRATA_PREFAULT", "x", "give 1 or 0", "1"),
    ("STRATA_ALLOC_DISABLE", "x", "give 1 or 0", "0"),
    ("STRATA_LL_SPINS", "abc", "give a whole number >= 0 (e.g. 2000, the default", "100"),
    ("STRATA_LL_YIELDS", "-3", "give a whole number >= 0 (e.g. 4, the default)", "0"),
    ("STRATA_SHM_SPINS", "x", "give a whole number >= 0 (e.g. 64, the default)", "8"),
    ("STRATA_SHM_YIELDS", "x", "give a whole number >= 0 (e.g. 16, the default", "8"),
    ("STRATA_ALLOC_SEGMENT_BYTES", "0", "give a number of bytes > 0", "2M"),
    ("STRATA_ALLOC_RESERVE_DELAY_MS", "x", _DELAY_GIVE, "50"),
    ("STRATA_ALLOC_RESERVE_DELAY_MS", "1K", _DELAY_GIVE, None),
]


@pytest.mark.parametrize("name,bad,message,good", _REFUSED)
def test_settings_refuse_values_they_cannot_read(monkeypatch, name, bad, message, good):
    """Settings used to take values they cannot read: the allocator its default size (a new
    user's ``STRATA_ALLOC_THRESHOLD=abc`` ran silently with 64K), the timeout 300 s, on/off
    settings any value (``STRATA_STATS=maybe`` as on, ``STRATA_ALLOC_DISABLE=x`` as 1), counts
    and sizes the native library reads (``STRATA_LL_YIELDS=-3``, ``STRATA_DIRECT_BYTES=foo`` as
    its default, a segment of 0 bytes). Each is a ValueError at the first strata call naming the
    variable, the value and what to give; a value it takes (or none) passes."""
    from strata_jax._src import runtime

    monkeypatch.setenv(name, bad)
    monkeypatch.setattr(runtime, "_env_checked", False)
    with pytest.raises(ValueError, match=f"^{name}='{re.escape(bad)}': {re.escape(message)}"):
        runtime.native()
    if good is None:
        monkeypatch.delenv(name)
    else:
        monkeypatch.setenv(name, good)
    monkeypatch.setattr(runtime, "_env_checked", False)
    runtime.native()
    assert runtime._env_checked


def test_on_off_count_and_byte_helpers_read_good_values(monkeypatch):
    from strata_jax._src import runtime

    for v, want in (("1", True), ("0", False), (" 1 ", True), ("", True)):
        monkeypatch.setenv("STRATA_X", v)
        assert runtime.env_bool("STRATA_X", True, "") is want
    for v, want in (("0", 0), ("2000", 2000), ("", 7)):
        monkeypatch.setenv("STRATA_X", v)
        assert runtime.env_count("STRATA_X", 7, "") == want
    monkeypatch.setenv("STRATA_X", "1K")
    assert runtime.env_bytes("STRATA_X", 7, "", minimum=1) == 1024
    for v in ("2", "on", "yes", "true"):
        monkeypatch.setenv("STRATA_X", v)
        with pytest.raises(ValueError, match=f"^STRATA_X='{v}': give 1 or 0 \\(what\\)$"):
            runtime.env_bool("STRATA_X", True, "what")


@pytest.mark.parametrize(
    "name,bad,read",
    [
        ("STRATA_CHECK_ACROSS_FABRICS", "maybe", "checks.check_on"),
        ("STRATA_CHECK_CARRY_BYTES", "1.5M", "checks.carry_bytes"),
        ("STRATA_RING_PSUM", "2", "algorithms._ring_psum"),
        ("STRATA_DEBUG", "LOUD", "debug.level"),
    ],
)
def test_python_settings_refuse_values_they_cannot_read(monkeypatch, name, bad, read):
    """The settings read in Python when a program is lowered (or traced, STRATA_DEBUG) refuse a
    value they cannot read there, where ``2`` or ``maybe`` used to mean on and ``LOUD`` off."""
    import importlib

    module, fn = read.rsplit(".", 1)
    package = "strata_jax._src.hierarchy." if module != "debug" else "strata_jax._src."
    reader = getattr(importlib.import_module(package + module), fn)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"^{name}='{bad}': give "):
        reader()
    monkeypatch.setenv(name, "0" if name != "STRATA_DEBUG" else "info")
    assert reader() in (False, 1)


def test_a_bad_setting_stops_every_rank_of_a_launch():
    """``STRATA_DIRECT_BYTES=foo`` under ``launch -n 2``: each rank fails at its first strata call
    with the error naming the variable (it used to run with the default)."""
    from _mp_util import launch

    r, _ = launch(2, "init_and_psum.py", timeout=120, STRATA_DIRECT_BYTES="foo")
    assert r.returncode != 0, r.stdout
    assert "STRATA_DIRECT_BYTES='foo': give a number of bytes" in r.stdout, r.stdout[-3000:]
    assert "OK 0" not in r.stdout and "OK 1" not in r.stdout


def test_thresholds_refuse_what_is_not_an_integer():
    import strata_jax

    for setter in (strata_jax.set_two_shot_threshold, strata_jax.set_low_latency_threshold):
        with pytest.raises(TypeError, match="threshold must be an integer number of bytes .*'abc'"):
            setter("abc")
        with pytest.raises(TypeError, match="got float 1.5"):
            setter(1.5)
        with pytest.raises(ValueError, match=">= 0 bytes"):
            setter(-1)


def test_messages_say_what_to_give_in_user_terms():
    """No example names a source file, and the millisecond setting asks for milliseconds."""
    from strata_jax._src import runtime

    examples = [
        *runtime._NATIVE_BYTE_SETTINGS.values(),
        *runtime._ALLOC_BYTE_SETTINGS.values(),
        *runtime._NATIVE_COUNT_SETTINGS.values(),
        *(m for _, m in runtime._NATIVE_BOOL_SETTINGS.values()),
    ]
    assert not [e for e in examples if "native/" in e or ".cc" in e]
    assert runtime._NATIVE_BYTE_SETTINGS["STRATA_STREAM_BYTES"].startswith("2M, the default")
    assert "STRATA_ALLOC_RESERVE_DELAY_MS" not in runtime._ALLOC_BYTE_SETTINGS
