"""The harnesses for child processes (``tests/children.py``, ``benchmarks/_harness.py``): the
one rule for what a child inherits, that no test or benchmark builds a child's environment or
starts a process on its own, and that every benchmark script takes its options from the
benchmarks' harness, writes its figures with ``--json PATH`` through it and has its row in
``benchmarks/README.md``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from kiln_test_children import KILN_SRC, child_env

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
BENCHMARKS = ROOT / "benchmarks"
HARNESSES = {TESTS / "children.py", BENCHMARKS / "_harness.py"}
CHECK = Path(__file__).resolve()  # (this file: its examples of what the check finds)

# a line that starts a process, or copies this process's environment for one
_SPAWN = re.compile(r"\bsubprocess\.(run|Popen|call|check_call|check_output|getoutput|"
                    r"getstatusoutput)\(|\bfrom subprocess import\b|"
                    r"\bos\.(system|popen|spawn\w*|exec[lv]\w*|posix_spawn\w*)\(")
_ENVIRON = re.compile(r"\bos\.environ\.(items|copy)\(\)|\*\*os\.environ\b|"
                      r"\bdict\(os\.environ\b|\bos\.environ\s*\|")

# (file, a piece of the line) -> why it starts a process without the harness
ALLOWED = {
    ("tests/servers.py", "subprocess.Popen(argv,"):
        "starts redis-server and moto_server, the servers the fleet tests talk to (their "
        "environment changes nothing kiln or jax do), not a program under test",
    ("tests/test_reads.py", 'subprocess.run([sys.executable, "-c", "pass"], check=True)'):
        "the program under test itself: a function that starts a process while it is traced, "
        "which the read recorder must see",
    ("tests/test_server.py", "\"os.execv(sys.executable, [sys.executable, '-m', 'kiln'"):
        "the program under test's own text (a string): a kiln run started with no room to write "
        "files (RLIMIT_FSIZE 0), itself run through the harness",
    ("tests/equinox_api/run.py", 'subprocess.run([*git, "show"'):
        "git reading equinox's test files (their bytes) from a source, not a program under test",
    ("tests/equinox_api/run.py", 'subprocess.run([*git, "rev-parse"'):
        "git naming the commit of a tag, not a program under test",
}


def _sources() -> list[Path]:
    """Every test and benchmark file but the harnesses and this one (tests/jax_api is JAX's
    own api_test.py, as JAX ships it)."""
    files = [*TESTS.rglob("*.py"), *BENCHMARKS.glob("*.py")]
    return sorted(p for p in files if p not in HARNESSES and p != CHECK
                  and (TESTS / "jax_api") not in p.parents)


def _offences(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if (_SPAWN.search(line) or _ENVIRON.search(line))
            and not any(f == rel and piece in line for f, piece in ALLOWED)]


def test_no_test_or_benchmark_builds_a_child_environment_or_starts_a_process_on_its_own():
    """Children are started by ``run_child`` / ``start_child`` of the harness, in a
    ``child_env``: one rule for what they inherit (``tests/children.py``)."""
    assert [o for p in _sources() for o in _offences(p)] == []


def test_every_allowed_line_is_still_there():
    """An entry of :data:`ALLOWED` whose line went away goes too."""
    text = {f: (ROOT / f).read_text() for f, _ in ALLOWED}
    assert [(f, piece) for f, piece in ALLOWED if piece not in text[f]] == []


def test_a_module_multiprocessing_imports_again_takes_the_harness_as_a_fixture():
    """``multiprocessing``'s spawned workers import a test module again, without conftest:
    there ``from kiln_test_children import ...`` fails; the ``children`` fixture serves."""
    offenders = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        uses = any(isinstance(n, ast.Name) and n.id == "multiprocessing" for n in ast.walk(tree))
        imports = any(isinstance(n, ast.ImportFrom) and n.module == "kiln_test_children"
                      for n in tree.body)
        if uses and imports:
            offenders.append(path.name)
    assert offenders == []


@pytest.mark.parametrize("line", [
    'env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "JAX_"))}',
    'env = {**os.environ, "KILN_CACHE_DIR": str(store)}',
    "env = os.environ.copy()",
    'env = dict(os.environ, A="1")',
    'env = os.environ | {"A": "1"}',
    'proc = subprocess.run([sys.executable, "-c", code], capture_output=True)',
    "holder = subprocess.Popen([sys.executable, script], env=env)",
    "from subprocess import run",
    'os.system("python prog.py")',
])
def test_the_check_sees_a_child_made_on_its_own(line):
    assert _SPAWN.search(line) or _ENVIRON.search(line)


def test_a_child_inherits_no_kiln_jax_xla_equinox_or_pytest_setting(monkeypatch):
    for name in ("KILN_CACHE_DIR", "JAX_PLATFORMS", "XLA_FLAGS", "EQX_ON_ERROR",
                 "PYTEST_XDIST_WORKER"):
        monkeypatch.setenv(name, "parent")
    monkeypatch.setenv("PYTHONPATH", "/parent/path")
    monkeypatch.setenv("CHILDREN_PLAIN", "kept")
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert {k for k in env if k.startswith(("KILN_", "JAX_", "EQX_", "PYTEST_"))} == set()
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"  # passed: it is set
    assert env["CHILDREN_PLAIN"] == "kept"
    assert env.get("PYTHONPATH") == KILN_SRC  # the kiln under test, not the parent's path


def test_a_child_s_pythonpath_is_the_kiln_under_test_then_the_test_s(monkeypatch):
    monkeypatch.setenv("CHILDREN_GONE", "parent")
    env = child_env(PYTHONPATH="/site", CHILDREN_GONE=None)
    assert env["PYTHONPATH"].split(":") == [p for p in (KILN_SRC, "/site") if p]
    assert "CHILDREN_GONE" not in env
    assert "PYTHONPATH" not in child_env(PYTHONPATH=None)  # an installed kiln only


# -- benchmarks --------------------------------------------------------------------------------
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def _readme_rows() -> dict[str, list[str]]:
    """``benchmarks/README.md``'s table: script -> its cells (measures, anchor, target,
    command)."""
    rows = {}
    for line in (BENCHMARKS / "README.md").read_text().splitlines():
        found = re.match(r"\| `([\w.]+\.py)` \|(.*)\|\s*$", line)
        if found:
            rows[found.group(1)] = [c.strip() for c in found.group(2).split(" | ")]
    return rows


def _harness_calls(tree: ast.Module) -> set[str]:
    """The functions of ``benchmarks/_harness.py`` the script calls (``import _harness as
    bench``; ``bench.options(...)``)."""
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name == "_harness"}
    return {n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in aliases}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_takes_its_options_and_writes_its_json_through_the_harness(script):
    """``options`` gives ``--reps`` / ``--json`` / ``--quick``, ``begin`` prints the command
    line, ``save`` writes the JSON: one front for every script."""
    assert {"options", "begin", "save"} <= _harness_calls(ast.parse(
        (BENCHMARKS / script).read_text())), f"{script} does not use the harness's front"


def test_every_benchmark_has_its_row_in_the_readme():
    rows = _readme_rows()
    assert sorted(rows) == SCRIPTS
    assert {s: len(cells) for s, cells in rows.items() if len(cells) != 4} == {}
    assert [s for s, cells in rows.items() if "--json" not in cells[3]] == []
