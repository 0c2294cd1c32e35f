"""The short soak: a few hundred mixed, checked calls of benchmarks/soak.py.

In-process on the 8 test devices by default (100 calls, up to 64 KiB); 300 calls up to 1 MiB,
and over ``launch -n 4``, behind ``-m slow``. The full
10,000-call soak is ``python benchmarks/soak.py [--procs 4]``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from _mp_util import launch
from _util import mesh1d

SOAK_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def _soak_module():
    if not SOAK_PY.exists():
        pytest.skip("benchmarks/soak.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("strata_soak", SOAK_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "calls,max_bytes", [(100, 64 << 10), pytest.param(300, 1 << 20, marks=pytest.mark.slow)]
)
def test_short_soak_in_process(calls, max_bytes):
    """Mixed checked calls in one process: every op drawn, nothing wrong, no fd left open.
    100 calls up to 64 KiB per device by default (each new op/dtype/size compiles a program),
    300 up to 1 MiB behind -m slow."""
    soak = _soak_module()
    lines: list[str] = []
    # Objects of earlier tests in this worker (a subprocess's pipes) may still hold fds that a
    # collection during the soak would close: collect them first, so fds_start counts ours.
    gc.collect()
    row = soak.run(
        mesh1d(8),
        calls,
        max_bytes,
        int(np.random.default_rng().integers(1 << 30)),
        0,
        True,
        lambda *a, **k: lines.append(" ".join(map(str, a))),
    )
    assert row["wrong"] == 0, row["errors"]
    assert row["calls"] == calls and set(row["per_op"]) == set(soak.OPS), row["per_op"]
    assert row["fds_end"] == row["fds_start"], row


@pytest.mark.slow
def test_short_soak_four_processes():
    r, _ = launch(4, SOAK_PY, "--calls", "300", "--max-bytes", "1M", "--quiet", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [
        json.loads(ln.split("SOAKJSON ", 1)[1]) for ln in r.stdout.splitlines() if "SOAKJSON" in ln
    ]
    assert len(rows) == 4, r.stdout[-3000:]
    for row in rows:
        assert row["wrong"] == 0, row["errors"]
        assert row["fds_end"] == row["fds_warm"], row
