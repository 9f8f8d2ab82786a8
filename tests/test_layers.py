"""kiln's modules in layers without cycles: the import-linter contract in
pyproject.toml holds, jax's private modules are imported by kiln._base._jax_compat alone, and a
folder's modules are reached through its face."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kiln_test_children import child_env, run_child

SRC = Path(__file__).resolve().parent.parent / "src" / "kiln"


def _imports(path: Path) -> list[str]:
    """Every module an ``import`` / ``from`` statement in ``path`` names, at any depth
    (inside functions and under ``TYPE_CHECKING`` too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


GATE = SRC / "_base" / "_jax_compat"  # the JAX gate: a folder, one file per concern


def test_only_jax_compat_imports_jax_private_modules() -> None:
    offenders = {
        str(p.relative_to(SRC)): [m for m in _imports(p) if m.startswith("jax._src")]
        for p in SRC.rglob("*.py") if GATE not in p.parents
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert any(m.startswith("jax._src") for m in _imports(GATE / "_private.py"))


def test_the_jax_gate_is_small_files_behind_one_face() -> None:
    """Each file of the gate holds one concern and stays under 400 lines; kiln outside the
    gate reads it through its face (``_jax_compat.name``), never a file of it."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in GATE.glob("*.py")}
    assert len(sizes) >= 8 and max(sizes.values()) < 400, sizes
    inside = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if GATE not in p.parents
              and any(m.startswith("kiln._base._jax_compat.") for m in _imports(p))]
    relative = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if GATE not in p.parents
                and "_jax_compat._" in p.read_text()]
    assert inside == [] and relative == []


def test_kiln_s_packages_import_one_another_without_a_circle() -> None:
    """The top-level packages under ``src/`` (kiln, kiln_early, kiln_jax_plugin, kiln_cli,
    kiln_pytest, kiln_demo, kiln_server, kiln_warm): an import at any depth counts; the graph has no cycle (kiln_early
    once imported kiln for JAX's plugin hook: the hook is kiln_jax_plugin now)."""
    src = SRC.parent
    tops = sorted(p.name for p in src.iterdir() if (p / "__init__.py").is_file())
    assert {"kiln", "kiln_early", "kiln_jax_plugin"} <= set(tops)
    edges: dict[str, set[str]] = {t: set() for t in tops}
    for t in tops:
        for path in (src / t).rglob("*.py"):
            edges[t] |= {m.split(".")[0] for m in _imports(path)} & set(tops) - {t}
    # (kiln run skips kiln_early; jit functions remember; kiln server ls|stop and python -m
    # kiln reach the warm processes through kiln_server, standard library only)
    assert edges["kiln"] == {"kiln_early", "kiln_server"}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"an import circle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for nxt in sorted(edges[node]):
            visit(nxt, (*path, node))
        done.add(node)

    for t in tops:
        visit(t, ())


def test_layers_contract_holds() -> None:
    pytest.importorskip("importlinter")
    root = SRC.parent.parent
    proc = run_child(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
         " sys.exit(lint_imports_command())"],
        cwd=root, env=child_env(PYTHONPATH=str(SRC.parent)), timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


# --------------------------------------------------------------------------------------------
# Folder faces: what one folder imports of another goes through that folder's face
# --------------------------------------------------------------------------------------------
#: The private modules a face hands out whole (``from .._base import _jax_compat``), each with
#: why its callers take the module rather than names of the face. Any other is a bypass.
FACE_MODULES = {
    "kiln._base._jax_compat": "the one gate to jax._src: every use reads `_jax_compat.name`, "
    "marked as JAX's private at the call site; the face binding it would import jax with "
    "kiln._base, which the CLI's commands that run no JAX import",
    "kiln._base._stats": "the process's counters, bumped from every layer as "
    "`_stats.bump(...)`; the face binds what a user reads (stats, reset_stats, Stats)",
    "kiln._base._config": "the settings module: the CLI reads `_config.process_settings` and "
    "`_config.parse_size`, which are no names of kiln's",
    "kiln._base._gc": "`_gc.relaxed()`: the collector relaxed while tracing",
    "kiln._base._version": "`_version.__version__` read when the key's `kiln` part is made, so "
    "a changed version changes the key (tests/test_staleness.py changes it); the face's "
    "`__version__` is the value at import",
    "kiln._keys._args": "the call's arguments: the helpers _jit and _miss share "
    "(`_args.leaf_sig`, `_args.normalize_argnums`, ...), named by their module",
    "kiln._miss._explain": "`KILN_EXPLAIN`'s messages, `_explain.explain(...)` from _jit",
    "kiln._miss._tier_up": "the tier-up policy and its thread (`_tier_up.Policy`, "
    "`_tier_up.start`); tests set its thresholds on the module",
    "kiln._travel._jax_cache": "the kiln:// route, turned on by _jit and `kiln run` "
    "(`_jax_cache.enable_by_default`)",
    "kiln._travel._pickling": "pickled kiln functions carrying their entries, what _jit's "
    "`__reduce__` calls (`_pickling.portable`, `_pickling.store_carried`, ...)",
    "kiln._jit._swap": "the jax.jit swap, which `kiln run --jit` turns on and off by module",
    "kiln.stores._inventory": "the CLI's and bundles' maintenance verbs (sizes, strays, verify, "
    "prune, clear), named by module (`inventory.prune`): the face's names are the store API",
}


def _cross_folder_imports(src: Path) -> Iterator[tuple[str, int, str, str, list[str]]]:
    """``(file, line, statement, module, names)`` for each import in a module under ``src``
    (the ``kiln`` package) of a module of another folder: ``module`` dotted and absolute,
    ``names`` those a ``from`` import takes (none for ``import``). kiln's top
    (``kiln/__init__.py``, ``kiln/__main__.py``) counts as a folder of its own."""
    folders = {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    for path in sorted(src.rglob("*.py")):
        package = ("kiln", *path.relative_to(src).with_suffix("").parts)[:-1]
        own = package[1] if len(package) > 1 else None
        where = str(path.relative_to(src.parent))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = list(package[: len(package) - node.level + 1]) if node.level else []
                module = ".".join(base + [node.module] if node.module else base)
                targets = [(module, [a.name for a in node.names])]
            for module, names in targets:
                # (from kiln import B: folders' faces, or the top's own names)
                parts = module.split(".")
                if parts[0] == "kiln" and len(parts) > 1 and parts[1] in folders - {own}:
                    yield where, node.lineno, ast.unparse(node), module, names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def face_bypasses(src: Path = SRC) -> list[str]:
    """``file:line: import`` for each import in a module under ``src`` (the ``kiln`` package)
    that reaches a private module of another folder other than through the folder's face.

    kiln's modules sit in folders (``kiln/_base``, ``kiln/stores``, ``kiln/_miss``, ...; the
    top, ``kiln/__init__.py`` and ``kiln/__main__.py``, counts as a folder of its own). A
    folder's ``__init__`` is its face: what the other folders may import of it. So an import
    (``import`` or ``from``, relative or absolute, at any depth: in functions and under
    ``TYPE_CHECKING`` too) of another folder ``B``:

    - may name ``B`` itself (``from ..B import name``, ``import kiln.B``, ``from kiln import B``),
      importing a name the face binds, or a dunder name (``__version__``);
    - fails when it names a private module inside ``B`` (``from ..B._m import x``,
      ``import kiln.B._m``, ``from kiln.B._m import x``);
    - fails when it takes a private name from ``B``'s face (``from ..B import _m``) unless that
      name is a module listed in :data:`FACE_MODULES`, each with its reason.

    Imports inside one folder are the folder's own business and are not checked.
    """
    out: list[tuple[str, int, str]] = []
    for where, line, shown, module, names in _cross_folder_imports(src):
        if any(_private(p) for p in module.split(".")[2:]):
            out.append((where, line, shown))
            continue
        out += [(where, line, f"{shown} ({name})") for name in names
                if _private(name) and f"{module}.{name}" not in FACE_MODULES]
    return [f"{where}:{line}: {text}" for where, line, text in sorted(out)]


def test_no_folder_imports_a_private_module_of_another() -> None:
    """Other folders reach a folder through its face (see :func:`face_bypasses`)."""
    assert face_bypasses() == []


def test_each_face_module_is_one_another_folder_takes() -> None:
    """Each exception names a module that exists and that some other folder takes whole."""
    taken = {f"{module}.{name}" for _, _, _, module, names in _cross_folder_imports(SRC)
             for name in names if _private(name)}
    assert sorted(set(FACE_MODULES) - taken) == []
    for name in FACE_MODULES:
        path = SRC.parent / name.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


def test_face_bypasses_are_found(tmp_path: Path) -> None:
    """The check itself: each form of a bypass is reported with its file and line; imports
    through a face, and inside a folder, are not."""
    src = tmp_path / "kiln"
    for folder in ("a", "b"):
        (src / folder).mkdir(parents=True)
        (src / folder / "__init__.py").write_text("")
        (src / folder / "_m.py").write_text("")
    (src / "__init__.py").write_text("from .a._m import x\n")
    (src / "a" / "_n.py").write_text(
        "from ._m import x\n"  # inside the folder
        "from ..b import y, __version__\n"  # through b's face
        "from ..b._m import z\n"
        "import kiln.b._m\n"
        "def f():\n"
        "    from kiln.b._m import w\n"
        "from ..b import _m\n"
    )
    assert face_bypasses(src) == [
        "kiln/__init__.py:1: from .a._m import x",
        "kiln/a/_n.py:3: from ..b._m import z",
        "kiln/a/_n.py:4: import kiln.b._m",
        "kiln/a/_n.py:6: from kiln.b._m import w",
        "kiln/a/_n.py:7: from ..b import _m (_m)",
    ]
