"""Every code block of README.md and docs/ runs (or, for shell commands, names what exists).

* ```python blocks: each page's blocks run in order in one namespace (a page reads like a
  notebook), every page in a fresh namespace; all pages share one subprocess (one JAX start-up)
  whose CPU device count the blocks set themselves (``jax.config.update("jax_num_cpu_devices",
  N)``, as the README example does). A block fails the test of its page with its traceback.
* docs/examples/*.py: each runs as a script in its own subprocess.
* ```bash blocks: not run (they train models, start jobs, install packages); every script they
  name must exist, and every ``--flag`` given to a benchmark or to the launcher must be one that
  script defines.
* A block preceded by ``<!-- skip-test: reason -->`` (on the line just before its fence) is
  left out; the reason is required.

The docs build itself (``sphinx -W``) runs in .ci/run; test_docs_build_has_no_missing_docstrings
checks the docstring rule without Sphinx.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_RE = re.compile(r"<!--\s*skip-test:\s*(\S.*?)\s*-->")
FENCE_RE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def doc_pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    pages += sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return pages


def code_blocks(path: Path) -> list[dict]:
    """Fenced blocks of a Markdown file: language, code (dedented), first line, skip reason."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = lines[start - 1] if start > 0 else ""
        skip = SKIP_RE.search(prev)
        blocks.append(
            dict(
                lang=lang,
                code=textwrap.dedent("\n".join(body)) + "\n",
                line=start + 1,
                skip=skip.group(1) if skip else None,
            )
        )
    return blocks


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


PY_PAGES = [
    p for p in doc_pages() if any(b["lang"] == "python" and not b["skip"] for b in code_blocks(p))
]

# Runs in the subprocess: every page's python blocks in order, in a fresh namespace per page.
RUNNER = r"""
import contextlib, io, json, sys, traceback
pages = json.loads(sys.stdin.read())
results = {}
for page, blocks in pages.items():
    ns = {"__name__": "__docs__"}
    out = io.StringIO()
    err = None
    for line, code in blocks:
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{page}:{line}", "exec"), ns)
        except BaseException:
            err = f"block at line {line}:\n" + traceback.format_exc()
            break
    results[page] = {"error": err, "stdout": out.getvalue()}
print("DOCS-RESULTS " + json.dumps(results), flush=True)
"""

# What a page's blocks must print (the values their comments promise).
EXPECTED_OUTPUT = {
    "README.md": "[7. 8.]",
    "docs/getting-started.md": "[7. 8.]",
    "docs/guide/existing-code.md": "[7. 8.]",
}


DEVICES_RE = re.compile(r"jax_num_cpu_devices[\"']\s*,\s*(\d+)")


def _device_count(blocks: list[tuple[int, str]]) -> int:
    """The CPU device count a page's blocks ask for (0: they do not say). Pages that ask for
    different counts run in different subprocesses: a JAX backend has one count for life."""
    found = {int(n) for _, code in blocks for n in DEVICES_RE.findall(code)}
    assert len(found) <= 1, f"one page asks for several device counts: {sorted(found)}"
    return found.pop() if found else 0


