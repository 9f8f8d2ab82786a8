"""Benchmark: what one JAX-cache miss costs through the ``kiln://`` route against JAX's own
cache directory (the per-miss cost behind the pytest plugin's target: ``pytest
--kiln`` run 1 no slower than JAX's directory run 1).

Run from the repository root (about a minute):

    python benchmarks/route_miss.py [--programs 300] [--reps 5] [--json PATH]

Each repetition starts two fresh processes, in alternating order: one with JAX's persistent
cache in an empty directory (``JAX_COMPILATION_CACHE_DIR``, minimum compile time 0, minimum
entry size -1; ``KILN_JAX_CACHE=0``), one with kiln imported on an empty store (the route on,
as ``import kiln`` sets it). Both call ``--programs`` distinct small ``jax.jit`` programs once
each (every call a miss: JAX compiles and its cache writes the executable) and time the loop
(wall, ``perf_counter``). Also timed in the process: JAX's cache read on a miss
(``compilation_cache.get_executable_and_time``: for kiln, the store read and the single-flight
lease) and its write (``put_executable_and_time``: for kiln, the entry's digest, header and
file). Printed: the medians over the repetitions, per miss, and kiln's extra time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from _children import child_env, run_child

_CHILD = r"""
import json, os, sys, time
mode, n = sys.argv[1], int(sys.argv[2])
import jax, jax.numpy as jnp
if mode == "kiln":
    import kiln  # noqa: F401  (the route on, as a user's import sets it)
from jax._src import compilation_cache as cc
spent = {"get": 0.0, "put": 0.0}
def timed(name, f):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t0
    return wrapper
cc.get_executable_and_time = timed("get", cc.get_executable_and_time)
cc.put_executable_and_time = timed("put", cc.put_executable_and_time)
x = jnp.ones(3)
fs = [jax.jit(eval(f"lambda x: x * {i}.0 + {i}")) for i in range(n)]
t0 = time.perf_counter()
for f in fs:
    f(x).block_until_ready()
loop = time.perf_counter() - t0
print(json.dumps({"miss": loop / n, "get": spent["get"] / n, "put": spent["put"] / n}))
"""


def _child(mode: str, n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        if mode == "jax":
            env = child_env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=d, KILN_JAX_CACHE="0",
                            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        else:
            env = child_env(JAX_PLATFORMS="cpu", KILN_CACHE_DIR=d, KILN_PROGRESS="0")
        out = run_child([sys.executable, "-c", _CHILD, mode, str(n)], env=env).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(__file__))
    import _installed

    _installed.compile_bytecode()
    print("$", shlex.join([sys.executable, *sys.argv]))
    runs: dict[str, list[dict[str, float]]] = {"jax": [], "kiln": []}
    for rep in range(args.reps):
        for mode in (("jax", "kiln") if rep % 2 == 0 else ("kiln", "jax")):
            runs[mode].append(_child(mode, args.programs))
            r = runs[mode][-1]
            print(f"  rep {rep + 1}/{args.reps} {mode:4s} miss {r['miss'] * 1e3:6.2f} ms  "
                  f"cache read {r['get'] * 1e3:5.3f} ms  cache write {r['put'] * 1e3:5.3f} ms")
    print(f"\nper miss, median of {args.reps} ({args.programs} programs a process):")
    print(f"{'':22s}{'JAX cache dir':>14s}{'kiln route':>12s}{'kiln extra':>12s}")
    medians: dict[str, dict[str, float]] = {"jax": {}, "kiln": {}}
    for part, label in (("miss", "whole call"), ("get", "cache read (miss)"),
                        ("put", "cache write")):
        for mode in medians:
            medians[mode][f"{part}_s"] = statistics.median(r[part] for r in runs[mode])
        j, k = medians["jax"][f"{part}_s"] * 1e3, medians["kiln"][f"{part}_s"] * 1e3
        print(f"{label:22s}{j:11.3f} ms{k:9.3f} ms{k - j:+9.3f} ms")
    if args.json:
        args.json.write_text(json.dumps({"programs": args.programs, "reps": args.reps,
                                         "median_per_miss": medians, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
