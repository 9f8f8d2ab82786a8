"""The docs hold: the README's example runs cold then warm as shown, its quick start is two
commands, every link between the README and docs/ resolves, the settings and CLI tables match
kiln.Config and the ``kiln`` parser, and the worked example of docs/noinline.md runs and is the
script next to it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from kiln_test_children import child_env, run_child

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_noinline_example_in_the_doc_is_the_script():
    doc = (DOCS / "noinline.md").read_text()
    block = re.search(r"## Worked example\n.*?```python\n(.*?)```", doc, re.S)
    assert block is not None
    script = (DOCS / "noinline_example.py").read_text()
    assert script.split('"""\n\n', 1)[1] == block.group(1)


@pytest.mark.slow
def test_noinline_example_runs_cold_then_warm(tmp_path):
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "cache"))

    def run():
        proc = run_child([sys.executable, DOCS / "noinline_example.py"], env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    cold = run()
    assert "compiles: 3 (block, caller, caller inlined), host calls: 16" in cold
    warm = run()  # the caller's inlined executable and the block are loaded: nothing compiles
    assert "compiles: 0 (block, caller, caller inlined), host calls: 0" in warm


# -- the README and the pages the reference moved to -------------------------------------------
ROOT = DOCS.parent
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _block_after(text: str, marker: str, lang: str = "") -> str:
    """The first fenced block (of ``lang``, if given) after ``marker`` in ``text``."""
    found = re.search(re.escape(marker) + r".*?^```" + lang + r"\n(.*?)^```", text, re.S | re.M)
    assert found is not None, marker
    return found.group(1)


def _counters(summary: str) -> dict[str, int]:
    """kiln.jit's counters on ``kiln run``'s summary line: hits, misses, traces, compiles."""
    return {k: int(v) for k, v in re.findall(r"\b(hits|misses|traces|compiles): (\d+)",
                                             summary.split(", jax cache")[0])}


@pytest.mark.slow
def test_the_readme_example_runs_cold_then_warm_as_the_readme_shows(tmp_path):
    """The README's first example, run twice with ``kiln run`` in fresh processes on one store:
    the first traces and compiles, the second is a store hit with no trace and no compile, and
    both print what the README shows."""
    text = README.read_text()
    script = _block_after(text, "# kiln", "python")
    assert script.startswith("# lookup.py\n")
    (tmp_path / "lookup.py").write_text(script)
    shown = _block_after(text, "Run it twice.").strip().split("\n$ ")
    assert len(shown) == 2 and shown[0].startswith("$ kiln run lookup.py\n")
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"))

    runs = []
    for expected in shown:
        printed, summary = expected.split("\n")[1:]
        proc = run_child([sys.executable, "-m", "kiln", "run", "lookup.py"], cwd=tmp_path,
                         env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == printed + "\n"
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kiln: hits:")]
        assert len(lines) == 1, proc.stderr
        assert _counters(lines[0]) == _counters(summary), (lines[0], summary)
        runs.append(_counters(lines[0]))
    assert runs == [{"hits": 0, "misses": 1, "traces": 1, "compiles": 1},
                    {"hits": 1, "misses": 0, "traces": 0, "compiles": 0}]


def test_the_quick_start_is_two_commands():
    """.ci/run and a fresh machine take the README's quick start as it is: one command for the
    main job, one for the test suite."""
    block = _block_after(README.read_text(), "## Quick start", "bash")
    commands = [line.split("#")[0].strip() for line in block.strip().split("\n")]
    assert commands == ['pip install -e ".[examples]" && kiln demo',
                        'pip install -e ".[test]" && python -m pytest']


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", page.read_text()).split("\n"):
        if line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_the_pages_resolve(page: Path):
    """Every relative link of the README and docs/ names a file that exists, and a heading of
    it when it has an anchor (the reference moved from the README into pages by topic)."""
    text = _FENCE.sub("", page.read_text())
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            bad.append(target)
    assert bad == []


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` (header and rule left out), each cell
    stripped of spaces and of its outer backticks."""
    lines = text.split(heading + "\n", 1)[1].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return table[2:]


def test_the_configuration_table_lists_every_setting():
    """docs/reference.md's table has one row per ``kiln.Config`` field, with its variable; the
    README's short table names real fields and their variables."""
    import dataclasses

    import kiln

    fields = [f.name for f in dataclasses.fields(kiln.Config)]
    rows = _table_rows((DOCS / "reference.md").read_text(), "## Configuration")
    table = {r[0]: r[1] for r in rows if r[0] != "(env only)"}
    assert sorted(table) == sorted(fields)
    assert all(env == "KILN_" + name.upper() for name, env in table.items())

    readme = _table_rows(README.read_text(), "## Settings most people set")
    assert readme
    for cells in readme:
        env, name = re.fullmatch(r"(KILN_\w+)` \(`(\w+)`\)", cells[0]).groups()
        assert name in fields and env == "KILN_" + name.upper()


def _verbs() -> dict[str, set[str]]:
    """Each verb of the ``kiln`` command with its options."""
    import argparse

    from kiln._cli._main import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: {o for a in p._actions for o in a.option_strings}
            for verb, p in sub.choices.items()}


@pytest.mark.parametrize(("page", "heading"), [(README, "## CLI"),
                                               (DOCS / "reference.md", "## CLI")],
                         ids=["README", "reference"])
def test_the_cli_block_has_one_entry_per_verb(page: Path, heading: str):
    verbs = _verbs()
    block = _block_after(page.read_text(), heading)
    listed = re.findall(r"^kiln (\w+)(.*?)(?:  |$)", block, re.M)
    assert [v for v, _ in listed] == list(verbs)
    for verb, usage in listed:
        assert set(re.findall(r"--[\w-]+", usage)) <= verbs[verb], verb
