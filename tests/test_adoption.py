"""What a new user meets first: running the tests and scripts from the repository root, a
missing native extension, the launcher's pitfalls (forgetting init(), init() after jax), the
dispatch-ahead deadlock when strata_jax is imported late, narrow dtypes and pmap.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from io import BytesIO
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mp_util import MISUSE_CASES, environ_without_settings, run_python, write_script
from jax.sharding import PartitionSpec as P

import strata_jax as sj
from strata_jax import launch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INSTALLED = Path(sj.__file__).resolve().parent


def _clean_env(**extra: str) -> dict[str, str]:
    return environ_without_settings("PJRT_NPROC", **extra)


def _run(args, *, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    return run_python(args, cwd=cwd, env=env if env is not None else _clean_env(), timeout=timeout)


def _script(tmp_path: Path, body: str, name: str = "script.py") -> str:
    return write_script(tmp_path, body, name)


needs_unbuilt_source = pytest.mark.skipif(
    INSTALLED == ROOT / "strata_jax",
    reason="the source folder itself is the imported package (built in place)",
)


# ------------------------------------------------------------------------------------------
# Section 1: the repository root does not shadow the installed package
# ------------------------------------------------------------------------------------------


@needs_unbuilt_source
def test_import_from_repo_root_uses_the_built_package():
    code = "import strata_jax, sys; print(sys.modules['strata_jax'].__file__)"
    r = _run(["-c", code], cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == str(INSTALLED / "__init__.py"), r.stdout


@pytest.mark.slow
@needs_unbuilt_source
def test_python_m_pytest_from_repo_root(tmp_path):
    r = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_collectives.py::test_pmean"],
        cwd=ROOT,
        timeout=240,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert " passed" in r.stdout


def test_missing_extension_says_what_to_run(tmp_path):
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("*.so", "__pycache__")
    shutil.copytree(ROOT / "strata_jax", src / "strata_jax", ignore=skip)
    # -S: no site-packages, so no installed copy to fall back to.
    r = _run(["-S", "-c", "import strata_jax"], cwd=src, env=_clean_env(PYTHONPATH=str(src)))
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "native extension" in r.stderr, r.stderr[-2000:]
    assert 'pip install ".[test]"' in r.stderr
    assert r.stderr.count("is not built") == 1


@needs_unbuilt_source
def test_launcher_from_repo_root_uses_installed_package_and_allocator(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, strata_jax
        from strata_jax import launch
        print("pkg", strata_jax.__file__)
        print("preload", os.environ.get("LD_PRELOAD", ""))
        """,
    )
    r = _run(["-m", "strata_jax.launch", "-n", "1", script], cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"pkg {INSTALLED / '__init__.py'}" in r.stdout, r.stdout
    assert str(ROOT / "build") not in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------
# Section 5: launcher pitfalls
# ------------------------------------------------------------------------------------------


def test_launcher_drops_gloo_connection_lines():
    src = BytesIO(
        b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
        b"ranks is : 1\nresult 3\n[Gloo] something else\n"
    )
    out = BytesIO()
    src.close = lambda: None
    launch._pump(src, out, b"[rank 1] ", __import__("threading").Lock())
    assert out.getvalue() == b"[rank 1] result 3\n[rank 1] [Gloo] something else\n"


@pytest.mark.parametrize(
    "body, expected",
    MISUSE_CASES,
    ids=["forgot_init", "init_after_jax"],
)
def test_launcher_misuse_fails_with_the_fix(tmp_path, body, expected):
    script = _script(tmp_path, body)
    r = _run(["-m", "strata_jax.launch", "-n", "2", "--no-preload", script], cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert "result" not in r.stdout and "no error" not in r.stdout
    assert expected in r.stderr, r.stderr[-3000:]


# ------------------------------------------------------------------------------------------
# Section 5: the dispatch-ahead deadlock when strata_jax is imported after the backend
# ------------------------------------------------------------------------------------------

LATE_IMPORT = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
jax.devices()  # the backend exists before strata_jax sizes the launch pool
import warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import strata_jax as sj
    from strata_jax._src import runtime
print("warned", any("imported after JAX created" in str(x.message) for x in w))
mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda a: sj.psum(a, "x") * 0.5, mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
x = jnp.ones(8)
f.lower(x)  # first strata lowering: the pool is checked
print("pool", runtime.launch_pool["threads"], runtime.launch_pool["devices"],
      runtime.launch_pool["set_in_time"])
print("timeout", sj.get_timeout())
if sys.argv[1:] == ["run"]:
    t0 = time.monotonic()
    try:
        for _ in range(200):
            x = f(x)
        jax.block_until_ready(x)
        print("no deadlock")
    except Exception as e:
        print("elapsed", round(time.monotonic() - t0))
        print("error", " ".join(str(e).split())[-3000:])
"""


def _late_env():
    # 8 devices and 2 pool threads: fewer than 2N whatever the machine's core count.
    return _clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", NPROC="2")


def test_late_import_gets_short_timeout_and_explanation(tmp_path):
    r = _run([_script(tmp_path, LATE_IMPORT)], cwd=tmp_path, env=_late_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warned True" in r.stdout
    assert "pool 8 8 False" in r.stdout, r.stdout
    assert "timeout 20.0" in r.stdout, r.stdout


@pytest.mark.slow
def test_late_import_dispatch_ahead_deadlock_fails_fast_and_says_why(tmp_path):
    r = _run([_script(tmp_path, LATE_IMPORT), "run"], cwd=tmp_path, env=_late_env(), timeout=150)
    out = r.stdout
    if "no deadlock" in out:
        pytest.skip("XLA did not deadlock this time")
    assert "error" in out, (out + r.stderr)[-3000:]
    assert "dispatch-ahead deadlock" in out and "import strata_jax before" in out, out
    assert int(out.split("elapsed ")[1].split()[0]) < 60, out


# ------------------------------------------------------------------------------------------
# Section 5: narrow dtypes and pmap
# ------------------------------------------------------------------------------------------

NARROW = ["int4", "uint4", "float8_e4m3fn", "float8_e5m2"]


def _shard(body, x, out_specs=None):
    out_specs = P() if out_specs is None else out_specs
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs))(x)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin"])
def test_narrow_dtype_reductions_match_jax_lax(rng, dtype, op):
    dt = jnp.dtype(dtype)
    hi = 1 if jnp.issubdtype(dt, jnp.integer) else 4
    lo = 0 if dtype.startswith("u") else -hi
    x = jnp.asarray(rng.integers(lo, hi + 1, size=(8, 16)).astype(np.float32)).astype(dt)
    got = _shard(lambda a: getattr(sj, op)(a, "x"), x)
    want = _shard(lambda a: getattr(jax.lax, op)(a, "x"), x)
    assert got.dtype == want.dtype == dt
    np.testing.assert_array_equal(np.asarray(got.astype(np.float32)), want.astype(np.float32))


@pytest.mark.parametrize("dtype", ["int4", "float8_e4m3fn"])
def test_narrow_dtype_data_movement_is_exact(rng, dtype):
    x = jnp.asarray(rng.integers(0, 2, size=(8, 8)).astype(np.float32)).astype(dtype)
    perm = [(i, (i + 3) % 8) for i in range(8)]
    for f, g, spec in [
        (lambda a: sj.all_gather(a, "x"), lambda a: jax.lax.all_gather(a, "x"), P("x")),
        (lambda a: sj.ppermute(a, "x", perm), lambda a: jax.lax.ppermute(a, "x", perm), P("x")),
        (
            lambda a: sj.all_to_all(a, "x", 1, 1, tiled=True),
            lambda a: jax.lax.all_to_all(a, "x", 1, 1, tiled=True),
            P("x"),
        ),
    ]:
        got, want = _shard(f, x, spec), _shard(g, x, spec)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_pmap_runs_on_strata_and_matches_jax_lax(rng):
    x = jnp.asarray(rng.standard_normal((8, 5)).astype(np.float32))
    perm = [(i, (i + 1) % 8) for i in range(8)]
    for f, g in [
        (lambda a: sj.psum(a, "i"), lambda a: jax.lax.psum(a, "i")),
        (lambda a: sj.pmean(a, "i"), lambda a: jax.lax.pmean(a, "i")),
        (lambda a: sj.all_gather(a, "i"), lambda a: jax.lax.all_gather(a, "i")),
        (lambda a: sj.ppermute(a, "i", perm), lambda a: jax.lax.ppermute(a, "i", perm)),
    ]:
        pf = jax.pmap(f, axis_name="i")
        assert "strata_" in pf.lower(x).as_text()
        np.testing.assert_allclose(pf(x), jax.pmap(g, axis_name="i")(x), rtol=1e-6)
    grad = jax.pmap(jax.grad(lambda a: sj.psum(a, "i").sum()), axis_name="i")(x)
    np.testing.assert_allclose(grad, np.ones_like(x) * 8)


def test_collectives_benchmark_sizes_follow_nccl_tests():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _args import size_sweep
    finally:
        sys.path.pop(0)
    assert size_sweep(8, 64, 2) == [8, 16, 32, 64]
    assert size_sweep(8, 100, 4) == [8, 32]
    assert 4096 in size_sweep(8, 64 << 20, 2)


def test_benchmark_timer_reports_cpu_per_call():
    """time_interleaved's ``cpu`` (the benchmarks' ``cores`` column): a call that burns 10 ms
    of CPU reports at least that; one that sleeps reports far less than it waited."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _timing import time_interleaved
    finally:
        sys.path.pop(0)
    import time

    def burn():
        c0 = time.process_time()
        while time.process_time() - c0 < 0.01:
            pass

    cpu: dict[str, list[float]] = {}
    times, _ = time_interleaved(
        {"burn": burn, "sleep": lambda: time.sleep(0.05)}, 3, 0, block=lambda v: v, cpu=cpu
    )
    assert len(cpu["burn"]) == len(cpu["sleep"]) == 3
    assert min(cpu["burn"]) >= 0.01
    assert min(times["sleep"]) >= 0.05 and max(cpu["sleep"]) < 0.025


def test_benchmark_timer_aligns_before_every_call_outside_the_timing():
    """time_interleaved's ``align`` (collectives.py under several processes: the processes'
    barrier) runs before every call of every implementation, warm-up included, and its time is
    not charged to the call after it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _timing import time_interleaved
    finally:
        sys.path.pop(0)
    import time

    order: list[str] = []

    def align():
        order.append("align")
        time.sleep(0.02)

    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    times, _ = time_interleaved(fns, 3, 1, block=lambda v: v, align=align)
    assert order == ["align", "a", "align", "b"] * 4
    assert max(times["a"] + times["b"]) < 0.01


def test_benchmark_timer_batches_consecutive_calls_after_one_align():
    """time_interleaved's ``batch`` (collectives.py under several processes): after each align,
    one untimed call, then ``batch`` timed calls of the same implementation, their mean as the
    sample; warm-up rounds make one call each; implementations alternate sample by sample."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _timing import time_interleaved
    finally:
        sys.path.pop(0)
    import time

    order: list[str] = []

    def slow_first():  # 30 ms only the first call after an align, 1 ms after that
        time.sleep(0.03 if order[-1] == "A" else 0.001)
        order.append("s")

    fns = {"s": slow_first, "q": lambda: order.append("q")}
    times, _ = time_interleaved(fns, 2, 1, block=lambda v: v, align=lambda: order.append("A"),
                                  batch=3)  # fmt: skip
    assert "".join(order) == "AsAq" + "AssssAqqqq" * 2
    assert len(times["s"]) == len(times["q"]) == 2
    # the align's straggler (30 ms) fell on the untimed call: each sample is ~1 ms per call
    assert max(times["s"]) < 0.01 and min(times["s"]) >= 0.001


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_collectives_benchmark_numpy_oracle_matches_jax_lax(dtype):
    """benchmarks/collectives.py checks every implementation (jax.lax too) against numpy: its
    expected outputs equal jax.lax's for every operator, rank by rank."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _collective_ops as B
    finally:
        sys.path.pop(0)
    n = 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    rng = np.random.default_rng(7)
    for op in B.OPS:
        host = B.random_array(rng, n * 48, np.dtype(jnp.dtype(dtype)), n)
        want = B.numpy_reference(op, host, n)
        f = jax.jit(
            jax.shard_map(
                B.make_body(B._LaxForBench(), op, n), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )
        )
        got = np.asarray(f(host)).reshape(n, -1)
        tol = B.float_tolerance(np.dtype(jnp.dtype(dtype)), n, 1.0) if dtype != "int32" else 0
        for r in range(n):
            np.testing.assert_allclose(
                got[r].astype(np.float64), want[r].astype(np.float64), atol=tol, err_msg=op
            )


def test_no_exchange_removes_every_exchange_and_restores_jax_lax():
    """The benchmarks' communication-free bound (impl nocomm): while tracing, the program has
    no collective left; afterwards jax.lax is itself again."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _nocomm import no_exchange
    finally:
        sys.path.pop(0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    body = lambda v: jax.lax.pmean(jax.lax.all_to_all(v, "x", 0, 0, tiled=True), "x")  # noqa: E731

    def f():  # a new jit each time: jit caches the trace made inside the context
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        )

    x = jnp.arange(32.0).reshape(16, 2)
    originals = (jax.lax.all_to_all, jax.lax.psum, jax.lax.pmean)
    with no_exchange():
        text = f().lower(x).as_text()
        with pytest.raises(ValueError, match="split_axis != concat_axis"):
            jax.lax.all_to_all(x, "x", 0, 1)
    assert "all_to_all" not in text and "all_reduce" not in text, text
    assert (jax.lax.all_to_all, jax.lax.psum, jax.lax.pmean) == originals
    assert "all_to_all" in f().lower(x).as_text()


def test_no_exchange_meet_keeps_one_meeting_per_exchange_and_moves_nothing():
    """impl meet: every replaced exchange becomes one 1-element strata psum (forward, and again
    for its cotangent under grad), no jax.lax collective is left, and the values pass through
    unchanged (identity, as nocomm)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _nocomm import no_exchange
    finally:
        sys.path.pop(0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(v):
        y = jax.lax.all_to_all(v * v, "x", 0, 0, tiled=True)
        y = y * jax.lax.psum(1, "x")  # not an array: passes through (1), as in nocomm
        return jax.lax.pmean({"a": y, "b": y[:1] * 2}, "x")

    def f(grad):  # a new jit each time: jit caches the trace made inside the context
        fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        if grad:
            # value_and_grad, as the training steps: the loss keeps the forward's meetings
            return jax.jit(jax.value_and_grad(lambda v: jnp.sum(fn(v)["a"]) + jnp.sum(fn(v)["b"])))
        return jax.jit(fn)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 2)), jnp.float32)
    with no_exchange(meet=True):
        fwd, bwd = f(False), f(True)
        text_f, text_b = fwd.lower(x).as_text(), bwd.lower(x).as_text()
        out, (loss, g) = fwd(x), bwd(x)
    for text in (text_f, text_b):
        assert "stablehlo.all_to_all" not in text and "stablehlo.all_reduce" not in text, text
    # forward: one meeting for the all_to_all, one for the pmean's two leaves
    assert text_f.count("call @strata_all_reduce") == 2, text_f
    # grad: fn traced twice (2 x 2), and each exchange's cotangent meets again (2 x 2)
    assert text_b.count("call @strata_all_reduce") == 8, text_b
    # In the compiled program every meeting's result still feeds the data (an optimization
    # barrier did not: XLA:CPU dropped it and ran the work after an exchange before its
    # meeting).
    with no_exchange(meet=True):
        hlo = f(False).lower(x).compile().as_text()
    calls = re.findall(r"(%[\w.-]+) = \([^)]*\) custom-call\(.*strata_all_reduce", hlo)
    assert len(calls) == 2, hlo
    for call in calls:
        gte = re.search(rf"(%[\w.-]+) = \S+ get-tuple-element\({re.escape(call)}\), index=0", hlo)
        assert gte and re.search(rf"\(.*{re.escape(gte[1])}[,)]", hlo.replace(gte[0], "")), (
            f"the result of {call} feeds nothing:\n{hlo}"
        )
    sq = np.asarray(x) ** 2
    np.testing.assert_array_equal(np.asarray(out["a"]), sq)
    np.testing.assert_array_equal(np.asarray(out["b"]), sq[::4] * 2)
    np.testing.assert_allclose(float(loss), sq.sum() + 2 * sq[::4].sum(), rtol=1e-5)
    want = 2 * np.asarray(x)  # d/dv sum(v*v)
    want[::4] += 2 * 2 * np.asarray(x)[::4]  # and the first row of each shard in "b"
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Section 3: python -m strata_jax.info
# ------------------------------------------------------------------------------------------


def test_info_reports_versions_pool_and_allocator(tmp_path):
    env = _clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = _run(["-m", "strata_jax.info"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    for key in ("strata_jax ", "jaxlib ", "python ", "cpu ", "cores ", "devices ", "PJRT_NPROC "):
        assert key in r.stdout, r.stdout
    assert "PJRT_NPROC set in time   : True" in r.stdout, r.stdout
    assert "launch pool threads      : 64 for 4 local devices" in r.stdout, r.stdout
    # No LD_PRELOAD: import strata_jax hooked the allocator into jaxlib (allocator.py).
    assert "allocator                : hook" in r.stdout, r.stdout
