"""Benchmark: the published programs UNCHANGED (plain ``jax.jit`` / ``eqx.filter_jit``), whole
processes, warm, in three modes:

- ``jax cache``: JAX's own persistent cache in a directory (min compile time 0, any entry size);
- ``kiln run``: ``python -m kiln run --no-jit SCRIPT``, JAX's cache routed into kiln's store
  alone (trace and lower every run, skip the compile);
- ``kiln run --jit``: every ``jax.jit`` outside JAX a ``kiln.jit`` (the jax.jit swap; ``kiln
  run``'s default since issue 43).

Run from the repository root:

    python benchmarks/jit_swap.py [--reps 3] [--programs public_neural_ode,mlp_digits,...]
                                  [--json PATH]

Each mode runs once cold (its own empty store or cache), then ``--reps`` rounds of the three
warm modes, interleaved (the order rotates each round). Figures: median whole-process wall
seconds (interpreter start and exit included), and the program's ``time_to_first_result_s``
where it prints one. The results each run prints (timings and counters left out) must be
identical in every mode and run; the script says so or fails.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from real_programs import PROGRAMS, _base_env, _run, start

MODES = ("jax cache", "kiln run", "kiln run --jit")


def measure(name: str, reps: int, tmp: Path) -> dict[str, Any]:
    script, _, (argv, jax_env), _ = PROGRAMS[name]
    base = _base_env() | jax_env
    envs = {
        "jax cache": base | {"JAX_COMPILATION_CACHE_DIR": str(tmp / f"{name}-jax-cache"),
                             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                             "KILN_JAX_CACHE": "0"},
        "kiln run": base | {"KILN_CACHE_DIR": str(tmp / f"{name}-route"), "KILN_PROGRESS": "0"},
        "kiln run --jit": base | {"KILN_CACHE_DIR": str(tmp / f"{name}-swap"),
                                  "KILN_PROGRESS": "0"},
    }
    argvs = {"jax cache": [str(script), *argv],
             "kiln run": ["-m", "kiln", "run", "--no-jit", str(script), *argv],
             "kiln run --jit": ["-m", "kiln", "run", "--jit", str(script), *argv]}
    cold = {m: _run(argvs[m], envs[m], tmp) for m in MODES}
    warm: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(reps):
        for i in range(len(MODES)):
            mode = MODES[(rep + i) % len(MODES)]
            warm[mode].append(_run(argvs[mode], envs[mode], tmp))
    every = [*cold.values(), *(r for rs in warm.values() for r in rs)]
    results = {json.dumps(r["result"], sort_keys=True) for r in every}
    med = {m: statistics.median(r["wall"] for r in rs) for m, rs in warm.items()}
    ttfr = {m: statistics.median(r["ttfr"] for r in rs) if all(r["ttfr"] is not None for r in rs)
            else None for m, rs in warm.items()}
    return {"warm_wall_s": med, "warm_ttfr_s": ttfr,
            "cold_wall_s": {m: r["wall"] for m, r in cold.items()},
            "identical_results": len(results) == 1, "warm_runs": warm}


def main(argv: list[str] | None = None) -> int:
    args, names = start(__doc__, argv)
    report: dict[str, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = report[name] = measure(name, args.reps, Path(tmp))
            w, t, c = r["warm_wall_s"], r["warm_ttfr_s"], r["cold_wall_s"]
            walls = ", ".join(f"{m} {w[m]:.2f}" for m in MODES)
            ttfrs = ", ".join(f"{m} {t[m]:.2f}" for m in MODES) if all(t.values()) else "-"
            print(f"{name:18s} warm wall s: {walls} (--jit / kiln run "
                  f"{w['kiln run --jit'] / w['kiln run']:.3f}x, / jax cache "
                  f"{w['kiln run --jit'] / w['jax cache']:.3f}x); warm ttfr s: {ttfrs}; cold "
                  f"wall s: " + ", ".join(f"{m} {c[m]:.2f}" for m in MODES) +
                  f"; identical results: {r['identical_results']}", flush=True)
            ok &= r["identical_results"]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
