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

import tempfile

import _harness as bench

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
            env = bench.child_env(JAX_PLATFORMS="cpu", KILN_JAX_CACHE="0", **bench.jax_cache(d))
        else:
            env = bench.child_env(JAX_PLATFORMS="cpu", **bench.kiln_store(d))
        return bench.fresh(["-c", _CHILD, mode, str(n)], env=env).payload


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5)
    parser.add_argument("--programs", type=int, default=300)
    args = bench.begin(parser, argv, installed=True)
    runs = bench.interleave(
        ("jax", "kiln"), args.reps, lambda mode, _: _child(mode, args.programs),
        label=lambda m: f"{m:4s}",
        show=lambda r: f"miss {r['miss'] * 1e3:6.2f} ms  cache read {r['get'] * 1e3:5.3f} ms  "
                       f"cache write {r['put'] * 1e3:5.3f} ms")
    medians: dict[str, dict[str, float]] = {
        mode: {f"{part}_s": bench.median(r[part] for r in rs) for part in ("miss", "get", "put")}
        for mode, rs in runs.items()}
    print(f"\nper miss, median of {args.reps} ({args.programs} programs a process), ms:")
    print(bench.table(["", "JAX cache dir", "kiln route", "kiln extra"], [
        [label, medians["jax"][f"{part}_s"] * 1e3, medians["kiln"][f"{part}_s"] * 1e3,
         f"{(medians['kiln'][f'{part}_s'] - medians['jax'][f'{part}_s']) * 1e3:+.3f}"]
        for part, label in (("miss", "whole call"), ("get", "cache read (miss)"),
                            ("put", "cache write"))]))
    bench.save(args, {"programs": args.programs, "median_per_miss": medians, "runs": runs})
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
