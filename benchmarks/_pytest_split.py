"""A pytest plugin for ``benchmarks/pytest_plugin.py --split``: where one pytest process's
seconds go. Loaded with ``-p _pytest_split`` (this folder on ``PYTHONPATH``); it reads
``BENCH_T0`` (``time.time()`` just before the process was started) and writes JSON to the path
in ``BENCH_SPLIT`` at exit.

At three points (``configured``: pytest and its plugins imported, kiln's among them when
``--kiln``; ``collected``: the test modules imported, which imports jax and the library under
test; ``finished``: the last test done) it records the seconds since ``BENCH_T0``, JAX's trace
and lowering seconds so far (``_jax_events.py``'s listener on JAX's monitoring events, by kind:
``eager`` for JAX's own functions, ``jit`` for the rest; registered at ``configured``) and
kiln's own seconds so far (``kiln.stats()``: keying, reading and loading JAX's eager work;
reading and loading kiln.jit's entries and fingerprinting; the route's reads for JAX's cache)
when kiln is imported.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

import _jax_events

_T0 = float(os.environ["BENCH_T0"])
_OUT = os.environ["BENCH_SPLIT"]
# kiln's own seconds (kiln.stats()): what the split counts as kiln's
KILN_FIELDS = ("eager_seconds", "load_seconds", "read_seconds", "fingerprint_seconds",
               "jax_cache_read_seconds")
_marks: dict[str, Any] = {}
_events: list[dict[str, dict[str, float]]] = []  # the listener's own counts, once installed


def _kiln() -> dict[str, float]:
    kiln = sys.modules.get("kiln")
    if kiln is None or not hasattr(kiln, "stats"):
        return {}
    stats = kiln.stats()
    return {f: float(getattr(stats, f, 0.0)) for f in KILN_FIELDS}


def _mark(name: str) -> None:
    _marks[name] = {"t": time.time() - _T0,
                    "jax": json.loads(json.dumps(_events[0])) if _events else {},
                    "kiln": _kiln()}


def _write() -> None:
    _marks["exit"] = {"t": time.time() - _T0}
    with open(_OUT, "w") as f:
        json.dump(_marks, f)


def pytest_configure(config: Any) -> None:
    _events.append(_jax_events.install(_OUT + ".events"))
    _mark("configured")


def pytest_collection_finish(session: Any) -> None:
    _mark("collected")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _mark("finished")


atexit.register(_write)
