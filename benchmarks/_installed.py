"""Make the processes a benchmark starts import kiln as an installed copy does.

``pip install`` compiles a package's bytecode (``.pyc``) when it installs it. An editable
checkout gets its bytecode only when Python may write it, and ``PYTHONDONTWRITEBYTECODE=1`` (set
on some machines, this one included) stops that: every fresh process then compiles kiln's
changed modules from source again, ~0.05 s that no installed kiln pays, and that a cold-start
figure would charge to kiln. Compiled here once, before the measured processes start.
"""

from __future__ import annotations

import compileall
import importlib.util
import sys


def compile_bytecode() -> None:
    """Write the bytecode of ``kiln``, ``kiln_early`` (which every kiln process imports),
    ``kiln_cli`` and ``kiln_demo`` for this Python, as ``pip install`` would."""
    for name in ("kiln", "kiln_early", "kiln_cli", "kiln_demo"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if not compileall.compile_dir(folder, quiet=1, workers=1):
                print(f"warning: could not compile {name}'s bytecode in {folder}",
                      file=sys.stderr)
