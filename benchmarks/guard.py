"""Benchmark: what the guard (kiln/_keys/_guard.py: the process's inputs beside the key) costs.

Run from the repository root (about 6 minutes):

    python benchmarks/guard.py [--reps 5] [--quick] [--json PATH]

Two parts, fresh processes, medians of ``--reps`` interleaved rounds:

1. **The Lotka-Volterra fit** (``kiln_demo.lotka_volterra``, ``--jit kiln``) warm, three ways:
   ``kiln warm`` (the inputs of the run that filled the store: no trace), ``kiln warm,
   verified`` (every run in a working folder of its own, an input of every guard: each
   function is traced, lowered and compared once, then loaded; its guard record is written), and
   the anchor ``jax cache warm`` (``--jit jax``, JAX's persistent cache filled first). Targets:
   kiln warm / JAX's cache warm <= 0.25, verified / JAX's cache warm <= 1.0 (time to first
   result), results identical in every run.
2. **A large input read before the trace**: a program that opens a 1 GiB table (``--big-mib``),
   reads one value and bakes it into a small function, against the same program on a 1 KiB
   table: kiln warm with each, and the cold run that digests the table once. Target: the large
   table adds at most 50 ms to a warm start (median wall difference; kiln's own
   ``guard_seconds`` is printed beside it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
TARGET_WARM = 0.25  # kiln warm / JAX's cache warm (time to first result)
TARGET_VERIFIED = 1.0  # kiln warm, every function verified / JAX's cache warm
TARGET_BIG_S = 0.05  # what a 1 GiB input read before the trace adds to a warm start

LV = """\
import json
import sys

from kiln_demo import lotka_volterra as lv

result = lv.main(sys.argv[1:])
if "kiln" in sys.modules:
    import kiln

    s = kiln.stats()
    result["kiln"] = {"traces": s.traces, "compiles": s.compiles, "verifies": s.verifies,
                      "guard_seconds": s.guard_seconds}
print(json.dumps(result), flush=True)
"""

BIG = """\
import json
import sys
import time

T0 = time.perf_counter()
import jax.numpy as jnp
import numpy as np

import kiln

table = np.load(sys.argv[1], mmap_mode="r")
scale = float(table[-1])


@kiln.jit
def f(x):
    return jnp.tanh(x) * scale


out = float(f(jnp.ones(3)).sum())
s = kiln.stats()
print(json.dumps({"out": out, "time_to_first_result_s": time.perf_counter() - T0,
                  "traces": s.traces, "compiles": s.compiles,
                  "guard_seconds": s.guard_seconds}), flush=True)
