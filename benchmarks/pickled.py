"""Benchmark: a compiled function pickled into a fresh worker process, time to first result.

Run from the repository root (about 3 minutes; needs the ``examples`` extra and cloudpickle):

    python benchmarks/pickled.py [--reps 5] [--json PATH]

The program is the Lotka-Volterra fit (``kiln_demo.lotka_volterra.make_fit``: one jitted
closure, so it pickles by value). A parent process (untimed) compiles it and cloudpickles it
three ways:

- ``kiln carried``: ``kiln.jit``, carrying the stored entry of the signature it compiled;
- ``kiln not carried``: the same with ``pickle_max_size=0`` (the function alone);
- ``jax.jit`` (the anchor): ``jax.jit`` of the same closure, which loads and recompiles
  (jax-ml/jax #4572).

Each repetition then starts one fresh worker per mode, in turn (the order rotating), each with an
empty kiln store of its own: the worker unpickles the function and calls it on the data. The
figure is the worker's time to first result (seconds, from before its imports to the result),
median over the repetitions; the worker's kiln counters (traces, compiles, hits) and the fitted
parameters are checked to be as expected in every run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

MODES = ("kiln carried", "kiln not carried", "jax.jit")

PARENT = r'''
import sys, jax, cloudpickle, kiln
from kiln_demo.lotka_volterra import load_data, make_fit

out = sys.argv[1]
ts, ys = load_data()
fit = make_fit("kiln")
jax.block_until_ready(fit(ts, ys))
open(out + "/kiln carried.pkl", "wb").write(cloudpickle.dumps(fit))
kiln.configure(pickle_max_size=0)
open(out + "/kiln not carried.pkl", "wb").write(cloudpickle.dumps(fit))
jfit = make_fit("jax")
jax.block_until_ready(jfit(ts, ys))
open(out + "/jax.jit.pkl", "wb").write(cloudpickle.dumps(jfit))
'''

WORKER = r'''
import time
t0 = time.perf_counter()
import json, pickle, sys
import jax, numpy as np
from kiln_demo.lotka_volterra import load_data

ts, ys = load_data()
with open(sys.argv[1], "rb") as fh:
    fit = pickle.load(fh)
theta, loss, steps = jax.block_until_ready(fit(ts, ys))
ttfr = time.perf_counter() - t0
out = {"ttfr_s": ttfr, "theta": np.asarray(theta).round(5).tolist(), "steps": int(steps)}
if "kiln" in sys.modules:
    import kiln
    s = kiln.stats()
    out.update(traces=s.traces, compiles=s.compiles, hits=s.hits)
print(json.dumps(out))
'''

def _python(code: str, args: list[str], store: str) -> bench.Fresh:
    env = bench.child_env(**bench.kiln_store(store), JAX_PLATFORMS="cpu")
    return bench.fresh(["-c", code, *args], env=env)


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=5), argv,
                       dists=("jax", "jaxlib", "jax-kiln", "cloudpickle"))
    with tempfile.TemporaryDirectory(prefix="kiln-pickled-") as tmp:
        _python(PARENT, [tmp], f"{tmp}/parent-store")
        sizes = {m: Path(tmp, f"{m}.pkl").stat().st_size for m in MODES}
        print("pickle sizes: " + ", ".join(f"{m} {n} bytes" for m, n in sizes.items()))

        def worker(mode: str, _: int) -> dict[str, Any]:
            with tempfile.TemporaryDirectory(dir=tmp) as store:  # empty, per worker
                return _python(WORKER, [f"{tmp}/{mode}.pkl"], store).record()

        samples = bench.interleave(
            MODES, args.reps, worker, label=lambda m: f"{m:<17}",
            show=lambda r: f"ttfr {r['ttfr_s']:.3f} s, wall {r['wall_s']:.3f} s  "
                           f"{ {k: r[k] for k in ('traces', 'compiles', 'hits') if k in r} }")

    ttfr = {m: bench.spread(s["ttfr_s"] for s in samples[m]) for m in MODES}
    med = {m: t["median"] for m, t in ttfr.items()}
    print()
    print(bench.table(["mode", "ttfr median s", "(min-max)"],
                      [[m, t["median"], f"{t['min']:.3f}-{t['max']:.3f}"]
                       for m, t in ttfr.items()]))
    print(f"kiln carried / kiln not carried: {med['kiln carried'] / med['kiln not carried']:.3f}x;"
          f" kiln carried / jax.jit: {med['kiln carried'] / med['jax.jit']:.3f}x")
    carried_ok = all((s["traces"], s["compiles"]) == (0, 0) for s in samples["kiln carried"])
    same = len({json.dumps(s["theta"]) for m in MODES for s in samples[m]}) == 1
    print(f"carried workers ran with 0 traces and 0 compiles: {carried_ok}; "
          f"fitted parameters identical in every worker: {same}")
    bench.save(args, {"sizes": sizes, "samples": samples, "median_ttfr_s": med})
    return 0 if carried_ok and same else 1

if __name__ == "__main__":
    raise SystemExit(main())
