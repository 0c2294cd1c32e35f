"""Sphinx extension of the strata_jax docs.

* ``strata-perf``: a directive that renders the benchmark JSON files under ``docs/perf/`` as
  tables and plots (with the machine, date, command and commit each was measured with).
* ``strata-operators``: a directive that renders the operator table (native/common/ops.h, as
  ``strata_jax._src.operators`` reads it) as a table: the docs' list of operators is that table.
* A check that every public name of the documented modules has a docstring: a missing one is a
  Sphinx warning, so ``sphinx -W`` fails on it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# The modules whose public names must all have a docstring (the API reference's modules).
CHECKED_MODULES = ("strata_jax", "strata_jax.moe", "strata_jax.launch")


def _public_names(mod: Any) -> list[str]:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
        names = [n for n in names if getattr(vars(mod)[n], "__module__", None) == mod.__name__]
    return list(names)


def missing_docstrings(module_names: tuple[str, ...] = CHECKED_MODULES) -> list[str]:
    """Qualified names of the public functions, classes, methods and properties with no
    docstring (their own: an inherited one does not count)."""
    missing = []
    for mname in module_names:
        mod = importlib.import_module(mname)
        if not (mod.__doc__ or "").strip():
            missing.append(mname)
        for name in _public_names(mod):
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                continue
            if callable(obj) or inspect.isclass(obj):
                if not (getattr(obj, "__doc__", None) or "").strip():
                    missing.append(f"{mname}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    fn = value.fget if isinstance(value, property) else value
                    if isinstance(fn, (staticmethod, classmethod)):
                        fn = fn.__func__
                    if inspect.isfunction(fn) or isinstance(value, property):
                        if not (fn.__doc__ or "").strip():
                            missing.append(f"{mname}.{name}.{attr}")
    return missing


def _check_docstrings(app: Any) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    for qual in missing_docstrings():
        logger.warning(
            "public name without a docstring: %s (every public name of %s needs one)",
            qual,
            ", ".join(CHECKED_MODULES),
            type="strata",
            subtype="docstring",
        )


def _data_directive() -> Any:
    """``.. strata-data:: PUBLIC_NAME DEFINING_MODULE``: a module constant re-exported by the
    package, documented with the attribute docstring it has where it is defined (autodoc's
    ``autodata`` only looks in the module that it is asked to document)."""
    from docutils.statemachine import StringList
    from sphinx.pycode import ModuleAnalyzer
    from sphinx.util.docutils import SphinxDirective

    class StrataData(SphinxDirective):
        required_arguments = 2

        def run(self) -> list[Any]:
            public, defining = self.arguments
            attr = public.rsplit(".", 1)[1]
            docs = ModuleAnalyzer.for_module(defining).find_attr_docs().get(("", attr))
            if not docs:
                raise self.error(f"strata-data: {defining}.{attr} has no docstring")
            lines = [f".. py:data:: {public}", ""] + ["   " + line for line in docs]
            node_list: list[Any] = []
            from docutils import nodes

            container = nodes.container()
            self.state.nested_parse(StringList(lines), self.content_offset, container)
            node_list.extend(container.children)
            return node_list

    return StrataData


def operator_rows() -> list[list[str]]:
    """The operator table as the docs show it: one row per operator (header first)."""
    from strata_jax._src import operators

    rows = [["operator", "kind", "jax.lax primitives it runs", "FFI target", "comm_stats name",
             "algorithms"]]  # fmt: skip
    for op in operators.OPERATORS:
        rows.append(
            [
                f"``strata_jax.{op.api}``" if op.stats == op.api else f"(inside ``{op.api}``)",
                str(op.kind),
                ", ".join(f"``{p}``" for p in op.lax) or "-",
                f"``{op.target}``",
                f"``{op.stats}``",
                ", ".join(op.algorithms),
            ]
        )
    return rows


def _operators_directive() -> Any:
    """``.. strata-operators::``: the operator table (:func:`operator_rows`) as a table."""
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    class StrataOperators(SphinxDirective):
        def run(self) -> list[Any]:
            from docutils import nodes

            rows = operator_rows()
            lines = [".. list-table::", "   :header-rows: 1", ""]
            for row in rows:
                lines.append("   * - " + row[0])
                lines += ["     - " + cell for cell in row[1:]]
            container = nodes.container()
            self.state.nested_parse(StringList(lines), self.content_offset, container)
            return list(container.children)

    return StrataOperators


def setup(app: Any) -> dict[str, Any]:
    """Register the docstring check and the ``strata-perf`` directive (Sphinx entry point)."""
    import strata_perf

    app.add_directive("strata-data", _data_directive())
    app.add_directive("strata-operators", _operators_directive())

    app.connect("builder-inited", _check_docstrings)
    strata_perf.setup(app)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