"""


def _shown(r: dict[str, Any]) -> str:
    return f"ttfr {r['time_to_first_result_s']:.3f} s, wall {r['wall_s']:.3f} s"


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=2)
    parser.add_argument("--big-mib", type=int, default=1024,
                        help="size of the large table in MiB (default 1024)")
    args = bench.begin(parser, argv, dists=("jax", "jaxlib", "jax-kiln"), installed=True)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        root = Path(tmp)
        (root / "lv.py").write_text(LV)
        store, jcache = root / "store", root / "jax-cache"
        kiln_env = bench.child_env(**bench.kiln_store(store))
        jax_env = bench.child_env(**bench.jax_cache(jcache))

        def lv(jit: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
            return bench.fresh([root / "lv.py", "--jit", jit], env=env, cwd=cwd).record()

        print("filling the kiln store and JAX's persistent cache (untimed runs) ...", flush=True)
        fills = [lv("kiln", kiln_env, root), lv("jax", jax_env, root)]

        def warm(mode: str, rep: int) -> dict[str, Any]:
            if mode == "jax cache warm":
                return lv("jax", jax_env, root)
            if mode == "kiln warm":
                r = lv("kiln", kiln_env, root)
                if r["kiln"]["traces"]:
                    notes.append(f"kiln warm rep {rep} traced: {r['kiln']}")
                return r
            folder = root / f"folder-{rep}"  # a working folder of its own: every guard moves
            folder.mkdir()
            r = lv("kiln", kiln_env, folder)
            if not r["kiln"]["verifies"] or r["kiln"]["compiles"]:
                notes.append(f"verified rep {rep} did not verify without compiling: {r['kiln']}")
            return r

        modes = ("kiln warm", "kiln warm, verified", "jax cache warm")
        samples = bench.interleave(modes, args.reps, warm, show=_shown)
        runs = [*fills, *(r for m in modes for r in samples[m])]
        identical = all(r["params"] == runs[0]["params"] and r["loss"] == runs[0]["loss"]
                        for r in runs)

        # -- a large input ------------------------------------------------------------------
        big_env = bench.child_env(**bench.kiln_store(root / "big-store"))
        tables = {"large table": root / "big.npy", "small table": root / "small.npy"}
        for (_name, path), mib in zip(tables.items(), (args.big_mib, 0), strict=True):
            n = max(mib * 1024 * 1024 // 4, 256)
            table = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n,))
            table[-1] = 2.0
            table.flush()
            del table
        (root / "big.py").write_text(BIG)

        def big(name: str) -> dict[str, Any]:
            return bench.fresh([root / "big.py", tables[name]], env=big_env, cwd=root).record()

        colds = {name: big(name) for name in tables}  # (each digests its table once)
        big_samples = bench.interleave(tuple(tables), args.reps, lambda m, _: big(m),
                                       show=_shown)
        for name, rs in big_samples.items():
            if any(r["traces"] for r in rs):
                notes.append(f"{name}: a warm run traced")

    summary = {m: {"ttfr": bench.spread(r["time_to_first_result_s"] for r in samples[m]),
                   "wall": bench.spread(r["wall_s"] for r in samples[m])} for m in modes}
    print()
    print(bench.table(["mode", "reps", "ttfr median", "(min-max)", "wall median"], [
        [m, s["ttfr"]["n"], f"{s['ttfr']['median']:.3f} s",
         f"{s['ttfr']['min']:.3f}-{s['ttfr']['max']:.3f} s", f"{s['wall']['median']:.3f} s"]
        for m, s in summary.items()]))
    anchor = summary["jax cache warm"]["ttfr"]["median"]
    ratios = {m: summary[m]["ttfr"]["median"] / anchor for m in modes}
    verified_guard = bench.median(r["kiln"]["guard_seconds"] for r in samples["kiln warm"])
    big_wall = {name: bench.median(r["wall_s"] for r in rs) for name, rs in big_samples.items()}
    big_guard = {name: bench.median(r["guard_seconds"] for r in rs)
                 for name, rs in big_samples.items()}
    added = big_wall["large table"] - big_wall["small table"]
    print()
    print(bench.table(["figure", "value", "target"], [
        ["kiln warm / JAX's cache warm (ttfr)", f"{ratios['kiln warm']:.3f}x",
         f"<= {TARGET_WARM}"],
        ["kiln warm, every function verified / JAX's cache warm (ttfr)",
         f"{ratios['kiln warm, verified']:.3f}x", f"<= {TARGET_VERIFIED}"],
        ["guard check, kiln warm (median)", f"{verified_guard * 1e3:.1f} ms", "-"],
        [f"{args.big_mib} MiB table read before the trace, warm wall added (median)",
         f"{added * 1e3:.1f} ms", f"<= {TARGET_BIG_S * 1e3:.0f} ms"],
        ["  guard check with it / with 1 KiB",
         f"{big_guard['large table'] * 1e3:.2f} / {big_guard['small table'] * 1e3:.2f} ms", "-"],
        ["  cold wall with it / with 1 KiB (its one digest)",
         f"{colds['large table']['wall_s']:.3f} / {colds['small table']['wall_s']:.3f} s", "-"],
    ]))
    print(f"\nLotka-Volterra results identical in all {len(runs)} runs: {identical}")
    for note in notes:
        print(f"note: {note}")
    bench.save(args, {"summary": summary, "ratios": ratios, "identical": identical,
                      "guard_seconds_warm": verified_guard, "big_wall": big_wall,
                      "big_guard_seconds": big_guard, "big_added_s": added,
                      "big_cold": colds, "notes": notes, "runs": samples,
                      "big_runs": big_samples})
    return 0 if identical and not notes else 1


if __name__ == "__main__":
    sys.exit(main())
