"""Benchmark: unchanged ``eqx.filter_jit`` programs under ``kiln run --jit``, warm, with two
kiln source trees (equinox's ``filter_jit`` took the verify path, "static argument
static (tuple) has no canonical digest", before its statics were keyed by value and code).

Run from the repository root, ``BEFORE`` and ``AFTER`` being folders holding a ``kiln`` package
(a checkout's ``src``; ``git archive <commit> src | tar -x -C DIR`` gives one of a commit):

    python benchmarks/eqx_swap_paths.py --kiln BEFORE,AFTER [--reps 3]
                                        [--programs public_train_rnn,public_stateful]
                                        [--json PATH]

Per program: one plain ``EXAMPLE_JIT=eqx`` run (the reference result), then per tree a cold
run on its own empty store, then ``--reps`` rounds of one warm run per tree (the order
alternates each round), then one more warm run per tree with ``KILN_EXPLAIN=1``, whose
explanation lines of the swap (``jax.jit made kiln.jit[, on the verify path ...]``) are
printed. Figures: median whole-process wall seconds of the warm runs, and the ``kiln run``
summary's traces and verify-path count. The results each run printed (timings and counters
left out) must equal the plain run's; the script says so.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench
from real_programs import PROGRAMS, _base_env, _stable

EQX_PROGRAMS = [n for n in PROGRAMS if n.startswith("public_")]


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    proc = bench.fresh(argv, env=env, cwd=cwd)
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("kiln: hits:")]
    got = re.search(r"traces: (\d+).*verify path: (\d+)", summary[-1]) if summary else None
    return {"wall": proc.wall_s, "result": _stable(proc.payload or {}),
            "traces": int(got.group(1)) if got else None,
            "verify": int(got.group(2)) if got else None,
            "explain": [ln for ln in proc.stderr.splitlines()
                        if "jax.jit made kiln.jit" in ln or "left to jax.jit" in ln]}


def measure(name: str, trees: list[Path], reps: int, tmp: Path) -> dict[str, Any]:
    script = PROGRAMS[name][0]
    base = _base_env() | {"EXAMPLE_JIT": "eqx", "KILN_PROGRESS": "0"}
    plain = _run([str(script)], base | {"KILN_CACHE_DIR": str(tmp / f"{name}-plain")}, tmp)
    argv = ["-m", "kiln", "run", "--jit", str(script)]

    def env(i: int, **extra: str) -> dict[str, str]:
        path = base.get("PYTHONPATH", "")
        return base | {"PYTHONPATH": f"{trees[i]}:{path}",
                       "KILN_CACHE_DIR": str(tmp / f"{name}-{i}")} | extra

    cold = [_run(argv, env(i), tmp) for i in range(len(trees))]
    runs = bench.interleave(range(len(trees)), reps, lambda i, _: _run(argv, env(i), tmp))
    warm = [runs[i] for i in range(len(trees))]
    explained = [_run(argv, env(i, KILN_EXPLAIN="1"), tmp) for i in range(len(trees))]
    runs = [*cold, *(r for rs in warm for r in rs), *explained]
    return {
        "warm_wall_s": [bench.median(r["wall"] for r in rs) for rs in warm],
        "cold_wall_s": [r["wall"] for r in cold],
        "warm_traces": [sorted({r["traces"] for r in rs}) for rs in warm],
        "warm_verify": [sorted({r["verify"] for r in rs}) for rs in warm],
        "explain": [r["explain"] for r in explained],
        "identical_results": all(r["result"] == plain["result"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=3)
    parser.add_argument("--kiln", required=True, help="BEFORE,AFTER: folders holding kiln")
    parser.add_argument("--programs", default=",".join(EQX_PROGRAMS))
    args = bench.begin(parser, argv)
    trees = [Path(p).resolve() for p in args.kiln.split(",")]
    bench.compile_bytecode(tree / "kiln" for tree in trees)  # as an installed kiln has it
    ok = True
    report: dict[str, Any] = {"trees": [str(t) for t in trees], "programs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.programs.split(","):
            r = report["programs"][name] = measure(name, trees, args.reps, Path(tmp))
            ok &= r["identical_results"]
            w, c = r["warm_wall_s"], r["cold_wall_s"]
            named = zip((t.parent.name or str(t) for t in trees), w, strict=True)
            print(f"{name}: warm wall s (median of {args.reps}): "
                  + ", ".join(f"{t} {x:.2f}" for t, x in named)
                  + f" ({w[-1] / w[0]:.3f}x); cold wall s: "
                  + ", ".join(f"{x:.2f}" for x in c)
                  + f"; warm traces: {r['warm_traces']}; warm verify-path functions: "
                  f"{r['warm_verify']}; identical results: {r['identical_results']}",
                  flush=True)
            for tree, lines in zip(trees, r["explain"], strict=True):
                for line in lines:
                    print(f"  [{tree}] {line[:300]}")
    bench.save(args, report)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
