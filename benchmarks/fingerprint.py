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

import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("lotka_volterra", "mlp_digits")
VARIANTS = ("kiln cold", "kiln warm", "jax cache warm")
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
    proc = bench.fresh(["-c", RUNNER, REPO / "examples" / f"{example}.py", "--jit", jit],
                       env=env, cwd=REPO, marker="KILN-STATS ")
    result = bench.last_json(proc.stdout)
    return {"ttfr": result["time_to_first_result_s"], "stats": proc.payload}


def measure(example: str, reps: int, tmp: Path) -> dict[str, Any]:
    """Per repetition a fresh store: kiln cold, kiln warm on it, then JAX's cache warm (filled
    by an untimed run first)."""
    jax_env = bench.child_env(**bench.jax_cache(tmp / f"{example}-jax-cache"))
    run(example, "jax", jax_env)  # fill JAX's cache (untimed)

    def one(variant: str, rep: int) -> dict[str, Any]:
        if variant == "jax cache warm":
            return run(example, "jax", jax_env)
        return run(example, "kiln", bench.child_env(**bench.kiln_store(tmp / f"{example}-{rep}")))

    runs = bench.interleave(VARIANTS, reps, one, rotate=False, label=lambda v: f"{example} {v}",
                            show=lambda r: f"ttfr {r['ttfr']:.2f} s, fingerprint "
                                           f"{r['stats']['fingerprint_seconds']:.4f} s")
    rows = {"fp_cold": [r["stats"]["fingerprint_seconds"] for r in runs["kiln cold"]],
            "fp_warm": [r["stats"]["fingerprint_seconds"] for r in runs["kiln warm"]],
            "ttfr_cold": [r["ttfr"] for r in runs["kiln cold"]],
            "ttfr_warm": [r["ttfr"] for r in runs["kiln warm"]],
            "ttfr_jax_cache_warm": [r["ttfr"] for r in runs["jax cache warm"]],
            "hits_warm": [r["stats"]["hits"] for r in runs["kiln warm"]]}
    return {"median": {k: bench.median(v) for k, v in rows.items()}, "samples": rows}


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=5, quick_reps=1), argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for example in EXAMPLES:
            out[example] = measure(example, args.reps, Path(tmp))
    print(bench.table(
        ["example", "fingerprint cold s", "warm s", "ttfr kiln warm s", "JAX cache warm s",
         "kiln / JAX", "kiln cold s", "warm hits"],
        [[ex, f"{m['fp_cold']:.4f}", f"{m['fp_warm']:.4f}", m["ttfr_warm"],
          m["ttfr_jax_cache_warm"], f"{m['ttfr_warm'] / m['ttfr_jax_cache_warm']:.3f}x",
          m["ttfr_cold"], r["samples"]["hits_warm"]]
         for ex, r in out.items() for m in [r["median"]]]))
    bench.save(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
