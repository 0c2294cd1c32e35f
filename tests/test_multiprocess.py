"""Collectives across processes on the shared-memory fabric, started through the launcher.

Each case launches one script (tests/mp_scripts/) that batches many checks, because a process
with jax takes seconds to start: every collective against numpy on 2 and 4 processes and on
2 processes x 2 devices (a 2x2 mesh mixing local and remote peers), the three registration
modes bit for bit, MoE dispatch/combine with gradients, a peer that never arrives, and
clean-up after SIGKILL of a rank. The checks that need a healthy 2 x 2 job share one
(``job_2x2``: tests/mp_scripts/run_checks.py runs their scripts one after another in the same
processes), and each test reads its script's part of the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mp_util import assert_low_latency_checks, job_env, shm_left_behind, shm_names

import strata_jax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PKG_PARENT = str(Path(strata_jax.__file__).resolve().parent.parent)
SCRIPTS = HERE / "mp_scripts"


def _launch(
    nproc: int,
    script: str,
    *args: str,
    devices: int = 1,
    mode: str = "on_alloc",
    tmpdir: Path | None = None,
    timeout: float = 150,
    strata_timeout: float | None = None,
    grace: float | None = 1,
) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STRATA_", "XLA_FLAGS", "JAX_", "LD_PRELOAD"))
    }
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as tests/_mp_util.TEST_XLA_FLAGS
    env["STRATA_REGISTRATION"] = mode
    if strata_timeout is not None:
        env["STRATA_TIMEOUT_S"] = str(strata_timeout)
    # The ranks import the same strata_jax as this test process: the installed package (with
    # its native extension), or the source tree when it was built in place.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_PARENT, env.get("PYTHONPATH")]))
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    cmd = [
        sys.executable,
        "-m",
        "strata_jax.launch",
        "-n",
        str(nproc),
        *(["--grace", str(grace)] if grace is not None else []),
        "--devices-per-proc",
        str(devices),
        str(SCRIPTS / script),
        *args,
    ]
    # cwd is not the source root: `python -m` puts cwd first on sys.path, which would shadow
    # the installed package with the unbuilt source folder.
    return subprocess.run(
        cmd, env=env, cwd=PKG_PARENT, capture_output=True, text=True, timeout=timeout
    )


def _require_allocator() -> None:
    from strata_jax import launch

    if launch.alloc_library_path() is None:
        pytest.skip("libstrata_alloc.so not built: the zero-copy path needs the allocator")


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("digests")


# The scripts the shared 2 processes x 2 devices job runs, in this order (call_matching.py ends
# its process with os._exit, so it runs last), and their arguments.
_JOB_2X2 = [
    ("check_collectives.py", "DIGESTS"),
    ("check_moe.py",),
    ("check_ragged.py",),
    ("check_recsys_compact.py",),
    ("check_moe_low_latency.py",),
    ("check_low_latency.py",),
    ("check_ll_staged.py",),
    ("check_pytree.py",),
    ("check_bench_timing.py",),
    ("call_matching.py",),
]


@pytest.fixture(scope="module")
def job_2x2(digests) -> dict[str, str]:
    """One ``launch -n 2 --devices-per-proc 2`` job (registration on_alloc) running the scripts
    of ``_JOB_2X2``; returns each script's output lines (both ranks, prefixed ``[rank r]``) by
    script name, and the whole output under ``"all"``. A script that fails ends the job: its
    own test fails on its traceback, the ones after it on ``not reached``."""
    _require_allocator()
    args: list[str] = []
    for script, *sargs in _JOB_2X2:
        args += (
            ([] if not args else ["--"])
            + [script]
            + [str(digests) if a == "DIGESTS" else a for a in sargs]
        )
    r = _launch(2, "run_checks.py", *args, devices=2, timeout=300)
    out = r.stdout + r.stderr
    parts: dict[str, list[str]] = {"all": out.splitlines()}
    current: dict[str, str] = {}
    for line in out.splitlines():
        rank, _, rest = line.partition("] ")
        if rest.startswith("== run_checks: "):
            current[rank] = rest.removeprefix("== run_checks: ").strip()
        elif rank in current:
            parts.setdefault(current[rank], []).append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


def _part(job: dict[str, str], script: str) -> str:
    """``script``'s output in the shared job; fails saying so when the job never reached it."""
    if script not in job:
        pytest.fail(f"the shared 2x2 job did not reach {script}:\n{job['all'][-4000:]}")
    return job[script]


