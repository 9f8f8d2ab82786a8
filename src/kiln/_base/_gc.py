"""Python's cyclic garbage collector, relaxed while kiln traces and lowers a program.

Tracing a large program allocates hundreds of thousands of objects that live until it is
compiled (the jaxpr's equations, tracers, the MLIR module). Under CPython's default thresholds
(700, 10, 10) so many survivors set off collections of the whole heap while the trace runs: on
the Lotka-Volterra fit (jax 0.10.2, Python 3.11; timed with ``gc.callbacks``, median of 5,
``python benchmarks/cold_breakdown.py``), 2 full collections and 23 of the middle generation
took 0.46 s of its ~4.5 s trace and lowering and freed ~100 objects. With the youngest
generation's threshold at 10,000 the same trace runs 1 middle and no full collection, 0.08 s of
collecting in all, for the same peak memory (the youngest generation still collects every
10,000 allocations, so cyclic garbage made while tracing is freed as before).

:func:`relaxed` sets that threshold for the length of kiln's trace or lowering, and then puts
back what it found. It leaves the collector alone when the user switched it off
(``gc.disable()``) or set a first threshold of 0 or above 10,000 themselves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["THRESHOLD", "relaxed"]

THRESHOLD = 10_000  # the youngest generation's threshold while kiln traces (CPython: 700)

_lock = threading.Lock()
_depth = 0  # traces and lowerings under way, in every thread (nested kiln.jit calls too)
_saved: tuple[int, ...] | None = None  # the thresholds to put back after the last one ends


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """Raise the youngest generation's threshold to :data:`THRESHOLD` until the outermost
    such block (in any thread) ends; then restore the thresholds, unless they were changed
    meanwhile by someone else."""
    global _depth, _saved
    with _lock:
        _depth += 1
        if _depth == 1:
            current = gc.get_threshold()
            if gc.isenabled() and 0 < current[0] < THRESHOLD:
                _saved = current
                gc.set_threshold(THRESHOLD, *current[1:])
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                if gc.get_threshold() == (THRESHOLD, *_saved[1:]):
                    gc.set_threshold(*_saved)
                _saved = None
