"""What each published example in this folder adds to the code as published.

- The jit switch: ``EXAMPLE_JIT=kiln`` makes ``filter_jit`` ``kiln.filter_jit``; anything
  else (default ``eqx``) keeps ``equinox.filter_jit``. Each script decorates through this name
  and changes nothing else.
- A tee of stdout (:func:`tee_stdout`), so that the script's last line can report what it
  printed (:func:`printed`).
- That last line (:func:`report`): one JSON object with the results and, under kiln, the
  ``kiln.stats()`` counters ``hits`` / ``misses`` / ``traces`` / ``compiles``.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

import equinox as eqx

JIT = os.environ.get("EXAMPLE_JIT", "eqx")
if JIT == "kiln":
    import kiln

    filter_jit = kiln.filter_jit
else:
    filter_jit = eqx.filter_jit


class _Tee(io.StringIO):
    def write(self, s: str) -> int:
        sys.__stdout__.write(s)
        return super().write(s)


def tee_stdout() -> None:
    """Copy everything printed from now on, for :func:`printed`."""
    sys.stdout = _Tee()


def printed() -> list[str]:
    """The lines printed since :func:`tee_stdout`."""
    return sys.stdout.getvalue().splitlines() if isinstance(sys.stdout, _Tee) else []


def report(result: dict[str, Any]) -> None:
    """Print ``result`` (plus kiln's counters under kiln) as the last line, one JSON object."""
    if JIT == "kiln":
        stats = kiln.stats()
        result.update(hits=stats.hits, misses=stats.misses, traces=stats.traces,
                      compiles=stats.compiles)
    sys.stdout = sys.__stdout__
    print(json.dumps(result))
