"""Benchmark: what kiln's fingerprint costs, cold and warm, on the two example programs.

Run from the repository root (about 3 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/fingerprint.py [--quick] [--reps 5] [--json PATH]

For each example (``examples/lotka_volterra.py``, ``examples/mlp_digits.py``) and repetition:
a fresh temporary store, one cold process (``--jit kiln``), then one warm process on that store,
and (the anchor) one warm process of ``--jit jax`` with JAX's persistent cache filled by an
untimed run. Each process reports ``kiln.stats().fingerprint_seconds`` (the static walk before
each store lookup, building the manifest after a cold trace, re-checking it on a hit: all of
the fingerprint's work) and the script's own ``time_to_first_result_s``. Figures are medians.

Target: the fingerprint must not add more than 0.1 s to a warm start of the MLP
example; the warm fingerprint seconds are that cost (a warm start does nothing else new).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _children import child_env, run_child

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("lotka_volterra", "mlp_digits")
# Runs an example as __main__, then prints kiln's counters as the last line.
RUNNER = (
    "import json, runpy, sys\n"
    "path = sys.argv[1]\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(path, run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    if e.code:\n"
    "        raise\n"
    "import kiln\n"
    "print('KILN-STATS ' + json.dumps(kiln.stats().as_dict()))\n"
)


def run(example: str, jit: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-c", RUNNER, str(REPO / "examples" / f"{example}.py"), "--jit", jit]
    proc = run_child(cmd, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    stats = json.loads(lines[-1][len("KILN-STATS "):])
    result = json.loads(lines[-2])
    return {"ttfr": result["time_to_first_result_s"], "stats": stats}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition (smoke test; noisy)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    out: dict[str, Any] = {}
    for example in EXAMPLES:
        rows: dict[str, list[float]] = {k: [] for k in (
            "fp_cold", "fp_warm", "ttfr_cold", "ttfr_warm", "ttfr_jax_cache_warm", "hits_warm")}
        with tempfile.TemporaryDirectory() as jax_cache:
            jax_env = child_env(JAX_COMPILATION_CACHE_DIR=jax_cache,
                                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
            run(example, "jax", jax_env)  # fill JAX's cache (untimed)
            for _ in range(reps):
                with tempfile.TemporaryDirectory() as store:
                    env = child_env(KILN_CACHE_DIR=store, KILN_PROGRESS="0")
                    cold = run(example, "kiln", env)
                    warm = run(example, "kiln", env)
                jax_warm = run(example, "jax", jax_env)
                rows["fp_cold"].append(cold["stats"]["fingerprint_seconds"])
                rows["fp_warm"].append(warm["stats"]["fingerprint_seconds"])
                rows["ttfr_cold"].append(cold["ttfr"])
                rows["ttfr_warm"].append(warm["ttfr"])
                rows["ttfr_jax_cache_warm"].append(jax_warm["ttfr"])
                rows["hits_warm"].append(warm["stats"]["hits"])
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[example] = {"median": med, "samples": rows}
        print(f"{example}: fingerprint {med['fp_cold']:.4f} s cold, {med['fp_warm']:.4f} s warm; "
              f"first result kiln warm {med['ttfr_warm']:.2f} s, JAX cache warm "
              f"{med['ttfr_jax_cache_warm']:.2f} s "
              f"({med['ttfr_warm'] / med['ttfr_jax_cache_warm']:.3f}x), kiln cold "
              f"{med['ttfr_cold']:.2f} s; warm hits {rows['hits_warm']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
