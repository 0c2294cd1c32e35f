"""The version is written in one place (strata_jax/__init__.py) and everything else agrees."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import strata_jax

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_the_package_metadata():
    """pyproject.toml reads __version__ (scikit-build-core's regex provider): the installed
    metadata, editable or not, carries the same string."""
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", strata_jax.__version__)
    installed = importlib.metadata.version("strata_jax")
    assert installed == strata_jax.__version__, (
        f"metadata {installed} != __version__ {strata_jax.__version__}: reinstall after a bump"
    )


def test_version_is_written_once_and_has_a_changelog_section():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M), "version must stay dynamic"
    assert not re.search(r"^version\s*=", pyproject, re.M), "a second place for the version"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{strata_jax.__version__}]" in changelog, "CHANGELOG.md has no section for it"
