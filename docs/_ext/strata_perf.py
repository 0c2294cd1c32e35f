"""The ``strata-perf`` directive: benchmark JSON files in docs/perf/ rendered as tables."""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


class StrataPerf(SphinxDirective):
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        return [nodes.paragraph(text="(no benchmark output committed yet)")]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("strata-perf", StrataPerf)
    return {}
