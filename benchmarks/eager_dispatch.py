"""Benchmark: JAX's eager work under the jax.jit swap, per call: a ``jnp`` function, an
operator, a reduction with a static axis and a primitive applied, each called outside any jit
after its first call (JAX's C++ fast path either way), in a process with kiln's swap on (eager
work loaded from the store) against one without kiln.

Run from the repository root (under a minute):

    python benchmarks/eager_dispatch.py [--reps 5] [--calls 20000] [--json PATH]

Each round is two fresh processes, ``plain`` (JAX as is) and ``eager`` (``kiln.replace_jax_jit``
on a store its first round filled: the operations are loaded, not compiled), in alternating
order; each times ``--calls`` calls of every operation (microseconds per call, after one
warm-up call) and the first call of a signature not seen yet (``first_us``: the load from the
store against JAX's trace, lowering and compile; its compile is JAX's persistent cache's in
neither). Printed: the median per operation and mode, and the ratio eager / plain. Target
(issue 45): per-call dispatch <= 1.05x plain.
"""

from __future__ import annotations

import tempfile
from typing import Any

import _harness as bench

TARGET = 1.05
MODES = ("plain", "eager")
OPS = ("jnp.sin", "x * 2.0", "jnp.sum(axis=0)", "lax.cos", "first_us")

CHILD = r'''
import json, sys, time
import jax, jax.numpy as jnp
if sys.argv[1] == "eager":
    import kiln
    kiln.replace_jax_jit()
calls = int(sys.argv[2])
x = jnp.ones(8)
ops = {"jnp.sin": lambda: jnp.sin(x), "x * 2.0": lambda: x * 2.0,
       "jnp.sum(axis=0)": lambda: jnp.sum(x, axis=0), "lax.cos": lambda: jax.lax.cos(x)}
out = {}
for name, op in ops.items():
    op().block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        op()
    out[name] = (time.perf_counter() - start) / calls * 1e6
y = jnp.arange(12.0).reshape(3, 4)
start = time.perf_counter()
jnp.tanh(y).block_until_ready()
out["first_us"] = (time.perf_counter() - start) * 1e6
print(json.dumps(out))
'''


def run(mode: str, store: str, calls: int) -> dict[str, Any]:
    env = bench.child_env(**bench.kiln_store(store), JAX_PLATFORMS="cpu")
    return bench.fresh(["-c", CHILD, mode, str(calls)], env=env).record()


def main(argv: list[str] | None = None) -> None:
    parser = bench.options(__doc__, reps=5, quick_reps=1)
    parser.add_argument("--calls", type=int, default=20000)
    args = bench.begin(parser, argv, installed=True)
    calls = 200 if args.quick else args.calls
    with tempfile.TemporaryDirectory() as store:
        run("eager", store, 10)  # fills the store: the measured eager rounds load
        samples = {m: [] for m in MODES}  # type: dict[str, list[dict[str, Any]]]
        bench.interleave(MODES, args.reps,
                         lambda m, i: samples[m].append(run(m, store, calls)))
    rows, figures = [], {}
    for op in OPS:
        med = {m: bench.median(r[op] for r in samples[m]) for m in MODES}
        ratio = med["eager"] / med["plain"]
        figures[op] = {**med, "ratio": ratio}
        rows.append((op, med["plain"], med["eager"], f"{ratio:.3f}x"))
    print(bench.table(("operation (us per call)", "plain", "eager", "eager / plain"), rows))
    worst = max(figures[op]["ratio"] for op in OPS if op != "first_us")
    print(f"per-call dispatch, worst ratio: {worst:.3f}x (target <= {TARGET}x)")
    bench.save(args, {"ops": figures, "worst_ratio": worst})


if __name__ == "__main__":
    main()