def test_benchmark_step_clock_across_processes(job_2x2):
    """The workloads' step clock under the launcher (benchmarks/_timing.py): every timed step
    starts after a barrier, and a step's time is the slowest process's (``nocomm`` used to be
    timed on rank 0 alone, which finished early with no exchange to wait for)."""
    out = _part(job_2x2, "check_bench_timing.py")
    assert out.count("OK bench timing") == 2, out[-3000:]


# on_use differs from on_alloc only in when a segment is registered (tests/test_alloc.py checks
# that in one process); its two-process run is behind -m slow.
@pytest.mark.parametrize(
    "mode", ["on_alloc", pytest.param("on_use", marks=pytest.mark.slow), "staging"]
)
def test_two_processes_every_collective(digests, job_2x2, mode):
    """Every collective against numpy, 2 processes x 2 devices (local and remote peers in one
    group of 4), in each registration mode (on_alloc: the shared job)."""
    _require_allocator()
    if mode == "on_alloc":
        out = _part(job_2x2, "check_collectives.py")
    else:
        r = _launch(2, "check_collectives.py", str(digests), devices=2, mode=mode)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
    assert out.count(f"OK 128 checks, mode {mode}") == 2, out[-3000:]


def test_modes_give_the_same_bits(digests):
    files = sorted(digests.glob("digest-*-4-*.txt"))
    if len({f.stem.split("-")[1] for f in files}) < 2:
        pytest.skip("needs two or more of the 2 x 2 runs above")
    per_mode = {}
    for f in files:
        _, mode, _, pid = f.stem.split("-")
        per_mode.setdefault(pid, set()).add(f.read_text())
    for pid, values in per_mode.items():
        assert len(values) == 1, f"process {pid}: modes disagree: {values}"


@pytest.mark.slow  # 4 processes: 2 x 2 devices (below) covers a 4-rank group across processes
def test_four_processes_every_collective(digests):
    _require_allocator()
    r = _launch(4, "check_collectives.py", str(digests), mode="on_use")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK ") == 4


@pytest.mark.parametrize(
    "nproc,devices,mode",
    [  # 2 x 2 on_alloc has the 2 x 1 on_alloc run's remote peers, and local ones besides
        pytest.param(2, 1, "on_alloc", marks=pytest.mark.slow),
        (2, 2, "on_alloc"),  # the shared job
        # staging copies through bounce buffers in every operator (check_collectives above)
        pytest.param(2, 1, "staging", marks=pytest.mark.slow),
    ],
)
def test_moe_dispatch_combine_across_processes(request, nproc, devices, mode):
    """moe.dispatch/combine and their gradients (the weights cotangent goes through the
    gather op) across processes, against numpy; 2x2 mixes local and remote peers."""
    _require_allocator()
    if (nproc, devices, mode) == (2, 2, "on_alloc"):
        out = _part(request.getfixturevalue("job_2x2"), "check_moe.py")
    else:
        r = _launch(nproc, "check_moe.py", devices=devices, mode=mode)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
    assert out.count(f"OK moe {15 * devices} checks") == nproc, out[-3000:]


