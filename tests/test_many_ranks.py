"""Groups of any size on the shared-memory fabric: the rendezvous slots are sized when the fabric
connects (no fixed cap; it was 64 ranks). tests/native/shm_many_ranks.cc fakes the ranks of one
group as threads of one process and runs psum (one- and two-shot) and all_gather through the real
join/arrive/depart and algorithms, checking every rank's output exactly, and the layout of the
control block. Behind ``-m slow``: building the fabric takes 10-20 s of CPU."""

from __future__ import annotations

import os
import subprocess

import pytest
from _util import build_native_test


@pytest.fixture(scope="module")
def many_ranks_exe(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("many") / "shm_many_ranks")
    build = build_native_test("shm_many_ranks.cc", exe, "-rdynamic")
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 64, 65, 96, 384, 1024])
def test_group_of_n_ranks_meets_in_one_slot(many_ranks_exe, n):
    r = subprocess.run([many_ranks_exe, str(n), "2"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"OK {n} ranks"), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,group", [(10, 3), (33, 4), (64, 5), (96, 7), (97, 1), (200, 1), (33, 40)]
)
def test_two_level_barrier_groups_of_any_size(many_ranks_exe, n, group):
    """The general path's barrier in groups of ``group`` ranks (STRATA_SHM_BARRIER_GROUP; the
    last group smaller where ``group`` does not divide ``n``; one rank per group; 200 ranks in
    groups of 1 raised to 4, for the slot's 64 group counters): the same exact results, and a
    missing rank named by every other. (33, 40): a group larger than the call, one flat counter.
    The default takes two levels above 64 ranks (65, 96, 384 and 1024 above)."""
    env = dict(os.environ, STRATA_SHM_BARRIER_GROUP=str(group))
    r = subprocess.run(
        [many_ranks_exe, str(n), "3"], capture_output=True, text=True, timeout=240, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"OK {n} ranks"), r.stdout
