"""strata's engine for XLA's collectives (libstrata_mpi.so, native/mpiabi; _src/engine.py).

The library: every symbol jaxlib's MPItrampoline resolves is exported (read from jaxlib itself),
stubs fail naming themselves, MPI_Init_thread without strata says what to do. Programs nobody
wrote for strata (tests/mp_scripts/check_engine.py: jit + sharding data/tensor parallel, an
all-to-all forced by a sharding constraint, Flax NNX + optax, pmap, shard_map with jax.lax
collectives, a strata call inside a GSPMD program) under ``launch -n 2`` give bitwise the values
they give over gloo, with every collective of their compiled programs on strata's engine and
counted by comm_stats(); ``-n 4`` (slow) against gloo and against XLA's in-process
communicator. Failures (disagreeing sizes, a late rank, a dead rank) are strata's fast named
errors. An unmodified script runs with ``launch --wrap``.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import _mp_util as mp

ROOT = Path(__file__).resolve().parent.parent


def _library() -> str:
    from strata_jax._src import engine

    lib = engine.library_path()
    if lib is None:
        pytest.skip("libstrata_mpi.so is not built")
    return lib


def _jaxlib_symbols() -> set[str]:
    """The names jaxlib's MPItrampoline looks up (the strings of libjax_common.so)."""
    import jaxlib

    path = Path(jaxlib.__file__).parent / "libjax_common.so"
    data = path.read_bytes()
    names = set(re.findall(rb"(?<=\x00)(MPIX?ABI_[A-Za-z0-9_]+)(?=\x00)", data))
    version = rb"(?<=\x00)((?:mpiabi|mpiwrapper)_version_(?:major|minor|patch))(?=\x00)"
    names |= set(re.findall(version, data))
    names |= set(re.findall(rb"(?<=\x00)(mpiwrapper_export_fortran_constants_)(?=\x00)", data))
    return {n.decode() for n in names}


def test_library_exports_every_symbol_jaxlib_resolves():
    names = _jaxlib_symbols()
    assert len([n for n in names if n.startswith("MPI")]) >= 634, sorted(names)[:5]
    lib = ctypes.CDLL(_library())
    missing = sorted(n for n in names if not hasattr(lib, n))
    assert missing == []
    assert ctypes.c_int.in_dll(lib, "mpiabi_version_major").value == 2
    assert ctypes.c_int.in_dll(lib, "mpiabi_version_minor").value >= 9


def _error_string(lib, code: int) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = ctypes.c_int(0)
    assert lib.MPIABI_Error_string(code, buf, ctypes.byref(n)) == 0
    return buf.value.decode()


def test_a_stub_fails_naming_itself_and_init_without_strata_says_what_to_do():
    # A copy of its own (RTLD_LOCAL, no engine attached): what a process that did not import
    # strata_jax gets.
    lib = ctypes.CDLL(_library(), mode=os.RTLD_LOCAL)
    rc = lib.MPIABI_Bcast(None, 0, 0, 0, 0)
    assert rc != 0 and "MPI_Bcast is not implemented" in _error_string(lib, rc)
    provided = ctypes.c_int(-1)
    rc = lib.MPIABI_Init_thread(None, None, 1, ctypes.byref(provided))
    msg = _error_string(lib, rc)
    assert rc != 0 and "strata_jax.init()" in msg and "MPITRAMPOLINE_LIB" in msg, msg
    flag = ctypes.c_int(0)
    assert lib.MPIABI_Is_thread_main(ctypes.byref(flag)) == 0 and flag.value == 1


def test_engine_choice():
    from strata_jax._src.engine import requested

    assert requested({})[0] == "strata"
    assert requested({"STRATA_ENGINE": "gloo"})[0] == "gloo"
    assert requested({"JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"})[0] == "gloo"
    mine = {"MPITRAMPOLINE_LIB": "/opt/mpiwrapper/lib/libmpiwrapper.so"}
    assert requested(mine)[0] == "mpi"
    assert requested({**mine, "STRATA_ENGINE": "strata"})[0] == "strata"
    assert requested({"MPITRAMPOLINE_LIB": "/x/libstrata_mpi.so"})[0] == "strata"
    with pytest.raises(ValueError, match="STRATA_ENGINE"):
        requested({"STRATA_ENGINE": "nccl"})


