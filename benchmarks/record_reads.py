"""Benchmark: what recording one read costs while kiln traces (``kiln._keys._reads``), per
call, in one process, and on the first trace of the Lotka-Volterra fit in fresh processes
(target: a few microseconds a call; that trace makes ~9,400 ``os.path.samefile`` calls from
deep inside jax, ``jax._src.traceback_util``, once per process: it caches them).

Run from the repository root (about 1 minute; the second part needs the ``examples`` extra):

    python benchmarks/record_reads.py [--calls 2000] [--reps 7] [--depth 60]
                                      [--processes 7] [--json PATH]

Each case runs ``--calls`` calls inside a ``ReadRecorder`` and the same calls outside one (the
audit hook installed in both), medians of ``--reps``; printed: microseconds per call recorded,
plain, and the difference (what kiln adds):

1. ``open`` of one user file, again and again, from user code;
2. ``open`` of ``--calls`` different user files from user code (each a new item);
3. ``os.path.samefile`` of one directory pair, again and again, called by library code under
   ``--depth`` frames of library code (code whose file is in site-packages: how jax's
   traceback filter calls it while tracing);
4. ``os.stat`` of ``--calls`` different paths, called by library code under ``--depth``
   library frames (each a new item, each a walk of the frames).

Then ``--processes`` pairs of fresh processes (in turns), each timing its first
``jax.jit(fit).trace(ts, ys)`` of the Lotka-Volterra fit, with a ``ReadRecorder`` around it and
without (the audit hook installed in both): medians, and in one more recorded process the
number of path checks kiln saw and of frame walks it made (``--processes 0``: skip).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as bench

# functions whose frames count as library code: their file name is in site-packages
_LIB_SOURCE = '''
def descend(n, fn, *args):
    if n == 0:
        return fn(*args)
    return descend(n - 1, fn, *args)


def each(fn, items):
    for item in items:
        fn(item)


def repeat(fn, n, *args):
    for _ in range(n):
        fn(*args)
'''


def _library() -> dict[str, Any]:
    """A module as an installed library's (its file in site-packages; never written)."""
    module = types.ModuleType("_kiln_bench_library")
    module.__file__ = os.path.join(sysconfig.get_paths()["purelib"], "_kiln_bench_library.py")
    sys.modules[module.__name__] = module
    exec(compile(_LIB_SOURCE, module.__file__, "exec"), module.__dict__)
    return module.__dict__


# the first trace of the Lotka-Volterra fit in a fresh process, recorded ("1") or not; "count":
# how many checks (os.stat & co.) kiln saw and how many frame walks it made
LV_CHILD = r'''
import json, sys, time
import jax
from kiln._keys import _reads
from kiln._keys._reads import ReadRecorder
from kiln_demo.lotka_volterra import _build_fit, load_data

ts, ys = load_data()
_reads._install_hook()
calls = {"checks": 0, "walks": 0}
if sys.argv[2] == "count":
    for name, key in (("_note_check", "checks"), ("_caller_is_machinery", "walks")):
        def counted(*a, _original=getattr(_reads, name), _key=key):
            calls[_key] += 1
            return _original(*a)
        setattr(_reads, name, counted)
fit = jax.jit(_build_fit())
t0 = time.perf_counter()
if sys.argv[1] == "1":
    with ReadRecorder():
        fit.trace(ts, ys)
else:
    fit.trace(ts, ys)
print(json.dumps({"trace_s": time.perf_counter() - t0, **calls}))
'''


def _lv_first_trace(record: bool, count: bool = False) -> dict[str, Any]:
    return bench.fresh(["-c", LV_CHILD, "1" if record else "0", "count" if count else "-"],
                       env=bench.child_env(JAX_PLATFORMS="cpu")).record()


def _time(fn: Callable[[], Any], record: bool) -> float:
    from kiln._keys._reads import ReadRecorder

    if not record:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    with ReadRecorder() as r:
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
    assert r.unkeyable is None, r.unkeyable
    return t


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--depth", type=int, default=60)
    parser.add_argument("--processes", type=int, default=7)
    args = bench.begin(parser, argv)

    import kiln
    from kiln._keys import _reads

    _reads._install_hook()
    lib = _library()
    descend, each, repeat = lib["descend"], lib["each"], lib["repeat"]
    n, depth = args.calls, args.depth
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        one = root / "one.txt"
        one.write_text("x")
        many = [root / f"f{i}.txt" for i in range(n)]
        for p in many:
            p.write_text("x")
        (root / "d").mkdir()
        d = str(root / "d")

        def open_one() -> None:
            for _ in range(n):
                open(one).close()

        def open_many() -> None:
            for p in many:
                open(p).close()

        def samefile_deep() -> None:
            descend(depth, repeat, os.path.samefile, n, d, d)

        def stat_many_deep() -> None:
            descend(depth, each, os.stat, many)

        cases = {"open one user file": open_one, "open many user files": open_many,
                 f"samefile under {depth} library frames": samefile_deep,
                 f"os.stat many paths under {depth} library frames": stat_many_deep}
        figures: dict[str, dict[str, float]] = {}
        for name, fn in cases.items():
            _time(fn, True)  # first-use costs out of the way
            runs = bench.interleave(("plain", "recorded"), args.reps,
                                    lambda v, _, fn=fn: _time(fn, v == "recorded"), rotate=False)
            p, r = (bench.median(runs[v]) / n * 1e6 for v in ("plain", "recorded"))
            figures[name] = {"plain_us": p, "recorded_us": r, "added_us": r - p}
            print(f"{name:48s} recorded {r:8.2f} us/call, plain {p:7.2f} us/call, "
                  f"kiln adds {r - p:8.2f} us/call", flush=True)
    lv: dict[str, Any] = {}
    if args.processes:
        runs = bench.interleave(("plain", "recorded"), args.processes,
                                lambda v, _: _lv_first_trace(v == "recorded")["trace_s"])
        counts = _lv_first_trace(True, count=True)
        plain, recorded = runs["plain"], runs["recorded"]
        p, r = bench.median(plain), bench.median(recorded)
        lv = {"plain_s": plain, "recorded_s": recorded, "median_plain_s": p,
              "median_recorded_s": r, "checks": counts["checks"], "walks": counts["walks"]}
        print(f"Lotka-Volterra first trace, fresh processes, median of {args.processes}: "
              f"{p:.3f} s plain, {r:.3f} s recorded (kiln adds {r - p:+.3f} s); one recorded "
              f"trace: {counts['checks']} path checks seen, {counts['walks']} frame walks")
    bench.save(args, {"calls": n, "depth": depth, "kiln": kiln.__file__, "figures": figures,
                      "lotka_volterra_first_trace": lv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