@pytest.fixture(scope="module")
def python_block_results() -> dict[str, dict]:
    pages = {
        _rel(p): [
            (b["line"], b["code"])
            for b in code_blocks(p)
            if b["lang"] == "python" and not b["skip"]
        ]
        for p in PY_PAGES
    }
    groups: dict[int, dict] = {}
    for page, blocks in pages.items():
        groups.setdefault(_device_count(blocks), {})[page] = blocks
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the blocks set their device count themselves
    env.pop("JAX_NUM_CPU_DEVICES", None)
    results: dict[str, dict] = {}
    for group in groups.values():
        r = subprocess.run(
            [sys.executable, "-c", RUNNER],
            input=json.dumps(group),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=280,
        )
        line = next((x for x in r.stdout.splitlines() if x.startswith("DOCS-RESULTS ")), None)
        if line is None:
            pytest.fail(
                f"the docs runner died (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )
        results.update(json.loads(line[len("DOCS-RESULTS ") :]))
    return results


def test_runner_reports_a_failing_block_and_the_output():
    """The runner above can fail: a block that raises is reported with its line, and what the
    blocks print comes back (no JAX needed for this page)."""
    page = {"page.md": [(3, "x = 1\nprint('hello', x)"), (9, "assert x == 2, 'x is 1'")]}
    r = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(page),
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = next(x for x in r.stdout.splitlines() if x.startswith("DOCS-RESULTS "))
    res = json.loads(line[len("DOCS-RESULTS ") :])["page.md"]
    assert res["stdout"] == "hello 1\n"
    assert "block at line 9" in res["error"] and "x is 1" in res["error"]


def test_the_docs_have_python_blocks():
    """The README and the guides keep runnable examples (a parser that finds none fails here)."""
    names = {_rel(p) for p in PY_PAGES}
    assert "README.md" in names
    assert "docs/guide/moe.md" in names


@pytest.mark.parametrize("page", [_rel(p) for p in PY_PAGES])
def test_python_blocks_run(page, python_block_results):
    res = python_block_results[page]
    assert res["error"] is None, f"{page}: {res['error']}"
    if page in EXPECTED_OUTPUT:
        assert EXPECTED_OUTPUT[page] in res["stdout"], res["stdout"]


EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
# Shorter timing loops than the examples' defaults (the code path is the same; the default run
# must stay within its time budget).
EXAMPLE_ARGS = {"docs/examples/flax_data_parallel.py": ["--rounds", "1", "--steps", "2"]}


@pytest.mark.parametrize("example", [_rel(p) for p in EXAMPLES])
def test_examples_run(example):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest.py: compiles faster
    r = subprocess.run(
        [sys.executable, example, *EXAMPLE_ARGS.get(example, [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, (
        f"{example} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )


# --- shell blocks: the scripts and flags they name exist -------------------------------------

LAUNCHER_SRC = (ROOT / "strata_jax" / "launch.py").read_text()


def _defined_flags(script: Path) -> str:
    """Source text in which a script's flags are defined: the script and the benchmarks' shared
    modules it may take arguments from."""
    texts = [script.read_text()]
    if script.parent.name == "benchmarks":
        texts += [p.read_text() for p in script.parent.glob("*.py") if p != script]
    return "\n".join(texts)


def _commands(code: str) -> list[list[str]]:
    """Shell commands of a block, one word list per command (comments, `&&` chains and
    line continuations handled; no quoting beyond what shlex does)."""
    import shlex

    joined = code.replace("\\\n", " ")
    cmds = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        for part in re.split(r"&&|\|\||;", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            if words:
                cmds.append(words)
    return cmds


def check_shell_block(code: str) -> list[str]:
    """Problems of one bash block: missing scripts, flags a script or the launcher lacks."""
    problems = []
    for words in _commands(code):
        launcher = "strata_jax.launch" in words or words[0] == "strata-launch"
        script_i = next(
            (i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")), None
        )
        if script_i is not None:
            path = ROOT / words[script_i]
            if words[script_i].startswith(("benchmarks/", "docs/", "tests/")):
                if not path.exists():
                    problems.append(f"{words[script_i]} does not exist")
                    continue
                src = _defined_flags(path)
                for w in words[script_i + 1 :]:
                    flag = w.split("=", 1)[0]
                    if flag.startswith("--") and f'"{flag}"' not in src:
                        problems.append(f"{words[script_i]} has no flag {flag}")
        if launcher:
            end = script_i if script_i is not None else len(words)
            for w in words[:end]:
                flag = w.split("=", 1)[0]
                if flag.startswith("--") and f'"{flag}"' not in LAUNCHER_SRC:
                    problems.append(f"the launcher has no flag {flag}")
    return problems


SHELL_BLOCKS = [
    (p, b) for p in doc_pages() for b in code_blocks(p) if b["lang"] in ("bash", "sh", "shell")
]


@pytest.mark.parametrize(
    "page,block", SHELL_BLOCKS, ids=[f"{_rel(p)}:{b['line']}" for p, b in SHELL_BLOCKS]
)
def test_shell_blocks_name_what_exists(page, block):
    if block["skip"]:
        pytest.skip(block["skip"])
    assert check_shell_block(block["code"]) == []


def test_shell_check_catches_a_missing_flag_and_script():
    """The checker above can fail: a made-up flag and a made-up script are reported."""
    bad = "python benchmarks/train_moe.py --no-such-flag 3\npython benchmarks/nope.py\n"
    bad += "python -m strata_jax.launch -n 4 --no-such-launch-flag benchmarks/train_moe.py\n"
    assert check_shell_block(bad) == [
        "benchmarks/train_moe.py has no flag --no-such-flag",
        "benchmarks/nope.py does not exist",
        "the launcher has no flag --no-such-launch-flag",
    ]


def test_skip_markers_give_a_reason():
    for page in doc_pages():
        text = page.read_text()
        for m in re.finditer(r"<!--\s*skip-test\b(.*?)-->", text):
            assert m.group(1).strip().lstrip(":").strip(), f"{_rel(page)}: skip-test without reason"


def test_no_public_name_lacks_a_docstring():
    """The rule the docs build enforces (docs/_ext/strata_docs.py), checked without Sphinx."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from strata_docs import missing_docstrings
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    assert missing_docstrings() == []


# --- settings and the README's generated parts ------------------------------------------------


def test_every_setting_is_documented():
    """Every STRATA_* variable the code reads and every launcher flag is in settings.md."""
    settings = (DOCS / "guide" / "settings.md").read_text()
    names = set()
    for folder in ("strata_jax", "native", "benchmarks"):
        for p in (ROOT / folder).rglob("*"):
            if p.suffix in (".py", ".cc", ".h"):
                names |= set(re.findall(r"[\"'](STRATA_[A-Z0-9_]+)[\"']", p.read_text()))
    assert "STRATA_TIMEOUT_S" in names and "STRATA_ALLOC_THRESHOLD" in names  # the scan works
    assert sorted(n for n in names if f"`{n}`" not in settings) == []
    flags = set(re.findall(r"add_argument\(\s*\"(-[-\w]+)\"", LAUNCHER_SRC))
    assert "--hosts" in flags and "-n" in flags
    assert sorted(f for f in flags if f"`{f}" not in settings) == []


def test_readme_headline_is_generated_from_the_benchmark_json():
    """The README's headline table is what docs/_ext/strata_perf.py makes of docs/perf/*.json
    (regenerate: python docs/_ext/strata_perf.py --readme --write)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import strata_perf
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    readme = (ROOT / "README.md").read_text()
    assert strata_perf.readme_with_headline(readme) == readme
    assert len(strata_perf.headline_rows()) >= 3
    for row in strata_perf.headline_rows():  # every row names its source file, which exists
        src = re.search(r"\]\(([^)]+)\)", row[-1]).group(1)
        assert (ROOT / src).is_file()


def test_release_table_pairs_runs_and_finds_a_lost_point(tmp_path):
    """performance.md's table of strata's ratios on each JAX release pairs
    ``perf/jax-<v>/<name>/x.json`` with ``perf/<name>/x.json`` point by point and marks a point
    strata led on the older release and trails on the newer as lost (fake runs)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import strata_perf
    finally:
        sys.path.remove(str(DOCS / "_ext"))

    def run(ver: str, xla_us: list[float]) -> dict:
        rows = []
        for size, xla in zip((4096, 65536), xla_us, strict=True):
            rows.append({"impl": "strata", "op": "psum", "size_bytes": size, "time_us": 10.0})
            rows.append({"impl": "xla", "op": "psum", "size_bytes": size, "time_us": xla})
        return {"machine": {"versions": {"jax": ver}}, "args": {}, "rows": rows}

    for folder, ver, xla in (("", "0.10.2", [20.0, 15.0]), ("jax-0.12.1", "0.12.1", [30.0, 8.0])):
        d = tmp_path / folder / "collectives"
        d.mkdir(parents=True)
        (d / "collectives_float32_n8.json").write_text(json.dumps(run(ver, xla)))
    rows = strata_perf.release_rows(tmp_path)
    assert [r[1] for r in rows] == ["psum 4 KiB vs xla", "psum 64 KiB vs xla"]
    assert rows[0][2:] == ["2.00x (jax 0.10.2)", "3.00x (jax 0.12.1)", "kept"]
    assert rows[1][2:] == ["1.50x (jax 0.10.2)", "0.80x (jax 0.12.1)", "**lost**"]
    assert "1 of 2 points kept" in strata_perf.releases_markdown(tmp_path)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# A guide page says what a user does and sees, and design.md how the code works: measurement logs
# go to performance.md (generated) or to dated notes under docs/notes/, which these bounds keep
# them from growing back into.
GUIDE_MAX_LINES = 350
DESIGN_MAX_LINES = 450


def page_length_problems(pages: list[Path], limit: int, read=lambda p: p.read_text()) -> list[str]:
    """The pages longer than `limit` lines, with their length."""
    out = []
    for page in pages:
        n = len(read(page).splitlines())
        if n > limit:
            out.append(f"{_rel(page)}: {n} lines (at most {limit})")
    return out


def test_guides_and_design_stay_short():
    guides = sorted((DOCS / "guide").glob("*.md"))
    assert len(guides) >= 9  # the glob finds the guides
    assert page_length_problems(guides, GUIDE_MAX_LINES) == []
    assert page_length_problems([DOCS / "design.md"], DESIGN_MAX_LINES) == []


def headless_continuations(text: str) -> list[str]:
    """Lines that continue a list item whose first line is gone: an indented line right after a
    heading and its blank line (13ea9eb cut the first bullet of collectives.md's "Differences
    from jax.lax" and left its second line there)."""
    lines = text.splitlines()
    out = []
    for n in range(2, len(lines)):
        if lines[n - 2].startswith("#") and not lines[n - 1].strip():
            if lines[n].startswith("  ") and lines[n].strip():
                out.append(f"{n + 1}: {lines[n][:60]}")
    return out


def test_no_list_item_lost_its_first_line():
    for page in doc_pages():
        assert headless_continuations(page.read_text()) == [], _rel(page)
    assert headless_continuations("## A\n\n  (the rest of a bullet\n") == [
        "3:   (the rest of a bullet"
    ]
    assert headless_continuations("## A\n\n- a bullet\n  goes on\n") == []


def test_collectives_guide_says_pmax_propagates_nan():
    text = (DOCS / "guide" / "collectives.md").read_text()
    section = text.split("## Differences from jax.lax, on purpose", 1)[1]
    assert section.lstrip().startswith("- `pmax`/`pmin` propagate NaN whatever the rank order")


def hand_typed_figures(text: str) -> list[str]:
    """Lines of performance.md that hold figures typed by hand: a Markdown table other than the
    list of benchmarks, or a decimal number outside code (the generated tables come from the
    ``strata-perf`` directive and the README's headline from docs/_ext/strata_perf.py)."""
    out = []
    fence = False
    table_ok = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE_RE.match(line):
            fence = not fence
            continue
        if fence:
            continue
        if line.startswith("|"):
            if not line.startswith("|---"):
                table_ok = table_ok or line.startswith("| command | what it compares |")
            if not table_ok:
                out.append(f"{n}: a table typed by hand: {line[:60]}")
            continue
        table_ok = False
        if re.search(r"\d+\.\d+", re.sub(r"`[^`]*`", "", line)):
            out.append(f"{n}: a figure typed by hand: {line[:60]}")
    return out


def test_performance_page_holds_no_figures_typed_by_hand():
    """docs/performance.md says nothing on it is typed by hand; runs copied from a benchmark's
    output by hand are dated notes under docs/notes/."""
    assert hand_typed_figures((DOCS / "performance.md").read_text()) == []


def test_hand_typed_figure_check_finds_them():
    text = (
        "| command | what it compares |\n|---|---|\n| `python b.py` | strata vs jax.lax |\n\n"
        "strata was 1.37x faster (`--iters 1.5` is code)\n\n| placement | ratio |\n|---|---|\n"
        "```text\n# 2.5 ms in a code block\n```\n"
    )
    assert hand_typed_figures(text) == [
        "5: a figure typed by hand: strata was 1.37x faster (`--iters 1.5` is code)",
        "7: a table typed by hand: | placement | ratio |",
        "8: a table typed by hand: |---|---|",
    ]


# What a reader of the repository cannot open: the team's outside lists and files.
OUTSIDE_RE = re.compile(
    r"\b(?:[Ee]dge case|[Ii]ssue) #?\d|\bDESIGN\.md\b|\.\./shared/|/work/shared"
)


def outside_references(text: str) -> list[str]:
    """Lines that point at something outside the repository ("edge case 35", "issue 28",
    DESIGN.md, ../shared/...) instead of saying what the case is."""
    return [
        f"{n}: {line.strip()[:80]}"
        for n, line in enumerate(text.splitlines(), 1)
        if OUTSIDE_RE.search(line)
    ]


def test_docs_refer_to_nothing_outside_the_repository():
    files = doc_pages() + sorted((DOCS / "_ext").glob("*.py")) + [DOCS / "conf.py"]
    found = {_rel(p): outside_references(p.read_text()) for p in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_outside_reference_check_finds_them():
    text = "a test (edge case 35)\nas issue 28 asks\nsee ../shared/DESIGN.md\nan issue with it\n"
    assert outside_references(text) == [
        "1: a test (edge case 35)",
        "2: as issue 28 asks",
        "3: see ../shared/DESIGN.md",
    ]


def toctree_entries(page: Path, docs: Path = DOCS) -> list[str]:
    """The documents a page's ``{toctree}`` blocks name (glob patterns as written), relative to
    docs/ and without the suffix."""
    out = []
    lines = page.read_text().splitlines()
    base = page.parent.relative_to(docs)
    for i, line in enumerate(lines):
        if not line.strip().startswith("```{toctree}"):
            continue
        for entry in lines[i + 1 :]:
            entry = entry.strip()
            if entry.startswith("```"):
                break
            if entry and not entry.startswith(":"):
                out.append(str((base / entry).as_posix()))
    return out


def unreachable_pages(docs: Path = DOCS) -> list[str]:
    """Markdown pages under docs/ that no toctree reaches from docs/index.md (Sphinx warns about
    them; this says which without building)."""
    import fnmatch

    pages = {
        str(p.relative_to(docs).with_suffix("").as_posix())
        for p in docs.rglob("*.md")
        if not ({"_build", "_generated", "perf", "examples"} & set(p.relative_to(docs).parts))
    }
    seen, todo = {"index"}, ["index"]
    while todo:
        for pattern in toctree_entries(docs / f"{todo.pop()}.md", docs):
            for name in sorted(n for n in pages if fnmatch.fnmatch(n, pattern)):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
    return sorted(pages - seen)


def test_every_page_is_reached_from_the_index():
    """Every guide, reference page and dated note is in a toctree under docs/index.md (the notes
    through design.md's glob, so a new note is reached without editing a list)."""
    assert "notes/*" in toctree_entries(DOCS / "design.md")
    assert unreachable_pages() == []


def test_reach_check_finds_an_orphan(tmp_path):
    """The check above can fail: a page no toctree names is reported, a globbed note is not."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "index.md").write_text("# i\n\n```{toctree}\n:maxdepth: 1\n\ndesign\n```\n")
    (tmp_path / "design.md").write_text("# d\n\n```{toctree}\n:glob:\n\nnotes/*\n```\n")
    (tmp_path / "notes" / "2026-12-07-a.md").write_text("# a\n")
    (tmp_path / "orphan.md").write_text("# o\n")
    assert unreachable_pages(tmp_path) == ["orphan"]


def test_page_length_check_finds_a_long_page():
    """The check above can fail: a page one line over the limit is named."""
    page = DOCS / "guide" / "hosts.md"
    assert page_length_problems([page], 3, read=lambda p: "a\nb\nc\nd\n") == [
        "docs/guide/hosts.md: 4 lines (at most 3)"
    ]
    assert page_length_problems([page], 4, read=lambda p: "a\nb\nc\nd\n") == []


def test_docstring_check_finds_a_missing_one(monkeypatch):
    """The check can fail: an undocumented public function, class and method are named."""
    import types

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from strata_docs import missing_docstrings
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    mod = types.ModuleType("fake_strata_mod", "A module with a docstring.")

    def documented():
        """Has one."""

    def bare():
        pass

    class Bare:
        def method(self):
            pass

    mod.documented, mod.bare, mod.Bare = documented, bare, Bare
    mod.__all__ = ["documented", "bare", "Bare"]
    monkeypatch.setitem(sys.modules, "fake_strata_mod", mod)
    assert missing_docstrings(("fake_strata_mod",)) == [
        "fake_strata_mod.bare",
        "fake_strata_mod.Bare",
        "fake_strata_mod.Bare.method",
    ]