# ---- unmodified programs across processes ----

_ENGINE_OPS = {  # compiled HLO collective -> the engine operator that runs it
    "all-reduce": "engine.all_reduce",
    "all-gather": "engine.all_gather",
    "reduce-scatter": "engine.reduce_scatter",
    "all-to-all": "engine.sendrecv",
    "collective-permute": "engine.recv",
}


def _run_cases(out: Path, seed: int, nproc: int, engine: str | None) -> dict:
    """Runs check_engine.py; returns {case: (where, compiled ops, engine calls)} of rank 0."""
    args = mp.launch_cmd(nproc, "check_engine.py", str(out), str(seed))
    r, text = mp.run_job(args, timeout=240, **({"STRATA_ENGINE": engine} if engine else {}))
    assert r.returncode == 0 and text.count("OK all") == nproc, text[-4000:]
    cases: dict = {}
    for line in r.stdout.splitlines():
        if not line.startswith("[rank 0] "):
            continue
        fields = line[len("[rank 0] ") :].split("\t")
        if fields[0] == "CASE":
            cases[fields[1]] = [json.loads(fields[2]), json.loads(fields[3]), None]
        elif fields[0] == "ENGINE":
            cases[fields[1]][2] = json.loads(fields[2])
    assert len(cases) == 7, text[-3000:]
    return cases


def _load(out: Path, engine: str) -> dict:
    import ml_dtypes

    res: dict = {}
    for f in sorted(glob.glob(str(out / f"{engine}_p*.npz"))):
        for k, v in np.load(f).items():  # npz keeps bfloat16 as 2-byte voids
            res[k] = v.view(ml_dtypes.bfloat16) if v.dtype.kind == "V" and v.itemsize == 2 else v
    assert res, f"no results of {engine}"
    return res


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _check_where(cases: dict, engine: str) -> None:
    for name, (where, ops, calls) in cases.items():
        assert where and set(where) <= {engine, "strata custom call"}, (name, where)
        if engine != "strata engine":
            continue
        for op in ops:  # every kind of XLA collective the program has made engine calls
            if op in _ENGINE_OPS:
                assert calls.get(_ENGINE_OPS[op], 0) >= 1, (name, op, calls)


