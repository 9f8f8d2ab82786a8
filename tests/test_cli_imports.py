"""The ``kiln`` command line answers without importing jax where a verb does not run JAX:
``--version``, ``--help``, ``ls``, ``stats``, ``verify``, ``prune``, ``clear``, from
the ``kiln`` script (``kiln_cli``) and from ``python -m kiln``; the verbs that run JAX, and the
first use of a name such as ``kiln.jit``, turn on what ``import kiln`` turns on. Real processes;
what is imported is read from ``python -X importtime`` and ``sys.modules``, never a timing."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_test_children import child_env, run_child

import kiln

pytestmark = pytest.mark.slow

# the ``kiln`` script as pip writes it for the entry point ``kiln = "kiln_cli:main"``
SCRIPT = ("-c", "import sys; from kiln_cli import main; sys.argv[0] = 'kiln'; sys.exit(main())")
DASH_M = ("-m", "kiln")

# each verb that never runs JAX, with the status it exits with on the store below
VERBS = [
    (("--version",), 0),
    (("--help",), 0),
    (("ls",), 0),
    (("ls", "--json"), 0),
    (("stats",), 0),
    (("verify",), 0),
    (("prune", "--max-size", "1GiB", "--dry-run"), 0),
    (("clear", "--dry-run"), 0),
    (("clear",), 2),  # usage: --yes or --dry-run
    (("ls", "--no-such-option"), 2),
]

# a module of jax (or jaxlib) in ``-X importtime``'s lines: ``import time: 12 | 34 |   jax.numpy``
_JAX_IMPORT = re.compile(r"^import time:[^|]*\|[^|]*\|\s*(jax|jaxlib)(\.\S+)?\s*$", re.MULTILINE)


def _env(store: Path, **extra: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=str(store), JAX_PLATFORMS="cpu", **extra)


def _kiln(entry: tuple[str, ...], *args: str, env: dict[str, str],
          cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_child([sys.executable, "-X", "importtime", *entry, *args], env=env, cwd=cwd,
                     timeout=120)


def _jax_modules(stderr: str) -> list[str]:
    return [m.group(0).rpartition("|")[2].strip() for m in _JAX_IMPORT.finditer(stderr)]


def _not_importtime(stderr: str) -> str:
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith("import time:"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with real entries of both kinds: kiln.jit executables, and JAX's own cache
    values written through the kiln:// route (eager operations)."""
    where = tmp_path_factory.mktemp("cli-imports") / "store"
    program = ("import jax.numpy as jnp\nimport kiln\n"
               "f = kiln.jit(lambda x, k: x * k + 1, static_argnums=1)\n"
               "for k in range(3):\n    f(jnp.ones(4), k).block_until_ready()\n")
    done = run_child([sys.executable, "-c", program], env=_env(where), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(run_child([sys.executable, "-m", "kiln", "ls", "--json"], env=_env(where),
                                timeout=120, check=True).stdout)
    kinds = {r["function"].startswith("jax:") for r in rows}
    assert len(rows) >= 4 and kinds == {True, False}, rows
    return where


@pytest.mark.parametrize("entry", [SCRIPT, DASH_M], ids=["kiln-script", "python-m-kiln"])
@pytest.mark.parametrize(("args", "status"), VERBS, ids=[" ".join(a) for a, _ in VERBS])
def test_a_verb_that_does_not_run_jax_does_not_import_it(
    store: Path, entry: tuple[str, ...], args: tuple[str, ...], status: int
) -> None:
    done = _kiln(entry, *args, env=_env(store))
    assert done.returncode == status, _not_importtime(done.stderr)
    assert _jax_modules(done.stderr) == []
    assert "kiln" in done.stderr  # importtime lines were read: kiln itself is among them
    if args == ("ls",):
        assert "jax:" in done.stdout and "<lambda>" in done.stdout


def test_python_dash_m_kiln_as_one_token_does_not_import_jax(store: Path) -> None:
    done = _kiln(("-mkiln",), "--version", env=_env(store))
    assert (done.returncode, done.stdout) == (0, f"kiln {kiln.__version__}\n")
    assert _jax_modules(done.stderr) == []


RUN_PROGRAM = '''\
import json
import sys

before = "jax" in sys.modules
import kiln
from kiln import jit
from kiln._jit import _swap
from kiln._travel import _jax_cache

print("KILN-IMPORTS " + json.dumps({
    "jax_before_import_kiln": before,
    "route": _jax_cache.is_enabled(),
    "swapped": _swap.is_replaced(),
    "jit": jit is kiln.jit and jit.__module__,
}))
'''


@pytest.mark.parametrize("entry", [SCRIPT, DASH_M], ids=["kiln-script", "python-m-kiln"])
def test_kiln_run_starts_from_kiln_as_import_kiln_leaves_it(
    store: Path, tmp_path: Path, entry: tuple[str, ...]
) -> None:
    """``kiln run``: jax not imported before the script imports it (as under ``python``); once
    it is (here by ``import kiln``), the kiln:// route on, and with ``KILN_REPLACE_JIT=1``
    jax.jit swapped, as ``import kiln`` leaves a process; the script's ``from kiln import jit``
    gets kiln's."""
    (tmp_path / "prog.py").write_text(RUN_PROGRAM)
    done = _kiln(entry, "run", "prog.py", env=_env(store, KILN_REPLACE_JIT="1"), cwd=tmp_path)
    assert done.returncode == 0, _not_importtime(done.stderr)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("KILN-IMPORTS "))
    assert json.loads(line[len("KILN-IMPORTS "):]) == {
        "jax_before_import_kiln": False, "route": True, "swapped": True, "jit": "kiln._jit._api",
    }


