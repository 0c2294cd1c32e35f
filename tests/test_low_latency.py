"""The low-latency path for small messages across processes (native/fabric/shm_ll.h).

Each case launches tests/mp_scripts/check_low_latency.py, which checks against numpy (and
psum against jax.lax) every operator on both sides of the threshold in several dtypes, long
runs of consecutive calls that reuse the slots (a 300-step scan alternating both paths, two
collectives in flight at once, 200 calls chained on the device), ranks that disagree on a
size (on the low-latency path and across the two paths: every rank fails within 2 s naming
both sizes, and the job computes right afterwards), and a SIGKILLed peer (the others fail
within 2 s naming it). By default 2 processes x 2 devices (local and remote peers in one group
of 4) in test_multiprocess.py's shared job; the runs here (4 processes, 2 x 2 on their own, the
kill case on 3 ranks) are behind ``-m slow``.
"""

from __future__ import annotations

import pytest
from _mp_util import assert_low_latency_checks, launch

from strata_jax import launch as strata_launch


def _require_allocator() -> None:
    if strata_launch.alloc_library_path() is None:
        pytest.skip("libstrata_alloc.so not built")


@pytest.mark.slow  # 2 processes x 2 devices (below) runs the same checks on 4 ranks
def test_low_latency_four_processes():
    _require_allocator()
    r, _ = launch(4, "check_low_latency.py", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert_low_latency_checks(r.stdout, 4)


# The default run has this check in test_multiprocess.py's shared 2 x 2 job
# (test_low_latency_two_processes_two_devices_each there).
@pytest.mark.slow
def test_low_latency_two_processes_two_devices_each():
    """Local and remote peers in one group: a process's own ranks meet in the slots too."""
    _require_allocator()
    r, _ = launch(2, "check_low_latency.py", devices=2, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert_low_latency_checks(r.stdout, 2)


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_low_latency_killed_peer_fails_fast():
    _require_allocator()
    r, _ = launch(3, "check_low_latency.py", "kill", timeout=120, grace=10)
    out = r.stdout
    assert "rank 2 was killed by SIGKILL" in out, out[-3000:]
    assert out.count("OK ll killed peer") == 2, out[-3000:]
    assert r.returncode != 0


def test_low_latency_threshold_setting():
    import strata_jax as sj

    keep = sj.get_low_latency_threshold()
    try:
        sj.set_low_latency_threshold(4096)
        assert sj.get_low_latency_threshold() == 4096
        sj.set_low_latency_threshold(1 << 30)  # clamped to the slot size limit
        assert sj.get_low_latency_threshold() == 1 << 20
        sj.set_low_latency_threshold(0)  # off
        assert sj.get_low_latency_threshold() == 0
        with pytest.raises(ValueError, match=">= 0"):
            sj.set_low_latency_threshold(-1)
    finally:
        sj.set_low_latency_threshold(keep)
