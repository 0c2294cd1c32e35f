"""The one door to JAX's internals (strata_jax/_src/jax_compat.py) and the supported range.

Runs on whichever JAX is installed; CI runs it on both ends of the range (.ci/run: jax 0.10.2 on
Python 3.11, the newest tested JAX on Python 3.13 through .ci/newest-jax).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import jax
import pytest
import tomllib

import strata_jax  # noqa: F401
from strata_jax._src import extension, jax_compat

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "strata_jax"


def test_no_module_but_jax_compat_imports_jax_internals():
    """Every ``jax._src`` import of the package goes through jax_compat (what moved between
    releases is met in that one file)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "jax_compat.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("jax._src")
            ]
    assert not offenders, offenders


def test_pyproject_accepts_the_tested_range_without_an_upper_bound():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in ("jax", "jaxlib"):
        (spec,) = [d for d in deps if re.match(rf"{name}\b", d) and not d.startswith(f"{name}-")]
        assert f">={jax_compat.TESTED[0]}" in spec, spec
        assert "<" not in spec, f"an upper bound on {name}: {spec}"
        for broken in jax_compat.BROKEN:
            assert f"!={broken}" in spec, spec


def _warnings_for(monkeypatch, version: str) -> list[str]:
    monkeypatch.setattr(jax, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_compat.warn_if_untested()
    return [str(w.message) for w in caught]


def test_a_newer_jax_gets_one_warning_naming_the_tested_range(monkeypatch):
    newest = jax_compat._version(jax_compat.TESTED[1])
    for newer in (f"{newest[0]}.{newest[1] + 1}.0", f"{newest[0]}.{newest[1]}.{newest[2] + 1}"):
        (msg,) = _warnings_for(monkeypatch, newer)
        assert f"jax {newer}" in msg and jax_compat.TESTED[0] in msg, msg
        assert jax_compat.TESTED[1] in msg, msg
    assert _warnings_for(monkeypatch, jax_compat.TESTED[1]) == []
    assert _warnings_for(monkeypatch, jax_compat.TESTED[0]) == []


def test_a_known_broken_jax_is_named(monkeypatch):
    for broken, why in jax_compat.BROKEN.items():
        (msg,) = _warnings_for(monkeypatch, broken)
        assert f"jax {broken}" in msg and why in msg


def test_importing_strata_warns_only_outside_the_tested_range():
    r = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import strata_jax"],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
    )
    assert r.returncode == 0, r.stderr
    tested = jax_compat._version(jax.__version__) <= jax_compat._version(jax_compat.TESTED[1])
    assert ("is tested with jax/jaxlib" in r.stderr) != tested, r.stderr


def test_an_extension_built_for_a_newer_ffi_api_is_refused_with_the_fix():
    running = extension._installed_ffi_api()
    assert running is not None
    real = extension.load().build_info()
    assert tuple(real["ffi_api"]) <= running  # what this checkout built
    newer = types.SimpleNamespace(
        build_info=lambda: {"jaxlib": "9.9.9", "ffi_api": (running[0], running[1] + 1)}
    )
    with pytest.raises(ImportError, match=r"jaxlib 9\.9\.9.*--force-reinstall"):
        extension.check_build(newer)
    same = types.SimpleNamespace(build_info=lambda: {"jaxlib": "x", "ffi_api": running})
    extension.check_build(same)


def test_importing_strata_refuses_an_extension_built_for_a_newer_ffi_api(tmp_path):
    """The check runs at ``import strata_jax``, not at the first strata call inside a traced
    program: here the running jaxlib's headers say an older FFI API than the build's."""
    built = tuple(extension.load().build_info()["ffi_api"])
    older = (built[0], built[1] - 1) if built[1] > 0 else (built[0] - 1, 99)
    api = tmp_path / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    (api / "c_api.h").write_text(
        f"#define XLA_FFI_API_MAJOR {older[0]}\n#define XLA_FFI_API_MINOR {older[1]}\n"
    )
    code = f"import jax\njax.ffi.include_dir = lambda: {str(tmp_path)!r}\nimport strata_jax\n"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent
    )
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("ImportError: strata_jax's native extension was built against"), err
    assert f"(API {built[0]}.{built[1]})" in err and f"(API {older[0]}.{older[1]})" in err, err
    assert "pip install --no-cache-dir --force-reinstall --no-deps" in err, err


def test_closed_jaxprs_are_met_on_every_release():
    closed = jax.make_jaxpr(lambda x: x * 2 + 1)(1.0)
    assert jax_compat.is_jaxpr(closed) and jax_compat.is_closed(closed)
    open_ = jax_compat.open_jaxpr(closed)
    assert jax_compat.is_jaxpr(open_)
    doubled = jax_compat.map_closed(closed, lambda j: j.replace(eqns=[*j.eqns, *j.eqns[:0]]))
    assert jax_compat.is_closed(doubled)
    assert jax.core.eval_jaxpr(jax_compat.open_jaxpr(doubled), doubled.consts, 3.0)[0] == 7.0
    assert jax_compat.as_closed(closed) is closed


def test_every_jax_lax_collective_primitive_is_hooked_or_named():
    """Each collective primitive of the running release's jax.lax lowers through strata's
    hook (to strata, or to XLA with a recorded reason): none is silently JAX's alone."""
    from strata_jax._src import lax_hooks

    hooked = {p for p, _, _ in lax_hooks._HOOKS} | set(lax_hooks._ASYNC)
    hooked |= {p for p, _ in lax_hooks._UNSUPPORTED}
    parallel = jax_compat.lax_parallel
    # Not collectives of their own: the index, point-to-point halves, the *_done ends of the
    # asynchronous forms (their *_start is hooked) and the type casts.
    collectives = {
        v
        for k, v in vars(parallel).items()
        if k.endswith("_p")
        and isinstance(v, jax_compat.core.Primitive)
        and v.name not in ("axis_index", "psend", "precv", "preduced")
        and not v.name.endswith("_done")
        and "cast" not in v.name
    }
    missing = sorted(p.name for p in collectives - hooked)
    assert not missing, missing


def test_the_backend_callback_runs_for_a_backend_made_later():
    """jax_compat.on_backend_created: JAX's hook up to 0.10, the CPU factory wrapped from 0.11."""
    code = (
        "import strata_jax\n"
        "from strata_jax._src import jax_compat, runtime\n"
        "seen = []\n"
        "jax_compat.on_backend_created(lambda b: seen.append(b.platform))\n"
        "import jax; jax.devices()\n"
        "print(seen, runtime.launch_pool['set_in_time'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['cpu'] True", r.stdout
