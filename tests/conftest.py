"""Test configuration: 8 in-process CPU devices; strata_jax imported before the JAX backend."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long checks, run only when selected (`pytest -m slow`)"
    )


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
