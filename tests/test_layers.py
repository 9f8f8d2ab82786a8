"""kiln's modules in layers without cycles (issue 11): the import-linter contract in
pyproject.toml holds, and jax's private modules are imported by kiln._base._jax_compat alone."""

from __future__ import annotations

import ast
import sys
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


def test_only_jax_compat_imports_jax_private_modules() -> None:
    offenders = {
        str(p.relative_to(SRC)): [m for m in _imports(p) if m.startswith("jax._src")]
        for p in SRC.rglob("*.py") if p.name != "_jax_compat.py"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


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
