"""The worked example of docs/noinline.md runs and is the script next to it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_noinline_example_in_the_doc_is_the_script():
    doc = (DOCS / "noinline.md").read_text()
    block = re.search(r"## Worked example\n.*?```python\n(.*?)```", doc, re.S)
    assert block is not None
    script = (DOCS / "noinline_example.py").read_text()
    assert script.split('"""\n\n', 1)[1] == block.group(1)


@pytest.mark.slow
def test_noinline_example_runs_cold_then_warm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "JAX_", "XLA_"))}
    env["KILN_CACHE_DIR"] = str(tmp_path / "cache")

    def run():
        proc = subprocess.run([sys.executable, str(DOCS / "noinline_example.py")], env=env,
                              text=True, capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    cold = run()
    assert "compiles: 3 (block, caller, caller inlined), host calls: 16" in cold
    warm = run()  # the caller's inlined executable and the block are loaded: nothing compiles
    assert "compiles: 0 (block, caller, caller inlined), host calls: 0" in warm
