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
before ``import jax`` to the fit's result), and ``wall``, the whole process (``perf_counter``
around ``subprocess.run``: interpreter start-up and exit included). Each figure is the median
over the repetitions; warm repetitions of kiln and JAX are interleaved to share any drift.
Targets: kiln warm / JAX cache warm <= 0.25 (ttfr); kiln cold / ``jax.jit`` cold <= 1.05
(ttfr, the cold tax: fingerprint, jaxpr walks, serializing and writing the entry). Cold
repetitions run in pairs (kiln and ``jax.jit``, alternating which goes first); besides the ratio
of medians, the median of the per-pair ratios is printed (drift in machine load hits both
members of a pair alike). The fitted parameters must be identical in
every run. Every store and cache lives in a ``tempfile.TemporaryDirectory``; ``KILN_*``,
``JAX_*`` and ``XLA_*`` variables of the calling environment are removed (``_children.py``),
so the user's cache is never touched.
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
from _installed import compile_bytecode

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "lotka_volterra.py"
TARGET_KILN_VS_JAX_CACHE = 0.25
TARGET_COLD_TAX = 1.05  # kiln cold / jax.jit cold (ttfr), an empty store
MODES = ("kiln warm", "jax cache warm", "jax.jit cold", "kiln cold")


def kiln_env(store: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=store, KILN_PROGRESS="0")


def jax_cache_env(cache: str) -> dict[str, str]:
    return child_env(
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )


def run_example(jit: str, env: dict[str, str]) -> dict[str, Any]:
    """One fresh process; returns its JSON result plus ``wall_s``."""
    cmd = [sys.executable, str(EXAMPLE), "--jit", jit]
    t0 = time.perf_counter()
    proc = run_child(cmd, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1])
    result["wall_s"] = wall
    result["stderr_tail"] = proc.stderr[-2000:]
    return result