FIRST_USE = '''\
import json
import sys

import kiln_cli

kiln_cli.importing = True  # as kiln_cli.main says while it imports kiln._cli
import kiln
kiln_cli.importing = False
without = "jax" in sys.modules
listed = set(kiln.__all__) <= set(dir(kiln))
jit = kiln.jit  # the first use of a name whose module imports jax
from kiln._jit import _swap
from kiln._travel import _jax_cache

print(json.dumps({"jax_before_first_use": without, "dir_lists_all": listed,
                  "route": _jax_cache.is_enabled(), "swapped": _swap.is_replaced(),
                  "bound": all(n in vars(kiln) for n in kiln.__all__)}))
'''


def test_the_first_use_of_a_jax_name_turns_on_what_import_kiln_turns_on(store: Path) -> None:
    done = run_child([sys.executable, "-c", FIRST_USE], env=_env(store, KILN_REPLACE_JIT="1"),
                     timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout) == {"jax_before_first_use": False, "dir_lists_all": True,
                                       "route": True, "swapped": True, "bound": True}


def test_a_program_run_with_dash_m_that_imports_kiln_gets_it_whole(
    store: Path, tmp_path: Path
) -> None:
    """``python -m prog`` (not kiln): ``import kiln`` in it turns the route on at import."""
    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "__init__.py").write_text("import kiln\n")
    (tmp_path / "prog" / "__main__.py").write_text(
        "import sys\nfrom kiln._travel import _jax_cache\n"
        "print('jax' in sys.modules, _jax_cache.is_enabled(), 'jit' in vars(sys.modules['kiln']))"
        "\n")
    done = run_child([sys.executable, "-m", "prog", "kiln"], env=_env(store), cwd=tmp_path,
                     timeout=120)
    assert (done.returncode, done.stdout) == (0, "True True True\n"), done.stderr[-4000:]


def test_the_jax_names_table_matches_the_imports_type_checkers_read() -> None:
    """``kiln/__init__``'s ``_JAX_NAMES`` names what its ``TYPE_CHECKING`` imports import, from
    the same modules; with the names ``kiln/__init__`` imports at once, they are ``__all__``."""
    tree = ast.parse(Path(kiln.__file__).read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) \
                and not isinstance(node.test, ast.UnaryOp):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    checked[alias.asname or alias.name] = "." * imp.level + (imp.module or "")
    assert checked == kiln._JAX_NAMES  # type: ignore[attr-defined]
    for name, module in checked.items():
        assert getattr(kiln, name) is getattr(importlib.import_module(module, "kiln"), name)
    at_once = {n for n in vars(kiln) if not n.startswith("_")} - set(checked) - {"stores"}
    assert sorted(at_once | set(checked)) == kiln.__all__
