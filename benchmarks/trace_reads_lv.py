"""Benchmark: what kiln's read recording costs on the Lotka-Volterra fit's trace (target:
nothing measurable).

Run from the repository root (about 1 minute; needs the ``examples`` extra):

    python benchmarks/trace_reads_lv.py [--reps 7] [--json PATH]

In one process: ``jax.jit(fit).trace(ts, ys)`` of a fresh fit each time, with a
``ReadRecorder`` around it (the audit hook, and the wrappers of ``os.stat``, ``os.lstat``,
``os.access`` and ``threading.Thread.start`` that are in place while a recording is open) and
without, in turns (the hook is installed first, so both arms pay what any process pays once
kiln has traced once); medians. Then, how many calls of the wrapped ``os`` functions the
recorded trace made (each one a recorded thread pays for: a frame walk), and the items it
recorded (none: the fit reads nothing outside Python).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)

    import jax

    from kiln._keys import _reads
    from kiln._keys._reads import ReadRecorder
    from kiln_demo.lotka_volterra import _build_fit, load_data

    ts, ys = load_data()
    _reads._install_hook()

    def trace(record: bool) -> tuple[float, list[list[str]] | None]:
        fit = jax.jit(_build_fit())
        t0 = time.perf_counter()
        if not record:
            fit.trace(ts, ys)
            return time.perf_counter() - t0, None
        with ReadRecorder() as r:
            fit.trace(ts, ys)
        items = r.items()
        return time.perf_counter() - t0, items

    trace(False)
    trace(True)  # imports and first-use costs out of the way
    plain, recorded = [], []
    items: list[list[str]] | None = None
    for _ in range(args.reps):
        plain.append(trace(False)[0])
        t, items = trace(True)
        recorded.append(t)

    # the wrapped os calls one recorded trace makes: counters in front of kiln's wrappers
    counts = {"stat": 0, "lstat": 0, "access": 0}
    wrappers = {name: w for owner, name, _, w in _reads._WRAPPERS if owner is os}
    originals = {name: o for owner, name, o, _ in _reads._WRAPPERS if owner is os}

    def counting(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return wrappers[name](*a, **k)
        return call

    wrap, unwrap = _reads._wrap, _reads._unwrap
    _reads._wrap = _reads._unwrap = lambda: None
    try:
        for name in counts:
            setattr(os, name, counting(name))
        trace(True)
    finally:
        for name in counts:
            setattr(os, name, originals[name])
        _reads._wrap, _reads._unwrap = wrap, unwrap

    p, r = statistics.median(plain), statistics.median(recorded)
    print(f"Lotka-Volterra fit trace, median of {args.reps}: {p:.3f} s plain, {r:.3f} s "
          f"recorded ({r / p:.3f}x)")
    print(f"calls of os.stat / os.lstat / os.access in one recorded trace: {counts}; "
          f"items recorded: {items}")
    if args.json:
        args.json.write_text(json.dumps({
            "reps": args.reps, "median_trace_s": {"plain": p, "recorded": r},
            "trace_s": {"plain": plain, "recorded": recorded},
            "wrapped_calls_per_recorded_trace": counts, "items_recorded": items}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
