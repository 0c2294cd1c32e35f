"""Test configuration: 8 in-process CPU devices; strata_jax imported before the JAX backend."""

import os
import re

# The tests are written for 8 CPU devices: a device count from the user's shell
# (XLA_FLAGS=--xla_force_host_platform_device_count=4 or JAX_NUM_CPU_DEVICES=4, which JAX users
# set for their own work) is replaced, not kept (with 4, every 8-device test failed).
os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")
)
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
# LLVM's -O0 for the programs the tests compile (XLA's HLO passes, which decide what the program
# computes, are unchanged; the benchmarks keep XLA's default): a fifth less CPU time, most of a
# test's time being compilation. _mp_util.TEST_XLA_FLAGS passes it to the processes tests start.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import strata_jax  # noqa: E402,F401  (sizes XLA's launch pool before the backend exists)

jax.config.update("jax_enable_x64", True)


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is printed when the test fails."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


# Markers and hypothesis profiles --------------------------------------------------------
# `slow` tests (the full soak, the fault campaign's heavy cases, > 2^31 elements, the rest of
# the dtype x shape grids, long multi-process runs) are left out unless the marker expression
# names them: `pytest -m slow` runs only them, `-m "slow or not slow"` everything. Left out
# means deselected (the summary says "N deselected"), or skipped with the reason when tests were
# named one by one (path::name). Hypothesis: the default profile keeps the property tests to
# seconds; `--hypothesis-profile=long` runs thousands of examples.
try:
    from hypothesis import HealthCheck, settings

    _quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile(
        "default", max_examples=20, deadline=None, suppress_health_check=_quiet, print_blob=True
    )
    settings.register_profile(
        "long", max_examples=2000, deadline=None, suppress_health_check=_quiet, print_blob=True
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # hypothesis is a test extra; test_properties.py skips without it
    pass


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long checks (soak, stress, long multi-process runs, full grids); -m slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("hypothesis_profile", None) == "long":
        for item in items:  # thousands of examples outlast pytest-timeout's 300 s
            if item.get_closest_marker("hypothesis") or "test_properties" in item.nodeid:
                item.add_marker(pytest.mark.timeout(0))
    if "slow" in (config.getoption("markexpr", "") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if any("::" in str(arg) for arg in config.args):  # named one by one: say why not run
        skip = pytest.mark.skip(reason="slow: run with -m slow")
        for item in slow:
            item.add_marker(skip)
    elif slow:
        items[:] = [item for item in items if "slow" not in item.keywords]
        config.hook.pytest_deselected(items=slow)
