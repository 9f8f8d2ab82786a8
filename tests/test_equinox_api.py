"""equinox's own ``tests/test_jit.py`` under ``kiln run --jit``, plain, cold and warm
(``tests/equinox_api/run.py``). The tests are equinox's at ``KILN_EQUINOX_SRC`` where it names
an equinox source (its git directory, a checkout, or a folder holding its ``tests/``), else the
copy at v0.13.8 in ``tests/equinox_api/equinox_tests``, which is skipped where the installed
equinox is another version."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, run_child

RUN = Path(__file__).resolve().parent / "equinox_api" / "run.py"
SRC = os.environ.get("KILN_EQUINOX_SRC")  # (read at import: the fixtures clear KILN_*)


def _run_module() -> Any:
    """``tests/equinox_api/run.py`` as a module (loaded by path), for its ``VENDORED*``."""
    spec = importlib.util.spec_from_file_location("kiln_test_equinox_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_equinox_test_jit_fails_only_where_documented(tmp_path: Path) -> None:
    src = SRC
    if not src:
        run = _run_module()
        installed = importlib.metadata.version("equinox")
        if f"v{installed}" != run.VENDORED_TAG:
            pytest.skip(f"the installed equinox is {installed}, and the copy of equinox's "
                        f"tests in {run.VENDORED} is {run.VENDORED_TAG}'s (KILN_EQUINOX_SRC "
                        "names no equinox source)")
        src = str(run.VENDORED)
    out = tmp_path / "results.json"
    proc = run_child(
        [sys.executable, RUN, "--equinox", src, "--out", tmp_path / "eqx", "--json", out,
         "--without-trace-counts"],
        env=child_env(KILN_JAX_CACHE="0"), timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    outcomes = {kind: r["outcomes"] for kind, r in results.items()}
    assert set(outcomes["plain"].values()) == {"passed"}
    assert outcomes["cold"] == outcomes["plain"]  # cold: every test as under plain equinox
    for kind in ("cold-no-trace-counts", "warm-no-trace-counts"):
        assert outcomes[kind] == outcomes["plain"], kind  # what the tests compute, warm too
    failed = {name for name, o in outcomes["warm"].items() if o == "failed"}
    assert "test_buffer_donation_instance" in failed  # (only its trace count: see above)
    # the warm run traced only what takes the verify path, and compiled nothing
    assert ", compiles: 0," in results["warm"]["kiln"]
