"""Benchmark: real programs, whole processes, kiln warm vs JAX's persistent cache warm.

Run from the repository root (about 2 minutes per program with ``--reps 5``):

    python benchmarks/real_programs.py [--reps 5] [--programs lotka_volterra,flax_cnn,...]
                                       [--json PATH]

Each program is run as a fresh process in four modes: ``kiln cold`` (an empty store, once) and
``kiln warm`` (that store), ``jax cold`` (``jax.jit`` / ``eqx.filter_jit`` with JAX's persistent
cache in an empty directory, once: minimum compile time 0, any entry size, as JAX's docs
suggest for this comparison) and ``jax cache warm`` (that directory). Warm runs come in
interleaved pairs (the order alternates), ``--reps`` pairs per program. Two figures per run, in
seconds: ``wall``, the whole process (interpreter start and exit included), and ``ttfr``, the
program's own ``time_to_first_result_s`` (from before ``import jax`` to its first result; not
every published example prints one). Beside each program, the import floor: the median wall
of ``python -c "import jax, <its libraries>"`` (what no cache can save).

The results each run prints (its last JSON line, timings and kiln's counters left out) must be
identical in every mode and run; the script says so or fails. Targets, every
program: kiln warm wall <= 1.0x JAX's cache warm, time to first result <= 0.8x. Stores and
caches live in temporary directories; ``KILN_*`` and JAX cache variables of the calling
environment are removed, so your own cache is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _installed import compile_bytecode

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "examples"
_STRIP = ("KILN_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION",
          "EXAMPLE_JIT")
# volatile fields of a program's result line: timings and kiln's counters
_VOLATILE = {"time_to_first_result_s", "first_step_s", "hits", "misses", "traces", "compiles",
             "kiln", "seconds", "elapsed_s", "wall_s", "steady_s", "jit", "mode"}

# name: (script, kiln argv / env, plain argv / env, libraries its import floor imports)
PROGRAMS: dict[str, tuple[Path, tuple[list[str], dict[str, str]], tuple[list[str], dict[str, str]],
                          str]] = {
    "lotka_volterra": (EX / "lotka_volterra.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                       "jax, diffrax, optimistix, equinox"),
    "mlp_digits": (EX / "mlp_digits.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                   "jax, optax, sklearn.datasets"),
    "flax_digits": (EX / "flax_digits.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                    "jax, flax.linen, flax.nnx, optax, sklearn.datasets"),
    "flax_cnn": (EX / "flax_cnn.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                 "jax, flax.linen, flax.training.train_state, optax, sklearn.datasets"),
    "eqx_transformer": (EX / "eqx_transformer.py", (["--jit", "kiln"], {}),
                        (["--jit", "jax"], {}), "jax, equinox, optax"),
    "gp_fit": (EX / "gp_fit.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
               "jax, optimistix, sklearn.datasets"),
    **{f"public_{p}": (EX / "public" / f"{p}.py", ([], {"EXAMPLE_JIT": "kiln"}),
                       ([], {"EXAMPLE_JIT": "eqx"}), "jax, equinox, optax")
       for p in ("cnn", "neural_ode", "stateful", "train_rnn")},
}


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    env["PYTHONPATH"] = os.pathsep.join([str(EX / "public"), env.get("PYTHONPATH", "")])
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed:\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    ttfr = result.get("time_to_first_result_s") if isinstance(result, dict) else None
    return {"wall": wall, "ttfr": ttfr, "result": _stable(result)}


def _stable(result: Any) -> Any:
    if isinstance(result, dict):
        return {k: _stable(v) for k, v in result.items() if k not in _VOLATILE}
    return result


def _floor(libs: str, env: dict[str, str], cwd: Path) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {libs}"], env=env, cwd=cwd, check=True,
                       capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, reps: int, tmp: Path) -> dict[str, Any]:
    script, (kiln_argv, kiln_env), (jax_argv, jax_env), libs = PROGRAMS[name]
    base = _base_env()
    store, cache = tmp / f"{name}-store", tmp / f"{name}-jax-cache"
    envs = {
        "kiln": base | kiln_env | {"KILN_CACHE_DIR": str(store), "KILN_PROGRESS": "0"},
        "jax": base | jax_env | {"JAX_COMPILATION_CACHE_DIR": str(cache),
                                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                                 "KILN_JAX_CACHE": "0"},
    }
    argvs = {"kiln": [str(script), *kiln_argv], "jax": [str(script), *jax_argv]}
    runs: dict[str, list[dict[str, Any]]] = {"kiln cold": [], "jax cold": [], "kiln warm": [],
                                             "jax cache warm": []}
    runs["kiln cold"].append(_run(argvs["kiln"], envs["kiln"], tmp))
    runs["jax cold"].append(_run(argvs["jax"], envs["jax"], tmp))
    for rep in range(reps):
        order = ("kiln", "jax") if rep % 2 == 0 else ("jax", "kiln")
        for who in order:
            mode = "kiln warm" if who == "kiln" else "jax cache warm"
            runs[mode].append(_run(argvs[who], envs[who], tmp))
    results = {json.dumps(r["result"], sort_keys=True) for rs in runs.values() for r in rs}
    med = {m: statistics.median(r["wall"] for r in rs) for m, rs in runs.items()}
    ttfr = {m: statistics.median(r["ttfr"] for r in rs) if all(r["ttfr"] is not None for r in rs)
            else None for m, rs in runs.items()}
    out = {"wall_s": med, "ttfr_s": ttfr, "identical_results": len(results) == 1,
           "import_floor_s": _floor(libs, base, tmp),
           "wall_ratio": med["kiln warm"] / med["jax cache warm"],
           "ttfr_ratio": (ttfr["kiln warm"] / ttfr["jax cache warm"]
                          if ttfr["kiln warm"] and ttfr["jax cache warm"] else None),
           "runs": runs}
    return out


def start(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options of a benchmark over :data:`PROGRAMS` (``--reps``, ``--programs``,
    ``--json``) and the program names, checked; prints the command line and compiles kiln's
    bytecode, as every run starts."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    compile_bytecode()
    names = [n for n in args.programs.split(",") if n]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: unknown {unknown}; known: {', '.join(PROGRAMS)}")
    return args, names


def main(argv: list[str] | None = None) -> int:
    args, names = start(__doc__, argv)
    report: dict[str, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = report[name] = measure(name, args.reps, Path(tmp))
            w, t = r["wall_s"], r["ttfr_s"]
            ttfr = (f"ttfr {t['kiln warm']:.2f} vs {t['jax cache warm']:.2f} s "
                    f"({r['ttfr_ratio']:.3f}x)" if r["ttfr_ratio"] else "ttfr -")
            print(f"{name:16s} warm wall kiln {w['kiln warm']:.2f} s vs JAX cache "
                  f"{w['jax cache warm']:.2f} s ({r['wall_ratio']:.3f}x); {ttfr}; cold wall kiln "
                  f"{w['kiln cold']:.2f} s, jax {w['jax cold']:.2f} s; import floor "
                  f"{r['import_floor_s']:.2f} s; identical results: {r['identical_results']}",
                  flush=True)
            ok &= r["identical_results"]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
