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

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from _children import child_env, run_child

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

def _env(store: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=store, KILN_PROGRESS="0", JAX_PLATFORMS="cpu")


def _python(code: str, args: list[str], env: dict[str, str]) -> str:
    return run_child([sys.executable, "-c", code, *args], env=env).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    print(f"$ {command}")
    vers = {d: metadata.version(d) for d in ("jax", "jaxlib", "jax-kiln", "cloudpickle")}
    print(", ".join(f"{k} {v}" for k, v in vers.items()) + f"; {os.cpu_count()} CPUs")

    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kiln-pickled-") as tmp:
        _python(PARENT, [tmp], _env(f"{tmp}/parent-store"))
        sizes = {m: Path(tmp, f"{m}.pkl").stat().st_size for m in MODES}
        print("pickle sizes: " + ", ".join(f"{m} {n} bytes" for m, n in sizes.items()))
        for rep in range(args.reps):
            order = MODES[rep % 3:] + MODES[: rep % 3]
            for mode in order:
                with tempfile.TemporaryDirectory(dir=tmp) as store:  # empty, per worker
                    t = time.perf_counter()
                    out = _python(WORKER, [f"{tmp}/{mode}.pkl"], _env(store))
                    r = json.loads(out.strip().splitlines()[-1])
                    r["wall_s"] = time.perf_counter() - t
                samples[mode].append(r)
                counts = {k: r[k] for k in ("traces", "compiles", "hits") if k in r}
                print(f"  rep {rep + 1}/{args.reps} {mode:<17} ttfr {r['ttfr_s']:.3f} s, "
                      f"wall {r['wall_s']:.3f} s  {counts}", flush=True)

    med = {m: statistics.median(s["ttfr_s"] for s in samples[m]) for m in MODES}
    print()
    for m in MODES:
        ttfr = [s["ttfr_s"] for s in samples[m]]
        print(f"{m:<18} ttfr median {med[m]:.3f} s ({min(ttfr):.3f}-{max(ttfr):.3f})")
    print(f"kiln carried / kiln not carried: {med['kiln carried'] / med['kiln not carried']:.3f}x;"
          f" kiln carried / jax.jit: {med['kiln carried'] / med['jax.jit']:.3f}x")
    carried_ok = all((s["traces"], s["compiles"]) == (0, 0) for s in samples["kiln carried"])
    same = len({json.dumps(s["theta"]) for m in MODES for s in samples[m]}) == 1
    print(f"carried workers ran with 0 traces and 0 compiles: {carried_ok}; "
          f"fitted parameters identical in every worker: {same}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "pickled", "command": command,
                                         "versions": vers, "sizes": sizes, "samples": samples,
                                         "median_ttfr_s": med}, indent=2))
    return 0 if carried_ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