def snapshot(root: Path) -> dict[str, int]:
    """``{relative path: mtime_ns}`` of every file under ``root`` (to detect writes)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def entry_files(store: Path) -> dict[str, int]:
    return snapshot(store / "entries")


def device_info() -> str:
    code = "import jax; d = jax.devices()[0]; print(jax.default_backend(), d.device_kind)"
    proc = run_child([sys.executable, "-c", code], timeout=300, check=False)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("jax", "jaxlib", "jax-kiln", "diffrax", "optimistix", "equinox"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ttfr = [s["time_to_first_result_s"] for s in samples]
    wall = [s["wall_s"] for s in samples]
    return {
        "reps": len(samples),
        "ttfr_median_s": statistics.median(ttfr),
        "ttfr_min_s": min(ttfr),
        "ttfr_max_s": max(ttfr),
        "wall_median_s": statistics.median(wall),
        "wall_min_s": min(wall),
        "wall_max_s": max(wall),
        "ttfr_s": ttfr,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 warm and 1 cold repetition (smoke test; noisy)"
    )
    parser.add_argument("--reps", type=int, default=None, help="warm repetitions (default 5)")
    parser.add_argument(
        "--cold-reps", type=int, default=None, help="cold repetitions, ~15 s each (default 5)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    cold_reps = args.cold_reps if args.cold_reps is not None else (1 if args.quick else 5)
    if reps < 1 or cold_reps < 1:
        parser.error("--reps and --cold-reps must be >= 1")
    compile_bytecode()  # as an installed kiln: see benchmarks/_installed.py

    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    print(f"$ {command}")
    vers = versions()
    device = device_info()
    print(
        ", ".join(f"{k} {v}" for k, v in vers.items()) + f"; device {device}; {os.cpu_count()} CPUs"
    )
    print(
        f"example: {EXAMPLE.relative_to(REPO)}; warm reps {reps}, cold reps {cold_reps}"
        + ("  [QUICK: too few reps, figures are noisy]" if args.quick else "")
    )
    print(flush=True)

    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        tmpdir = Path(tmp)
        store = tmpdir / "kiln-store"
        jcache = tmpdir / "jax-cache"

        # untimed fills
        print("filling the kiln store (untimed cold run) ...", flush=True)
        fill_kiln = run_example("kiln", kiln_env(str(store)))
        print("filling JAX's persistent cache (untimed run) ...", flush=True)
        fill_jax = run_example("jax", jax_cache_env(str(jcache)))
        kiln_files = entry_files(store)
        jax_files = snapshot(jcache)
        if not kiln_files:
            notes.append("kiln store has no entries after the fill run: kiln warm is not warm")
        if not jax_files:
            notes.append("JAX's cache has no files after the fill run")

        # warm: interleaved, alternating which goes first
        for i in range(reps):
            order = (
                ("kiln warm", "jax cache warm") if i % 2 == 0 else ("jax cache warm", "kiln warm")
            )
            for mode in order:
                if mode == "kiln warm":
                    r = run_example("kiln", kiln_env(str(store)))
                    after = entry_files(store)
                    if after != kiln_files:
                        notes.append(f"kiln warm rep {i}: the store was written (not a pure hit)")
                        kiln_files = after
                else:
                    r = run_example("jax", jax_cache_env(str(jcache)))
                    after = snapshot(jcache)
                    if set(after) - set(jax_files):
                        notes.append(f"jax cache warm rep {i}: new cache files were written")
                    jax_files = after
                samples[mode].append(r)
                print(
                    f"  {mode:<15} rep {i + 1}/{reps}: ttfr {r['time_to_first_result_s']:.3f} s,"
                    f" wall {r['wall_s']:.3f} s",
                    flush=True,
                )

        # cold: interleaved too
        for i in range(cold_reps):
            order = ("jax.jit cold", "kiln cold") if i % 2 == 0 else ("kiln cold", "jax.jit cold")
            for mode in order:
                if mode == "kiln cold":
                    with tempfile.TemporaryDirectory(prefix="kiln-cold-", dir=tmp) as fresh:
                        r = run_example("kiln", kiln_env(fresh))
                else:
                    r = run_example("jax", child_env())
                samples[mode].append(r)
                print(
                    f"  {mode:<15} rep {i + 1}/{cold_reps}: ttfr "
                    f"{r['time_to_first_result_s']:.3f} s, wall {r['wall_s']:.3f} s",
                    flush=True,
                )
        jax_cache_files = len(snapshot(jcache))
        kiln_entry_bytes = sum((store / "entries" / p).stat().st_size for p in entry_files(store))

    # identical parameters everywhere
    all_runs = [fill_kiln, fill_jax] + [r for m in MODES for r in samples[m]]
    ref = all_runs[0]["params"]
    params_identical = all(r["params"] == ref for r in all_runs)
    fields = ("params", "initial_state", "loss", "bfgs_steps")
    results_identical = all(all(r.get(f) == all_runs[0].get(f) for f in fields) for r in all_runs)
    if not params_identical:
        distinct = {json.dumps(r["params"], sort_keys=True) for r in all_runs}
        notes.append("PARAMS DIFFER between runs: " + "; ".join(sorted(distinct)))

    summary = {m: summarize(samples[m]) for m in MODES}
    print()
    print(
        f"{'mode':<16}{'reps':>5}{'ttfr median':>14}{'(min-max)':>18}{'wall median':>14}"
        f"{'(min-max)':>18}"
    )
    for m in MODES:
        s = summary[m]
        ttfr_range = f"{s['ttfr_min_s']:.3f}-{s['ttfr_max_s']:.3f} s"
        wall_range = f"{s['wall_min_s']:.3f}-{s['wall_max_s']:.3f} s"
        print(
            f"{m:<16}{s['reps']:>5}{s['ttfr_median_s']:>12.3f} s{ttfr_range:>18}"
            f"{s['wall_median_s']:>12.3f} s{wall_range:>18}"
        )

    def ratio(a: str, b: str, fig: str) -> float:
        return summary[a][f"{fig}_median_s"] / summary[b][f"{fig}_median_s"]

    ratios = {
        f"{a} / {b}": {fig: ratio(a, b, fig) for fig in ("ttfr", "wall")}
        for a, b in (
            ("kiln warm", "jax cache warm"),
            ("kiln warm", "jax.jit cold"),
            ("jax cache warm", "jax.jit cold"),
            ("kiln cold", "jax.jit cold"),
        )
    }
    print()
    print(f"{'ratio of medians':<34}{'ttfr':>8}{'wall':>8}")
    for name, r in ratios.items():
        print(f"{name:<34}{r['ttfr']:>7.3f}x{r['wall']:>7.3f}x")
    target_met = ratios["kiln warm / jax cache warm"]["ttfr"] <= TARGET_KILN_VS_JAX_CACHE
    pair_ratios = [
        k["time_to_first_result_s"] / j["time_to_first_result_s"]
        for k, j in zip(samples["kiln cold"], samples["jax.jit cold"], strict=True)
    ]
    cold_tax = ratios["kiln cold / jax.jit cold"]["ttfr"]
    cold_pairs = statistics.median(pair_ratios)
    print(f"{'kiln cold / jax.jit cold, pairs':<34}{cold_pairs:>7.3f}x  (median of "
          + ", ".join(f"{r:.3f}" for r in pair_ratios) + ")")
    print()
    print(
        f"target kiln warm / jax cache warm (ttfr) <= {TARGET_KILN_VS_JAX_CACHE}: "
        f"{'met' if target_met else 'NOT met'}"
    )
    print(
        f"target kiln cold / jax.jit cold (ttfr) <= {TARGET_COLD_TAX}: "
        f"{'met' if cold_tax <= TARGET_COLD_TAX else 'NOT met'} ({cold_tax:.3f}x of medians, "
        f"{cold_pairs:.3f}x median of pairs)"
    )
    print(
        f"params identical in all {len(all_runs)} runs: {params_identical}; "
        f"params, initial state, loss and BFGS steps identical: {results_identical}"
    )
    print(f"params: {ref}")
    print(
        f"kiln entry bytes: {kiln_entry_bytes}; JAX cache files after all runs: {jax_cache_files}"
    )
    for note in notes:
        print(f"note: {note}")

    if args.json is not None:
        payload = {
            "benchmark": "warm_start",
            "command": command,
            "quick": args.quick,
            "versions": vers,
            "device": device,
            "cpus": os.cpu_count(),
            "reps": reps,
            "cold_reps": cold_reps,
            "summary": summary,
            "ratios": ratios,
            "target_kiln_warm_vs_jax_cache_warm": TARGET_KILN_VS_JAX_CACHE,
            "target_met": target_met,
            "cold_pair_ratios": pair_ratios,
            "target_cold_tax": TARGET_COLD_TAX,
            "cold_tax_met": cold_tax <= TARGET_COLD_TAX,
            "params_identical": params_identical,
            "results_identical": results_identical,
            "params": ref,
            "kiln_entry_bytes": kiln_entry_bytes,
            "jax_cache_files": jax_cache_files,
            "notes": notes,
            "runs": {
                m: [{k: v for k, v in r.items() if k != "stderr_tail"} for r in samples[m]]
                for m in MODES
            },
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if params_identical else 1


if __name__ == "__main__":
    sys.exit(main())
