"""Builds the fabric and algorithms with AddressSanitizer+UBSan and with ThreadSanitizer and
runs a multi-threaded stress test of back-to-back collectives (exact integer results).

Behind ``-m slow`` (90 s of CPU, most of it the instrumented build): run it after a change to
native/ (docs/contributing.md, Sanitizers)."""

from __future__ import annotations

import os
import subprocess

import pytest
from _util import build_native_test


@pytest.mark.slow
@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_stress_under_sanitizer(tmp_path, sanitizer):
    exe = str(tmp_path / "stress")
    flags = ("-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer")
    build = build_native_test("stress_inproc.cc", exe, *flags)
    if build.returncode != 0 and "cannot find" in build.stderr and "san" in build.stderr:
        pytest.skip(f"sanitizer runtime not installed: {build.stderr[-200:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
        TSAN_OPTIONS="halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1",
    )
    env.pop("LD_PRELOAD", None)
    run = subprocess.run([exe, "25"], capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "stress: ok" in run.stdout
