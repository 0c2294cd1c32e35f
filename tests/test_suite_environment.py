"""The test suite itself does not depend on the shell it is run from (issue 42, section 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_suite_runs_on_8_devices_whatever_the_shell_sets(tmp_path):
    """conftest.py replaces a CPU device count from the user's shell (a JAX user's own
    XLA_FLAGS or JAX_NUM_CPU_DEVICES): the tests are written for 8 devices, and with 4 every
    8-device test failed."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import jax\n\n\ndef test_devices():\n    assert jax.device_count() == 8\n")
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_NUM_CPU_DEVICES="4",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "-p", "no:xdist", str(probe)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout, r.stdout[-3000:]
