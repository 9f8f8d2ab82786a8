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
variables of the calling environment are removed (``_children.py``), so the user's cache is
never touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from _children import child_env, run_child

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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case]
    t0 = time.perf_counter()
    proc = run_child(cmd, env=child_env(KILN_CACHE_DIR=store, KILN_PROGRESS="0"), cwd=REPO)
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    out = json.loads(lines[-1])
    out["process_wall_s"] = wall
    return out


def entries_size(store: Path) -> tuple[int, int]:
    """(total bytes, number of files) under ``store/entries``."""
    files = [p for p in (store / "entries").rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("jax", "jaxlib", "jax-kiln"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition (smoke test; noisy)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=CASES,
        default=list(CASES),
        metavar="CASE",
        help=f"subset of: {', '.join(repr(c) for c in CASES)}",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker)
        return 0
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    if reps < 1:
        parser.error("--reps must be >= 1")

    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    print(f"$ {command}")
    vers = versions()
    print(", ".join(f"{k} {v}" for k, v in vers.items()) + f"; {os.cpu_count()} CPUs")
    print(
        f"median of {reps} repetitions; each: a cold process on an empty store, then a warm "
        f"process on that store" + ("  [QUICK: 1 rep, figures are noisy]" if args.quick else "")
    )
    print(flush=True)

    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in args.cases}
    notes: list[str] = []
    device = "unknown"
    for i in range(reps):
        for case in args.cases:
            with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
                cold = run_worker(case, tmp)
                size, nfiles = entries_size(Path(tmp))
                warm = run_worker(case, tmp)
            device = f"{cold['backend']} ({cold['device']})"
            if cold["compiles"] < 1 or cold["hits"] != 0:
                notes.append(
                    f"{case} rep {i}: cold process compiles={cold['compiles']} hits={cold['hits']}"
                )
            if warm["compiles"] != 0 or warm["hits"] < 1:
                notes.append(
                    f"{case} rep {i}: warm process compiles={warm['compiles']} "
                    f"hits={warm['hits']} (not a pure load)"
                )
            row = {
                "compile_s": cold["compile_seconds"],
                "load_s": warm["load_seconds"],
                "cold_first_call_s": cold["first_call_s"],
                "warm_first_call_s": warm["first_call_s"],
                "cold_process_s": cold["process_wall_s"],
                "warm_process_s": warm["process_wall_s"],
                "entry_bytes": size,
                "entry_files": nfiles,
                "cold_compiles": cold["compiles"],
                "warm_hits": warm["hits"],
                "warm_compiles": warm["compiles"],
            }
            raw[case].append(row)
            print(
                f"  rep {i + 1}/{reps} {case:<24} compile {row['compile_s']:.3f} s, "
                f"load {row['load_s']:.4f} s, entry {size} B",
                flush=True,
            )
    print(f"device: {device}")
    print()

    summary: dict[str, dict[str, float]] = {}
    for case, rows in raw.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        med["load_over_compile"] = med["load_s"] / med["compile_s"]
        med["warm_over_cold_first_call"] = med["warm_first_call_s"] / med["cold_first_call_s"]
        summary[case] = med

    print(
        f"{'case':<24}{'compile s':>11}{'load s':>10}{'load/compile':>14}{'entry bytes':>13}"
        f"{'files':>7}{'1st call cold':>15}{'1st call warm':>15}{'warm/cold':>11}"
    )
    for case, m in summary.items():
        print(
            f"{case:<24}{m['compile_s']:>11.3f}{m['load_s']:>10.4f}"
            f"{m['load_over_compile']:>13.3f}x{int(m['entry_bytes']):>13}"
            f"{int(m['entry_files']):>7}{m['cold_first_call_s']:>13.3f} s"
            f"{m['warm_first_call_s']:>13.3f} s{m['warm_over_cold_first_call']:>10.3f}x"
        )
    print()
    print(
        "compile s = kiln.stats().compile_seconds in the cold process (trace + lower + compile);"
        " load s = kiln.stats().load_seconds in the warm process (deserialize only);"
        " 1st call = wall time of the first call to its result."
    )
    for note in notes:
        print(f"note: {note}")

    if args.json is not None:
        payload = {
            "benchmark": "entry_load",
            "command": command,
            "quick": args.quick,
            "versions": vers,
            "device": device,
            "cpus": os.cpu_count(),
            "reps": reps,
            "summary": summary,
            "runs": raw,
            "notes": notes,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if not notes else 1


if __name__ == "__main__":
    sys.exit(main())
