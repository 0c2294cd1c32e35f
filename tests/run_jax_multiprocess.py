"""JAX's own multi-process collective tests (jax's ``tests/multiprocess``, at the tag of the
installed jax) over strata's engine, and over gloo for comparison.

    python tests/run_jax_multiprocess.py                      # clones jax's tests at the tag
    python tests/run_jax_multiprocess.py --jax-git PATH       # a jax git checkout or mirror
    python tests/run_jax_multiprocess.py --engines strata --nproc 4 all_reduce_test

The test files are taken from jax's repository at the tag of the installed jax (``git archive``
into a scratch folder that is removed afterwards; nothing of them is copied into this
repository) and run unmodified with JAX's own harness (``jax._src.test_multiprocess``: each
file starts its N worker processes, which call ``jax.distributed.initialize`` themselves). A
``sitecustomize.py`` in the scratch folder makes each worker import strata_jax before jax (so
XLA's collectives run on strata's engine, ``STRATA_ENGINE=strata``) and call
``strata_jax.init()`` right after JAX's ``jax.distributed.initialize``, before the backend
exists; with ``--engines gloo`` the same files run over JAX's gloo. Prints, per file and
engine, the tests run, passed, failed, errored and skipped (from the workers' logs), and the
engine calls strata's engine made. Exit code 1 if a file passes over gloo and fails over
strata's engine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

COLLECTIVE_TESTS = (
    "all_reduce_test",
    "all_gather_test",
    "all_to_all_test",
    "axis_index_test",
    "pmap_test",
    "pjit_test",
    "multihost_utils_test",
    "array_test",
    "device_id_test",
)

SITECUSTOMIZE = """
import os, site, sys
# JAX's harness starts its workers as /proc/self/exe, the base interpreter: a virtual
# environment's packages (and an editable install's import hook) come back from here.
for _d in SITE_DIRS:
    site.addsitedir(_d)
if any(a.startswith("--multiprocess_test_worker_id=") and not a.endswith("=-1") for a in sys.argv):
    if os.environ.get("STRATA_ENGINE") == "strata":
        import strata_jax  # before jax: XLA's collectives on strata's engine
        from jax._src import distributed
        _real = distributed.initialize

        def initialize(*args, **kwargs):
            _real(*args, **kwargs)
            strata_jax.init()  # the fabric and the engine, before the backend exists

        distributed.initialize = initialize
        import atexit

        def _report():
            ops = strata_jax.comm_stats()["ops"]
            calls = {k: v["calls"] for k, v in ops.items() if k.startswith("engine.")}
            sys.stderr.write(f"STRATA_ENGINE_CALLS {calls}\\n")

        atexit.register(_report)
"""


def extract(jax_git: str | None, tag: str, dest: str) -> str:
    """jax's tests/multiprocess at `tag` under dest; returns the folder."""
    src = jax_git
    if src is None:
        src = os.path.join(dest, "jax.git")
        subprocess.run(
            ["git", "clone", "--bare", "--depth", "1", "--branch", tag,
             "https://github.com/jax-ml/jax", src],
            check=True,
        )  # fmt: skip
    git = (
        ["git", "-C", src]
        if os.path.isdir(os.path.join(src, ".git"))
        else ["git", "--git-dir", src]
    )
    archive = subprocess.run(
        [*git, "archive", tag, "tests/multiprocess"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return os.path.join(dest, "tests", "multiprocess")


def summarize(logdir: str, nproc: int) -> dict:
    """Counts of the workers' unittest summaries (worker 0's), and the engine calls."""
    out = {"ran": 0, "failures": 0, "errors": 0, "skipped": 0, "ok": False, "calls": ""}
    try:
        err = open(os.path.join(logdir, "jax_0_stderr.log"), errors="replace").read()
    except OSError:
        return out
    m = re.search(r"Ran (\d+) tests?", err)
    out["ran"] = int(m.group(1)) if m else 0
    for key in ("failures", "errors", "skipped"):
        m = re.search(rf"{key}=(\d+)", err)
        out[key] = int(m.group(1)) if m else 0
    out["ok"] = bool(re.search(r"^OK\b", err, re.M))
    m = re.search(r"STRATA_ENGINE_CALLS (.*)", err)
    out["calls"] = m.group(1) if m else ""
    out["tail"] = err[-1500:]
    return out


def main() -> int:
    import jax

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="*", default=list(COLLECTIVE_TESTS))
    p.add_argument("--jax-git", default=None, help="a jax git checkout or bare mirror")
    p.add_argument("--tag", default=f"jax-v{jax.__version__}")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--engines", default="strata,gloo")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    a = p.parse_args()
    import site

    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    scratch = tempfile.mkdtemp(prefix="strata-jax-mp-")
    results = {}
    try:
        tests_dir = extract(a.jax_git, a.tag, scratch)
        with open(os.path.join(scratch, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE.replace("SITE_DIRS", repr(site_dirs)))
        print(f"jax {jax.__version__}, tests of {a.tag}, {a.nproc} processes, in {scratch}")
        for name in a.tests:
            for engine in a.engines.split(","):
                logdir = os.path.join(scratch, f"logs-{name}-{engine}")
                os.makedirs(logdir)
                env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "JAX_"))}
                env.update(
                    PYTHONPATH=os.pathsep.join([scratch, env.get("PYTHONPATH", "")]),
                    TEST_UNDECLARED_OUTPUTS_DIR=logdir,
                    STRATA_ENGINE=engine,
                )
                impl = "mpi" if engine == "strata" else "gloo"
                cmd = [sys.executable, os.path.join(tests_dir, f"{name}.py"),
                       f"--num_processes={a.nproc}",
                       f"--cpu_collectives_implementation={impl}"]  # fmt: skip
                t = time.monotonic()
                try:
                    r = subprocess.run(cmd, env=env, cwd=scratch, capture_output=True,
                                       text=True, timeout=a.timeout)  # fmt: skip
                    rc = r.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                s = summarize(logdir, a.nproc)
                s.update(rc=rc, seconds=time.monotonic() - t)
                results[(name, engine)] = s
                print(
                    f"{name:24s} {engine:6s} rc={rc} ran={s['ran']} failures={s['failures']} "
                    f"errors={s['errors']} skipped={s['skipped']} {s['seconds']:.0f}s "
                    f"{s['calls']}",
                    flush=True,
                )
                if rc != 0 and s.get("tail"):
                    print("    " + s["tail"].replace("\n", "\n    ")[-1200:])
    finally:
        if a.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    def rc(name: str, engine: str):
        return results.get((name, engine), {}).get("rc")

    worse = [n for n in a.tests if rc(n, "gloo") == 0 and rc(n, "strata") != 0]
    if worse:
        print("fail over strata's engine but pass over gloo:", ", ".join(worse))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
