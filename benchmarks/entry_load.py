"""Benchmark: loading a stored entry vs compiling it, and the entry's size.

Run from the repository root (about 3 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/entry_load.py [--quick] [--reps 5] [--json PATH]

Cases: the Lotka-Volterra fit (``examples/lotka_volterra.py``, ``make_fit("kiln")``), the MLP
digits ``train_step`` (``examples/mlp_digits.py``, ``make_functions("kiln")``), and a tiny
function ``x * y + 1`` on float32[8]. The examples are imported by file path.

Each repetition, per case, uses a fresh empty store (``tempfile.TemporaryDirectory``, via
``KILN_CACHE_DIR``) and two fresh processes:

1. cold: call once; record ``kiln.stats().compile_seconds`` (trace + lower + compile + store
   lookup, seconds) and the size in bytes of the store's ``entries/`` (sum of its files);
2. warm: call once in a new process on that store; record ``kiln.stats().load_seconds``
   (deserializing the executable, seconds; the store read and digest check are not included).

Each process also reports the wall time of its first call (to the blocked result), which on the
warm side adds the store read, digest check, manifest check and first execution. Figures are
medians over the repetitions; the anchor is the compile time, and the ratio load / compile says
what share of the compile a warm start still pays. ``KILN_*``, ``JAX_*`` and ``XLA_*``
variables of the calling environment are removed (``_harness.py``), so the user's cache is
never touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CASES = ("lotka_volterra fit", "mlp_digits train_step", "tiny x*y+1")


# -- worker side (runs in the fresh subprocess) ----------------------------------------------
def _load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by path (as tests/test_examples.py does)."""
    mod_name = f"kiln_examples_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {EXAMPLES / f'{name}.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def tiny(x, y):
    return x * y + 1


def _worker(case: str) -> None:
    import jax
    import jax.numpy as jnp

    import kiln

    if case == "lotka_volterra fit":
        lv = _load_example("lotka_volterra")
        ts, ys = lv.load_data()
        fit = lv.make_fit("kiln")

        def call() -> Any:
            return fit(ts, ys)
    elif case == "mlp_digits train_step":
        mlp = _load_example("mlp_digits")
        x_train, y_train, _, _ = mlp.load_data(0)
        optimizer, train_step, _ = mlp.make_functions("kiln")
        params = mlp.init_params(0)
        opt_state = jax.block_until_ready(optimizer.init(params))

        def call() -> Any:
            return train_step(params, opt_state, x_train, y_train)
    elif case == "tiny x*y+1":
        fn = kiln.jit(tiny)
        x = jnp.arange(8, dtype=jnp.float32)
        y = jnp.full((8,), 2.0, dtype=jnp.float32)

        def call() -> Any:
            return fn(x, y)
    else:
        raise SystemExit(f"error: unknown case {case!r}")

    kiln.reset_stats()
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first_call = time.perf_counter() - t0
    out = kiln.stats().as_dict()
    out["first_call_s"] = first_call
    out["backend"] = jax.default_backend()
    out["device"] = jax.devices()[0].device_kind
    print(json.dumps(out), flush=True)


# -- driver side -------------------------------------------------------------------------------
def run_worker(case: str, store: str) -> dict[str, Any]:
    run = bench.fresh([Path(__file__).resolve(), "--worker", case],
                      env=bench.child_env(**bench.kiln_store(store)), cwd=REPO)
    return {**run.record(), "process_wall_s": run.wall_s}


def entries_size(store: Path) -> tuple[int, int]:
    """(total bytes, number of files) under ``store/entries``."""
    files = [p for p in (store / "entries").rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def measure(case: str, rep: int, notes: list[str]) -> dict[str, Any]:
    """A cold process on an empty store, then a warm one on that store."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        cold = run_worker(case, tmp)
        size, nfiles = entries_size(Path(tmp))
        warm = run_worker(case, tmp)
    if cold["compiles"] < 1 or cold["hits"] != 0:
        notes.append(f"{case} rep {rep}: cold process compiles={cold['compiles']} "
                     f"hits={cold['hits']}")
    if warm["compiles"] != 0 or warm["hits"] < 1:
        notes.append(f"{case} rep {rep}: warm process compiles={warm['compiles']} "
                     f"hits={warm['hits']} (not a pure load)")
    return {
        "compile_s": cold["compile_seconds"], "load_s": warm["load_seconds"],
        "cold_first_call_s": cold["first_call_s"], "warm_first_call_s": warm["first_call_s"],
        "cold_process_s": cold["process_wall_s"], "warm_process_s": warm["process_wall_s"],
        "entry_bytes": size, "entry_files": nfiles, "cold_compiles": cold["compiles"],
        "warm_hits": warm["hits"], "warm_compiles": warm["compiles"],
        "device": f"{cold['backend']} ({cold['device']})",
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=1)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        metavar="CASE", help=f"subset of: {', '.join(repr(c) for c in CASES)}")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    if "--worker" in (sys.argv[1:] if argv is None else argv):
        _worker(parser.parse_args(argv).worker)
        return 0
    args = bench.begin(parser, argv)
    print(f"median of {args.reps} repetitions; each: a cold process on an empty store, then a "
          "warm process on that store\n", flush=True)

    notes: list[str] = []
    raw = bench.interleave(args.cases, args.reps, lambda c, i: measure(c, i, notes),
                           rotate=False, label=lambda c: f"{c:<24}",
                           show=lambda r: f"compile {r['compile_s']:.3f} s, load "
                                          f"{r['load_s']:.4f} s, entry {r['entry_bytes']} B")
    device = next(iter(raw.values()))[-1]["device"]
    print(f"device: {device}\n")
    summary: dict[str, dict[str, float]] = {}
    for case, rows in raw.items():
        med = {k: bench.median(r[k] for r in rows) for k in rows[0] if k != "device"}
        med["load_over_compile"] = med["load_s"] / med["compile_s"]
        med["warm_over_cold_first_call"] = med["warm_first_call_s"] / med["cold_first_call_s"]
        summary[case] = med
    print(bench.table(
        ["case", "compile s", "load s", "load/compile", "entry bytes", "files", "1st call cold",
         "1st call warm", "warm/cold"],
        [[case, m["compile_s"], f"{m['load_s']:.4f}", f"{m['load_over_compile']:.3f}x",
          int(m["entry_bytes"]), int(m["entry_files"]), f"{m['cold_first_call_s']:.3f} s",
          f"{m['warm_first_call_s']:.3f} s", f"{m['warm_over_cold_first_call']:.3f}x"]
         for case, m in summary.items()]))
    print()
    print("compile s = kiln.stats().compile_seconds in the cold process (trace + lower + compile);"
          " load s = kiln.stats().load_seconds in the warm process (deserialize only);"
          " 1st call = wall time of the first call to its result.")
    for note in notes:
        print(f"note: {note}")
    bench.save(args, {"device": device, "summary": summary, "runs": raw, "notes": notes})
    return 0 if not notes else 1


if __name__ == "__main__":
    sys.exit(main())
