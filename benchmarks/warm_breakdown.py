"""Benchmark: where a kiln warm start's time goes, per real program (target: kiln's
share <= 0.2 s).

Run from the repository root (about 1 minute per program with ``--reps 5``):

    python benchmarks/warm_breakdown.py [--reps 5] [--programs mlp_digits,...] [--json PATH]

The programs are ``benchmarks/real_programs.py``'s. Each is run once on an empty store (kiln
cold), then ``--reps`` times warm, each a fresh process started through a small wrapper that
imports the program's libraries, then ``kiln`` (timed apart), runs the program unchanged
(``runpy``) and prints ``kiln.stats()`` at the end. Per program, medians of the warm runs, in
seconds:

- ``wall``: the whole process; ``import libs``: ``import jax`` and the program's libraries;
- ``import kiln``: ``import kiln`` after them (kiln's own modules and what only kiln imports);
- ``fingerprint``: the static walk before each lookup and the manifest checks of each hit;
- ``read``: reading kiln's entries from the store; ``load``: checking and deserializing them;
- ``route read``: the ``kiln://`` route reading the values JAX's cache asks for (``n`` values);
  ``route load``: JAX's own retrieval of those hits (the route's read, then its decompress and
  deserialize), which JAX's cache in a directory would spend too;
- ``kiln share``: import kiln + fingerprint + read + route read: what kiln adds to a warm
  start (target: <= 0.2 s). ``load`` (XLA deserializing the executable: the Lotka-
  Volterra fit's 1.6 MB one takes ~0.17 s) is printed apart: any persistent cache pays it,
  JAX's own for the same executable too, and it replaces a trace, a lowering and a compile.

The rest of ``wall`` is the program's own work (data, training steps) and the interpreter.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench
from real_programs import PROGRAMS, _base_env, add_programs, chosen

WRAPPER = r'''
import time
T0 = time.perf_counter()
import json, runpy, sys
libs, script, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
for lib in libs.split(","):
    __import__(lib.strip())
T1 = time.perf_counter()
import kiln
T2 = time.perf_counter()
sys.argv = [script, *argv]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    if e.code not in (None, 0):
        raise
s = kiln.stats()
print("BREAKDOWN " + json.dumps({
    "wall_in_process": time.perf_counter() - T0, "import_libs": T1 - T0, "import_kiln": T2 - T1,
    "fingerprint": s.fingerprint_seconds, "read": s.read_seconds, "load": s.load_seconds,
    "route_read": s.jax_cache_read_seconds, "route_load": s.jax_cache_load_seconds,
    "route_values": s.jax_cache_hits, "hits": s.hits, "compiles": s.compiles,
    "jax_cache_misses": s.jax_cache_misses}), flush=True)
'''

FIELDS = ("import_libs", "import_kiln", "fingerprint", "read", "load", "route_read",
          "route_load")


def _run(wrapper: Path, libs: str, argv: list[str], env: dict[str, str],
         cwd: Path) -> dict[str, Any]:
    run = bench.fresh([wrapper, libs, *argv], env=env, cwd=cwd, marker="BREAKDOWN ")
    return {"wall": run.wall_s, **run.payload}


def measure(name: str, reps: int, tmp: Path) -> dict[str, Any]:
    script, (kiln_argv, kiln_env), _, libs = PROGRAMS[name]
    wrapper = tmp / "wrapper.py"
    wrapper.write_text(WRAPPER)
    env = _base_env() | kiln_env | bench.kiln_store(tmp / f"{name}-store")
    argv = [str(script), *kiln_argv]
    cold = _run(wrapper, libs, argv, env, tmp)
    warm = bench.interleave([name], reps, lambda *_: _run(wrapper, libs, argv, env, tmp))[name]
    med = {k: bench.median(r[k] for r in warm)
           for k in ("wall", *FIELDS, "route_values", "hits", "compiles")}
    med["kiln_share"] = bench.median(
        r["import_kiln"] + r["fingerprint"] + r["read"] + r["route_read"] for r in warm)
    return {"median": med, "cold": cold, "warm": warm}


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5)
    add_programs(parser)
    args = bench.begin(parser, argv, installed=True)
    # (the programs of examples/libraries/ have no kiln.jit variant: see real_programs.py)
    names = [n for n in chosen(parser, args) if PROGRAMS[n][1] is not None]
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            report[name] = measure(name, args.reps, Path(tmp))["median"]
            print(f"{name}: kiln share {report[name]['kiln_share']:.3f} s", flush=True)
    print(bench.table(
        ["program", "wall", "import libs", "import kiln", "fingerprint", "read", "load",
         "route read (n)", "route load", "kiln share", "compiles"],
        [[name, f"{m['wall']:.2f}", f"{m['import_libs']:.2f}", m["import_kiln"],
          m["fingerprint"], m["read"], m["load"],
          f"{m['route_read']:.3f} ({m['route_values']:.0f})", m["route_load"],
          m["kiln_share"], f"{m['compiles']:.0f}"] for name, m in report.items()]))
    bench.save(args, {"programs": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
