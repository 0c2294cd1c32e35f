"""Sphinx configuration: MyST pages, autodoc API reference, generated performance tables."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "strata_jax"
author = "strata_jax authors"
copyright = "2026, strata_jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "strata_docs",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated/**", "perf/**", "examples/**"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "alabaster"
html_title = "strata_jax"
suppress_warnings: list[str] = []