def test_pytree_all_reduce_and_strided_psum_scatter_across_processes(job_2x2):
    """A pytree's psum/pmax is one call across processes (2 processes x 2 devices: local and
    remote peers in one call), its leaves mixing pool and staged buffers, 0-d and zero-size,
    one-shot and two-shot, and a pytree of small leaves on the low-latency path as one packed
    input; psum_scatter over dimension 1 in place. Bitwise against a rank-order numpy fold
    (check_pytree.py). The same pytree through jax.lax.psum/pmax under use_for_jax_lax() is
    one combined strata call too."""
    out = _part(job_2x2, "check_pytree.py")
    assert out.count("OK pytree 146 checks") == 2, out[-3000:]


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_processes_exiting_at_different_times_is_a_clean_end():
    """A healthy job whose ranks exit 0, 0.5 and 2.5 s after their last call: the first one's
    closed link is a clean exit (it said goodbye on the fabric first), so the others take the
    normal jax.distributed shutdown. Before: rank 0 took it for a dead peer, cut its shutdown
    short after 1 s ("not waiting longer than 1 s"), and its detached JAX client could abort the
    process at exit (SIGABRT, seen once in 6 runs of serve_moe.py under launch -n 4)."""
    r = _launch(3, "clean_exit_order.py", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("OK clean exit") == 3, out[-3000:]
    assert "not waiting longer" not in out and "SIGABRT" not in out, out[-3000:]


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-32 s here)
def test_timeout_then_sigkill_leaves_nothing():
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="strata-t-", dir="/tmp"))  # short: socket paths
    shm_before = shm_names()
    try:
        r = _launch(2, "timeout_then_kill.py", tmpdir=tmp, timeout=120)
        out = r.stdout + r.stderr
        assert "TIMEOUT-OK" in out, out[-3000:]
        assert "rank 1 was killed by SIGKILL" in out, out[-3000:]
        assert r.returncode != 0
        left = list(tmp.iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert left == [], f"left behind: {left}"
    assert not shm_left_behind(shm_before), f"left in /dev/shm: {shm_left_behind(shm_before)}"


@pytest.mark.slow  # out of the default run for its 6-minute budget (8-14 s here)
def test_uncaught_exception_on_one_rank_stops_everyone_quickly():
    """A Python exception on rank 1 ends the job within seconds and names rank 1 (without
    strata's excepthook the rank would hang in jax.distributed's shutdown)."""
    import time

    t = time.time()
    r = _launch(3, "raise_on_rank1.py", timeout=120)  # ranks 0 and 2 must be stopped
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "boom on rank 1" in out, out[-3000:]
    assert "rank 1 exited with code 1" in out, out[-3000:]
    # Said again last, where the traces of the stopped ranks cannot bury it.
    last = [ln for ln in r.stderr.splitlines() if ln.startswith("strata-launch: ")][-1]
    assert (
        last == "strata-launch: the first error a rank raised: rank 1: RuntimeError: boom on rank 1"
    )
    assert time.time() - t < 60, f"took {time.time() - t:.0f} s"


def test_recsys_compact_exchange_across_processes(job_2x2):
    """benchmarks/recsys_model.py's compact exchange (ragged_all_to_all into strata_jax.empty)
    equals the padded all_to_all step bit for bit across 2 processes x 2 devices."""
    out = _part(job_2x2, "check_recsys_compact.py")
    assert out.count("OK recsys compact") == 2, out[-3000:]


def test_ragged_all_to_all_across_processes(job_2x2):
    """ragged_all_to_all: random plans in three dtypes, forward and gradient, against numpy,
    operands shared in place (on_alloc); staging: tests/test_ragged.py, -m slow."""
    out = _part(job_2x2, "check_ragged.py")
    assert out.count("OK ragged") == 2, out[-3000:]


def test_moe_low_latency_across_processes(job_2x2):
    """low_latency_dispatch/combine against the reference (check_moe_low_latency.py); staging:
    tests/test_moe_low_latency.py, -m slow."""
    out = _part(job_2x2, "check_moe_low_latency.py")
    assert out.count("OK moe low-latency") == 2, out[-3000:]


def test_low_latency_two_processes_two_devices_each(job_2x2):
    """The low-latency path for small messages (tests/test_low_latency.py says what
    check_low_latency.py checks): local and remote peers in one group, a process's own ranks
    meet in the slots too."""
    assert_low_latency_checks(_part(job_2x2, "check_low_latency.py"), 2)


def test_low_latency_staged_form(job_2x2):
    """Calls above the slot size through the owner's bounce buffer, no departure barrier
    (tests/mp_scripts/check_ll_staged.py says what it checks): every staged operator against
    numpy and the path each call took, a staged psum equal bit for bit to the general path's,
    40 chained 1 MiB all_to_alls, two staged calls in one program, ranks that disagree
    (staged against general, staged against staged) failing within 2 s naming both sizes."""
    out = _part(job_2x2, "check_ll_staged.py")
    assert out.count("OK ll staged mismatch across paths") == 2, out[-3000:]
    assert out.count("OK ll staged mismatch both staged") == 2, out[-3000:]
    assert out.count("checks rank") == 2, out[-3000:]


# --------------------------------------------------------------------------------------
# How calls meet, and how a failed job ends
# --------------------------------------------------------------------------------------


def test_calls_meet_by_communicator_not_call_site(job_2x2):
    """2 processes x 2 devices (local and remote peers in one group). The same function called
    from two source lines returns the sum on every rank. Ranks that disagree on the size all
    raise within a second naming psum and both sizes (20 s timeout), also when one is empty.
    Independent collectives inside one program (XLA runs them at once on a device; equal ones,
    psum(v) and psum(sin v), once paired wrongly across processes when JAX shared one lowering
    and so one op id between them) and dispatch-ahead of several programs: right values, never
    two executions in flight on one device. Processes giving a ppermute different
    permutations: all fail at once. The exception types a failed collective raises
    (strata_jax.COLLECTIVE_ERRORS)."""
    out = _part(job_2x2, "call_matching.py")
    assert out.count("OK two call sites [4.0, 4.0, 4.0, 4.0]") == 2, out[-3000:]
    assert out.count("OK sizes differ mismatch raised") == 2, out[-3000:]
    assert out.count("OK empty on one rank raised") == 2, out[-3000:]
    assert out.count("OK ppermute permutations differ raised") == 2, out[-3000:]
    assert out.count("OK errors") == 1, out[-3000:]
    assert out.count("OK all") == 2, out[-3000:]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_shm_check_tells_a_leftover_from_another_programs_segment():
    """What the /dev/shm checks count: an entry nobody holds (left behind), not one another
    program has open meanwhile (an Open MPI job's vader_segment; it failed this file's check
    when a job started during the test)."""
    before = shm_names()
    left = f"/dev/shm/strata-test-left-{os.getpid()}"
    used = f"/dev/shm/strata-test-used-{os.getpid()}"
    code = "import sys, time; f = open(sys.argv[1], 'w'); print('open', flush=True); time.sleep(60)"
    other = subprocess.Popen([sys.executable, "-c", code, used], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "open\n"
        Path(left).write_bytes(b"x")
        assert shm_left_behind(before) == [Path(left).name]
    finally:
        other.kill()
        other.wait()
        for path in (left, used):
            Path(path).unlink(missing_ok=True)
    assert shm_left_behind(before) == []


def test_sigkilled_rank_ends_the_job_fast_and_a_rerun_passes(tmp_path):
    """A killed rank (3 ranks show it): looping psum, rank 2 SIGKILLs
    itself: every other rank is gone within ~2 s of the kill (was 5.0-5.3 s: JAX catches
    SIGTERM), the launcher exits non-zero, /dev/shm is unchanged and an immediate rerun (2
    ranks) passes."""
    import time

    _require_allocator()
    shm_before = shm_names()
    # The launcher's default grace (5 s): the kill must not wait for it.
    r = _launch(3, "failure_modes.py", "kill", str(tmp_path), timeout=120, grace=None)
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "rank 2 was killed by SIGKILL" in out, out[-3000:]
    gone_after = ended - float((tmp_path / "killed").read_text())
    print(f"killed rank: launcher done {gone_after:.2f} s after the kill")
    assert gone_after < 4.0, f"survivors lived {gone_after:.2f} s after the kill"  # 2 s unloaded
    for pid_file in tmp_path.glob("pid-*"):
        assert not Path(f"/proc/{pid_file.read_text()}").exists(), f"{pid_file.name} alive"
    assert not shm_left_behind(shm_before), f"left in /dev/shm: {shm_left_behind(shm_before)}"
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    r = _launch(2, "failure_modes.py", "none", str(rerun), timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("OK done") == 2


def test_rank_exiting_after_a_collective_error_ends_the_job_fast(tmp_path):
    """Rank 0 catches a collective timeout (STRATA_TIMEOUT_S=2)
    and calls sys.exit(1) while rank 1 sleeps 120 s: the job ends within a few seconds of the
    error (was 122 s: jax.distributed's shutdown waited for the sleeping peer)."""
    import time

    _require_allocator()
    r = _launch(
        2, "failure_modes.py", "exit", str(tmp_path), timeout=150, strata_timeout=2, grace=None
    )
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "rank 0 exited with code 1" in out and "timed out" in out, out[-3000:]
    after = ended - float((tmp_path / "caught").read_text())
    print(f"exit after a timeout: launcher done {after:.2f} s after the error was caught")
    assert after < 6.0, f"the job lived {after:.2f} s after the error"


def test_rank_quitting_mid_job_fails_its_peers_at_once(tmp_path):
    """A rank that calls sys.exit(0) while its peer enters a collective: the peer fails at
    once naming it ("exited or was killed"), not at the timeout (was: the full
    STRATA_TIMEOUT_S, 300 s by default, because the quitting rank sat in jax.distributed's
    shutdown barrier with its fabric links still open)."""
    _require_allocator()
    r = _launch(
        2, "failure_modes.py", "quit", str(tmp_path), timeout=150, strata_timeout=60, grace=None
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "rank 1 (device" in out and "exited or was killed" in out, out[-3000:]
    took = float((tmp_path / "quit-caught").read_text())
    print(f"peer failed {took:.2f} s after entering the collective")
    assert took < 10.0, f"the peer waited {took:.2f} s (timeout 60 s)"


def _start_by_hand(script: str, nproc: int, *args: str, strata_timeout: float = 60):
    """Starts nproc ranks without the strata launcher, as mpirun/srun would: each calls
    jax.distributed.initialize itself (coordinator address and rank on its command line)."""
    from strata_jax import launch

    env = job_env(STRATA_TIMEOUT_S=str(strata_timeout))
    lib = launch.alloc_library_path()
    if lib:
        env["LD_PRELOAD"] = lib
    coord = f"127.0.0.1:{launch.free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / script), *args, coord, str(nproc), str(i)],
            env=env,
            cwd=PKG_PARENT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]


def _reap(procs) -> list[str]:
    outs = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        outs.append(p.communicate(timeout=30)[0])
    return outs


def test_without_launcher_a_killed_rank_does_not_hang_the_others(tmp_path):
    """A failed job started mpirun/srun style (plain jax.distributed.initialize, no strata
    launcher): rank 2 is SIGKILLed; the surviving ranks (60 s collective timeout) fail their next
    collective at once, naming the dead rank, and exit non-zero by themselves."""
    import time

    procs = _start_by_hand("failure_modes.py", 3, "kill", str(tmp_path))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and any(
            p.poll() is None for i, p in enumerate(procs) if i != 2
        ):
            time.sleep(0.05)
        ended = time.time()
    finally:
        outs = _reap(procs)
    text = "\n".join(outs)
    killed = tmp_path / "killed"
    assert killed.exists(), text[-3000:]
    after = ended - float(killed.read_text())
    print(f"without launcher: survivors exited {after:.2f} s after the kill")
    assert [procs[0].returncode, procs[1].returncode] == [1, 1], text[-3000:]
    assert "exited or was killed" in text, text[-3000:]
    assert after < 6.0, f"survivors lived {after:.2f} s after the kill"


def test_without_launcher_a_rank_exiting_after_an_error_does_not_hang(tmp_path):
    """The same started by hand: rank 0 catches a collective timeout and calls sys.exit(1) while
    rank 1 sleeps: rank 0's process ends right away (it does not wait in jax.distributed's
    shutdown for rank 1); stopping rank 1 is then mpirun's/srun's job, as for any failed rank."""
    import time

    procs = _start_by_hand("failure_modes.py", 2, "exit", str(tmp_path), strata_timeout=2)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        ended = time.time()
    finally:
        outs = _reap(procs)
    caught = tmp_path / "caught"
    assert caught.exists(), outs[0][-3000:]
    after = ended - float(caught.read_text())
    print(f"without launcher: rank 0 exited {after:.2f} s after catching the error")
    assert procs[0].returncode == 1, outs[0][-3000:]
    assert after < 5.0, f"rank 0 lived {after:.2f} s after the error"