def test_unmodified_programs_2_processes_bitwise_as_gloo_all_on_the_engine(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    strata = _run_cases(tmp_path, seed, 2, None)  # the default
    gloo = _run_cases(tmp_path, seed, 2, "gloo")
    _check_where(strata, "strata engine")
    _check_where(gloo, "XLA gloo")
    s, g = _load(tmp_path, "strata"), _load(tmp_path, "gloo")
    assert set(s) == set(g) and len(s) > 60
    assert [k for k in s if not _same(s[k], g[k])] == [], f"seed {seed}"


@pytest.mark.slow
def test_unmodified_programs_4_processes(tmp_path):
    """4 processes: bitwise as XLA's in-process communicator (both add the ranks in rank order;
    strata's float16 psum, a custom call, accumulates in float32), bitwise as gloo where the
    order does not matter (gathers, exchanges, integers, max/min), within float32 rounding of
    gloo's ring order elsewhere."""
    seed = int(np.random.default_rng().integers(1 << 30))
    strata = _run_cases(tmp_path, seed, 4, None)
    gloo = _run_cases(tmp_path, seed, 4, "gloo")
    _check_where(strata, "strata engine")
    _check_where(gloo, "XLA gloo")
    script = mp.SCRIPTS / "check_engine.py"
    r, _ = mp.run_job(
        [sys.executable, str(script), str(tmp_path), str(seed), "--devices", "4"], timeout=240
    )
    assert r.returncode == 0 and "OK all" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    s, g, i = _load(tmp_path, "strata"), _load(tmp_path, "gloo"), _load(tmp_path, "inproc")
    assert set(s) == set(g) == set(i)
    f16 = "shard_map/11/"  # jax.lax.psum of float16 (strata's custom call)
    assert [k for k in s if not k.startswith(f16) and not _same(s[k], i[k])] == [], f"seed {seed}"
    order_free = ("all_to_all/", "shard_map/2/", "shard_map/3/", "shard_map/4/", "shard_map/5/",
                  "shard_map/6/", "shard_map/8/", "shard_map/9/", "shard_map/10/")  # fmt: skip
    assert [k for k in s if k.startswith(order_free) and not _same(s[k], g[k])] == []
    for k in s:
        np.testing.assert_allclose(
            s[k].astype(np.float64), g[k].astype(np.float64), rtol=2e-3, atol=1e-5, err_msg=k
        )


def test_failures_are_fast_and_named():
    r, _ = mp.launch(2, "check_engine_faults.py", timeout=120, STRATA_TIMEOUT_S="30")
    out = r.stdout
    faults = {}
    for line in r.stdout.splitlines():
        if line.startswith("[rank 0] FAULT "):
            name, secs, msg = line[len("[rank 0] FAULT ") :].split(" ", 2)
            faults[name] = (float(secs), msg)
    assert set(faults) == {"all_reduce_size", "permute_size", "late", "dead"}, out[-3000:]
    assert "RECOVERED" in r.stdout and r.returncode != 0, out[-2000:]
    secs, msg = faults["all_reduce_size"]
    assert secs < 2 and "ranks disagree" in msg and "409600" in msg and "409598" in msg, msg
    secs, msg = faults["permute_size"]
    assert secs < 2 and "16384 B" in msg and "16392 B" in msg, msg
    secs, msg = faults["late"]
    assert 1.5 < secs < 10 and "timed out" in msg and "rank(s) [1]" in msg, msg
    secs, msg = faults["dead"]
    assert secs < 5 and "exited or was killed" in msg and "rank 1" in msg, msg


def test_wrap_runs_an_unmodified_script():
    """``launch --wrap``: a plain JAX script (no strata_jax; it calls
    jax.distributed.initialize() itself) trains on strata's engine and exits 0."""
    cmd = mp.launch_cmd(2, "unmodified_gspmd.py")
    cmd.insert(cmd.index("--grace"), "--wrap")
    r, out = mp.run_job(cmd, timeout=120, STRATA_DEBUG="INFO")
    assert r.returncode == 0, out[-3000:]
    losses = {rank: [ln for ln in r.stdout.splitlines() if ln.startswith(f"[rank {rank}] loss")]
              for rank in (0, 1)}  # fmt: skip
    assert len(losses[0]) == 3 and [x.split()[-1] for x in losses[0]] == [
        x.split()[-1] for x in losses[1]
    ]
    assert re.search(r"compiled jit_step: .*all-reduce \d+ \(strata engine", out), out[-3000:]


def test_several_devices_per_process_fall_back_to_gloo_and_say_why():
    """XLA's MPI path takes one device per process: with 2 devices each, the job runs over gloo,
    and init() and coverage() say why."""
    r, _ = mp.launch(2, "engine_choice.py", devices=2, timeout=120)
    out = r.stdout
    assert r.returncode == 0, out[-3000:]
    assert "ENGINE gloo" in out and "2 devices per process" in out, out[-3000:]
    assert re.search(r"all-reduce 1 on XLA gloo: strata's engine cannot run: 2 devices", out), out
    assert "TOTAL 6.0" in out


@pytest.mark.parametrize("netns", [False, True], ids=["hosts", "netns"])
def test_several_hosts_fall_back_to_gloo_and_say_what_to_install(netns):
    """Processes on two fabrics (launch --hosts 2, and with --netns each simulated host with its
    own network, /tmp and /dev/shm): strata's engine moves bytes inside one fabric only, so XLA's
    collectives run over gloo with the right value; asked for by name, one stderr line says so,
    and init() and coverage() give the reason with what to install for XLA over a real MPI
    between hosts."""
    if netns and (reason := mp.netns_skip_reason()) is not None:
        pytest.skip(reason)
    cmd = mp.launch_cmd(2, "engine_choice.py")
    at = cmd.index("--grace")
    cmd[at:at] = ["--hosts", "2", "--engine", "strata", *(["--netns"] if netns else [])]
    r, out = mp.run_job(cmd, timeout=180)
    assert r.returncode == 0, out[-3000:]
    assert "ENGINE gloo" in out and "TOTAL 1.0" in out, out[-3000:]
    why = next(line for line in r.stdout.splitlines() if "WHY" in line)
    assert "on 2 fabrics (hosts)" in why and "--engine mpi" in why and "MPIwrapper" in why, why
    assert re.search(r"all-reduce 1 on XLA gloo: .*on 2 fabrics \(hosts\)", out), out[-3000:]
    assert "XLA's collectives between processes run over gloo, not strata's engine" in r.stderr


@pytest.mark.skipif(mp.shutil.which("mpirun") is None, reason="Open MPI's mpirun not installed")
def test_under_mpirun_the_engine_is_strata_and_wrap_runs_an_unmodified_script():
    cmd = mp.mpirun_cmd(2, sys.executable, "-m", "strata_jax.wrap")
    r, out = mp.run_job([*cmd, str(mp.SCRIPTS / "engine_choice.py")], timeout=180)
    assert r.returncode == 0, out[-3000:]
    assert "ENGINE strata" in out and "on strata engine" in out and "TOTAL 1.0" in out, out[-3000:]


def test_compiled_collectives_are_read_from_any_hlo_form():
    from strata_jax._src.compiled_coverage import collectives_in

    hlo = """
  %all-reduce.17 = (f32[], f32[256,512]{1,0}, /*index=5*/f16[8]{0}) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add
  %get-tuple-element.16 = f32[] get-tuple-element(%all-reduce.17), index=0
  %ag = ((f32[4]{0}), bf16[8]{0}) all-gather-start(%x), dimensions={0}
  %ag.done = bf16[8]{0} all-gather-done(%ag)
  %cp = s32[4]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
  %cc = f32[4]{0} custom-call(%z, %pid), custom_call_target="strata_all_reduce", api_version=API_VERSION_TYPED_FFI
"""  # noqa: E501
    assert collectives_in(hlo) == [
        ("all-reduce", ("f16", "f32")),
        ("all-gather", ("bf16", "f32")),
        ("collective-permute", ("s32",)),
        ("custom-call:strata_all_reduce", ()),
    ]


def test_delegate_mode_runs_xla_over_a_real_mpi_with_the_thread_rule_lifted():
    """STRATA_MPI_DELEGATE: libstrata_mpi.so forwards XLA's MPI calls to MPIwrapper (the
    constants copied from it, MPI_THREAD_MULTIPLE, every thread main): a jit + sharding program
    runs over Open MPI through it (benchmarks/gspmd_step.py's XLA-over-MPI baseline). Skipped
    without MPIwrapper and mpirun."""
    real = os.environ.get("MPITRAMPOLINE_LIB", "")
    if not os.path.isfile(real) or mp.shutil.which("mpirun") is None:
        pytest.skip("needs mpirun and MPITRAMPOLINE_LIB naming MPIwrapper's libmpiwrapper.so")
    cmd = mp.launch_cmd(2, "engine_choice.py")
    cmd.insert(cmd.index("--grace"), "--engine")
    cmd.insert(cmd.index("--grace"), "mpi")
    r, out = mp.run_job(cmd, timeout=180, MPITRAMPOLINE_LIB=_library(), STRATA_MPI_DELEGATE=real)
    assert r.returncode == 0, out[-3000:]
    assert "ENGINE mpi" in out and "on XLA MPI" in out and "TOTAL 1.0" in out, out[-3000:]
