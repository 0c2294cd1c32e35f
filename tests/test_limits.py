"""The system limits a job of many processes can hit: checked at init() on every process, each
failing alike with a message naming the limit, its value, what the job needs and how to raise it
(strata_jax/_src/limits.py). The checks with faked values run in this process; a real lowered
RLIMIT_NOFILE and a tiny /dev/shm run a small job under the launcher."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time

import pytest

from strata_jax._src import limits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mp_scripts", "init_and_psum.py")
BIG = 1 << 40


def test_nofile_short_with_hard_limit_short():
    msgs = limits.check(
        96,
        96,
        0,
        1 << 20,
        nofile=(100, 100),
        max_map_count=65530,
        mem_available=BIG,
        open_now=30,
        maps_now=800,
    )
    assert len(msgs) == 1
    need = limits.needs(96, 96, open_now=30, maps_now=800)["nofile"]
    assert "RLIMIT_NOFILE (open files) is 100 (hard limit 100)" in msgs[0]
    assert f"needs about {need} for a fabric of 96 processes" in msgs[0]
    assert f"ulimit -n {need}" in msgs[0]


def test_nofile_soft_limit_is_raised_when_the_hard_one_allows():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.needs(8, 8, open_now=limits._open_fds(), maps_now=800)["nofile"]
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip("hard limit too low here")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need - 10, hard))
        msgs = limits.check(8, 8, 0, 1 << 20, max_map_count=65530, mem_available=BIG)
        assert msgs == []
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= need
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_max_map_count_short():
    msgs = limits.check(
        384,
        384,
        0,
        1 << 20,
        nofile=(BIG, BIG),
        max_map_count=2000,
        mem_available=BIG,
        open_now=30,
        maps_now=800,
    )
    need = limits.needs(384, 384, open_now=30, maps_now=800)["maps"]
    assert len(msgs) == 1 and msgs[0].startswith("vm.max_map_count is 2000")
    assert f"needs about {need} memory maps for a fabric of 384 processes" in msgs[0]
    assert f"sysctl -w vm.max_map_count={2 * need}" in msgs[0]


def test_memory_short():
    msgs = limits.check(
        64,
        64,
        64 << 20,
        1 << 20,
        nofile=(BIG, BIG),
        max_map_count=65530,
        mem_available=1 << 30,
    )
    assert len(msgs) == 1 and msgs[0].startswith("memory: MemAvailable is 1024 MiB")
    assert "the 64 processes of this fabric need 4353 MiB" in msgs[0]
    assert "STRATA_ALLOC_RESERVE_BYTES=0" in msgs[0]


def test_everything_fine_at_96_processes_on_a_normal_host():
    assert (
        limits.check(
            96,
            96,
            0,
            1 << 20,
            nofile=(1024, 1024),
            max_map_count=65530,
            mem_available=8 << 30,
            open_now=40,
            maps_now=900,
        )
        == []
    )


def test_default_reserve_shrinks_with_the_fabric():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert limits.default_reserve(1) == 128 << 20 or total < (8 << 30)
    assert limits.default_reserve(100_000) == 0
    values = [limits.default_reserve(p) for p in (2, 4, 8, 16, 32, 64, 128)]
    assert values == sorted(values, reverse=True)


def _launch(n: int, prefix: str = "", timeout: float = 120):
    cmd = f"{prefix} {sys.executable} -m strata_jax.launch -n {n} {SCRIPT}"
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def test_lowered_nofile_fails_every_rank_naming_it():
    r, _ = _launch(4, prefix="ulimit -n 100;")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "OK" not in r.stdout
    for rank in range(4):
        line = [ln for ln in out.splitlines() if ln.startswith(f"[rank {rank}] strata_jax")]
        assert any(
            "LimitError" in ln or "a limit of the operating system is too low" in ln for ln in line
        ), out[-3000:]
    assert "RLIMIT_NOFILE (open files) is 100 (hard limit 100)" in out
    assert "ulimit -n " in out


def _can_unshare_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_mount(), reason="needs root and unshare --mount")
def test_a_tiny_dev_shm_is_not_a_limit():
    # strata's shared memory is memfd (the kernel's internal shmem mount), not files under
    # /dev/shm: a job runs with 64 KiB there.
    prefix = (
        "exec unshare --mount bash -c 'mount --make-rprivate / && "
        "mount -t tmpfs -o size=64k tmpfs /dev/shm && df -k /dev/shm | tail -1 && "
    )
    cmd = f"{sys.executable} -m strata_jax.launch -n 2 {SCRIPT}'"
    r = subprocess.run(["bash", "-c", prefix + cmd], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert " 64 " in r.stdout.splitlines()[0]
    assert "[rank 0] OK 0" in r.stdout and "[rank 1] OK 1" in r.stdout
