"""Benchmark: fresh process to first result of the Lotka-Volterra fit (examples/lotka_volterra.py).

Run from the repository root (about 5 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/warm_start.py [--quick] [--reps 5] [--cold-reps 5] [--json PATH]

Each run is a fresh ``python examples/lotka_volterra.py --jit MODE`` process. Modes:

- ``kiln warm``: ``--jit kiln`` on a store filled by one untimed cold run first;
- ``jax cache warm`` (the anchor): ``--jit jax`` with JAX's persistent compilation cache in a
  temporary directory, filled by one untimed run first (``JAX_COMPILATION_CACHE_DIR``,
  ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``,
  ``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1``);
- ``jax.jit cold``: ``--jit jax``, no cache;
- ``kiln cold``: ``--jit kiln`` on a fresh, empty store every repetition.

Two figures per run, in seconds: ``ttfr``, the script's own ``time_to_first_result_s`` (from
before ``import jax`` to the fit's result), and ``wall``, the whole process (interpreter
start-up and exit included). Each figure is the median over the repetitions; warm repetitions
of kiln and JAX are interleaved to share any drift. Targets: kiln warm / JAX cache warm <= 0.25
(ttfr); kiln cold / ``jax.jit`` cold <= 1.05 (ttfr, the cold tax: fingerprint, jaxpr walks,
serializing and writing the entry; ``cold_tax.py`` measures it apart). Cold repetitions run in
pairs (kiln and ``jax.jit``, alternating which goes first); besides the ratio of medians, the
median of the per-pair ratios is printed (drift in machine load hits both members of a pair
alike). The fitted parameters must be identical in every run. Every store and cache lives in a
``tempfile.TemporaryDirectory``; ``KILN_*``, ``JAX_*`` and ``XLA_*`` variables of the calling
environment are removed (``_harness.py``), so the user's cache is never touched.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "lotka_volterra.py"
TARGET_KILN_VS_JAX_CACHE = 0.25
TARGET_COLD_TAX = 1.05  # kiln cold / jax.jit cold (ttfr), an empty store
MODES = ("kiln warm", "jax cache warm", "jax.jit cold", "kiln cold")


def run_example(jit: str, env: dict[str, str]) -> dict[str, Any]:
    """One fresh process; its JSON result plus ``wall_s``."""
    return bench.fresh([EXAMPLE, "--jit", jit], env=env, cwd=REPO).record()


def snapshot(root: Path) -> dict[str, int]:
    """``{relative path: mtime_ns}`` of every file under ``root`` (to detect writes)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def device_info() -> str:
    code = "import jax; d = jax.devices()[0]; print(jax.default_backend(), d.device_kind)"
    proc = bench.run_child([sys.executable, "-c", code], timeout=300, check=False)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def _shown(r: dict[str, Any]) -> str:
    return f"ttfr {r['time_to_first_result_s']:.3f} s, wall {r['wall_s']:.3f} s"


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=2)
    parser.add_argument("--cold-reps", type=int, default=None,
                        help="cold repetitions, ~15 s each (default 5; 1 with --quick)")
    args = bench.begin(parser, argv, dists=("jax", "jaxlib", "jax-kiln", "diffrax",
                                            "optimistix", "equinox"), installed=True)
    cold_reps = args.cold_reps if args.cold_reps is not None else (1 if args.quick else 5)
    if cold_reps < 1:
        parser.error("--cold-reps must be >= 1")
    device = device_info()
    print(f"device {device}; example: {EXAMPLE.relative_to(REPO)}; warm reps {args.reps}, "
          f"cold reps {cold_reps}\n", flush=True)

    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        store, jcache = Path(tmp) / "kiln-store", Path(tmp) / "jax-cache"
        kiln_env = bench.child_env(**bench.kiln_store(store))
        jax_env = bench.child_env(**bench.jax_cache(jcache))
        print("filling the kiln store and JAX's persistent cache (untimed runs) ...", flush=True)
        fills = [run_example("kiln", kiln_env), run_example("jax", jax_env)]
        seen = {"kiln warm": snapshot(store / "entries"), "jax cache warm": snapshot(jcache)}
        if not seen["kiln warm"]:
            notes.append("kiln store has no entries after the fill run: kiln warm is not warm")
        if not seen["jax cache warm"]:
            notes.append("JAX's cache has no files after the fill run")

        def warm(mode: str, rep: int) -> dict[str, Any]:
            kiln = mode == "kiln warm"
            r = run_example("kiln" if kiln else "jax", kiln_env if kiln else jax_env)
            after = snapshot(store / "entries" if kiln else jcache)
            if (after != seen[mode]) if kiln else bool(set(after) - set(seen[mode])):
                notes.append(f"{mode} rep {rep}: " + ("the store was written (not a pure hit)"
                                                      if kiln else "new cache files were written"))
            seen[mode] = after
            return r

        def cold(mode: str, rep: int) -> dict[str, Any]:
            if mode == "jax.jit cold":
                return run_example("jax", bench.child_env())
            with tempfile.TemporaryDirectory(prefix="kiln-cold-", dir=tmp) as empty:
                return run_example("kiln", bench.child_env(**bench.kiln_store(empty)))

        samples = bench.interleave(MODES[:2], args.reps, warm, show=_shown)
        samples |= bench.interleave(("jax.jit cold", "kiln cold"), cold_reps, cold, show=_shown)
        jax_cache_files = len(snapshot(jcache))
        kiln_entry_bytes = sum((store / "entries" / p).stat().st_size
                               for p in snapshot(store / "entries"))

    runs = [*fills, *(r for m in MODES for r in samples[m])]
    ref = runs[0]["params"]
    params_identical = all(r["params"] == ref for r in runs)
    fields = ("params", "initial_state", "loss", "bfgs_steps")
    results_identical = all(all(r.get(f) == runs[0].get(f) for f in fields) for r in runs)
    if not params_identical:
        distinct = {json.dumps(r["params"], sort_keys=True) for r in runs}
        notes.append("PARAMS DIFFER between runs: " + "; ".join(sorted(distinct)))

    summary = {m: {"ttfr": bench.spread(r["time_to_first_result_s"] for r in samples[m]),
                   "wall": bench.spread(r["wall_s"] for r in samples[m])} for m in MODES}
    print()
    print(bench.table(["mode", "reps", "ttfr median", "(min-max)", "wall median", "(min-max)"], [
        [m, s["ttfr"]["n"], f"{s['ttfr']['median']:.3f} s",
         f"{s['ttfr']['min']:.3f}-{s['ttfr']['max']:.3f} s", f"{s['wall']['median']:.3f} s",
         f"{s['wall']['min']:.3f}-{s['wall']['max']:.3f} s"] for m, s in summary.items()]))
    by_fig = {fig: bench.ratios({m: s[fig]["median"] for m, s in summary.items()}, "jax.jit cold")
              for fig in ("ttfr", "wall")}
    anchor = {fig: summary["jax cache warm"][fig]["median"] for fig in ("ttfr", "wall")}
    figures = {
        "kiln warm / jax cache warm": {f: summary["kiln warm"][f]["median"] / anchor[f]
                                       for f in anchor},
        **{f"{m} / jax.jit cold": {f: by_fig[f][m] for f in by_fig}
           for m in ("kiln warm", "jax cache warm", "kiln cold")},
    }
    pairs = bench.pair_ratios([r["time_to_first_result_s"] for r in samples["kiln cold"]],
                              [r["time_to_first_result_s"] for r in samples["jax.jit cold"]])
    cold_pairs = bench.median(pairs)
    print()
    print(bench.table(["ratio of medians", "ttfr", "wall"],
                      [[name, f"{r['ttfr']:.3f}x", f"{r['wall']:.3f}x"]
                       for name, r in figures.items()]
                      + [["kiln cold / jax.jit cold, pairs", f"{cold_pairs:.3f}x", "-"]]))
    print("(pairs: median of " + ", ".join(f"{r:.3f}" for r in pairs) + ")\n")
    target_met = figures["kiln warm / jax cache warm"]["ttfr"] <= TARGET_KILN_VS_JAX_CACHE
    cold_tax = figures["kiln cold / jax.jit cold"]["ttfr"]
    print(f"target kiln warm / jax cache warm (ttfr) <= {TARGET_KILN_VS_JAX_CACHE}: "
          f"{'met' if target_met else 'NOT met'}")
    print(f"target kiln cold / jax.jit cold (ttfr) <= {TARGET_COLD_TAX}: "
          f"{'met' if cold_tax <= TARGET_COLD_TAX else 'NOT met'} ({cold_tax:.3f}x of medians, "
          f"{cold_pairs:.3f}x median of pairs)")
    print(f"params identical in all {len(runs)} runs: {params_identical}; params, initial "
          f"state, loss and BFGS steps identical: {results_identical}")
    print(f"params: {ref}")
    print(f"kiln entry bytes: {kiln_entry_bytes}; JAX cache files after all runs: "
          f"{jax_cache_files}")
    for note in notes:
        print(f"note: {note}")
    bench.save(args, {
        "device": device, "cold_reps": cold_reps, "summary": summary, "ratios": figures,
        "target_kiln_warm_vs_jax_cache_warm": TARGET_KILN_VS_JAX_CACHE,
        "target_met": target_met, "cold_pair_ratios": pairs, "target_cold_tax": TARGET_COLD_TAX,
        "cold_tax_met": cold_tax <= TARGET_COLD_TAX, "params_identical": params_identical,
        "results_identical": results_identical, "params": ref,
        "kiln_entry_bytes": kiln_entry_bytes, "jax_cache_files": jax_cache_files,
        "notes": notes, "runs": samples})
    return 0 if params_identical else 1


if __name__ == "__main__":
    sys.exit(main())
