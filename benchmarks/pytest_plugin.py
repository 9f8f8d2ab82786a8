"""Benchmark: a real public JAX test suite run twice with ``pytest --kiln`` (kiln's plugin:
JAX's persistent cache routed into kiln's store), against plain pytest and against pytest with
JAX's own persistent cache in a directory.

Run from the repository root (needs optax, whose wheel ships its tests; ``pip install
optax``):

    python benchmarks/pytest_plugin.py [--reps 5] [--tests FILE ...] [--modes MODE ...]
                                       [--json PATH]

The suite: test modules shipped inside the installed optax package (default: a selection from
``optax/_src``; ``--tests`` picks others), run by pytest from a temporary directory with
``-p no:cacheprovider -q``. Modes, each a fresh ``pytest`` process timed whole (wall seconds,
``perf_counter`` around ``subprocess.run``):

- ``plain``: no persistent cache (the anchor);
- ``jax cache run 1`` / ``run 2``: ``JAX_COMPILATION_CACHE_DIR`` in a fresh temporary
  directory, ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``,
  ``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1``: first run fills it, second reads it;
- ``kiln run 1`` / ``run 2``: ``pytest --kiln --kiln-no-jit`` (the route alone) on a fresh kiln
  store, then again;
- ``kiln-jit run 1`` / ``run 2``: ``pytest --kiln --kiln-jit`` (every ``jax.jit`` outside JAX
  a ``kiln.jit``; ``--kiln``'s default) on a fresh kiln store, then again. Target: run 2 <= 0.3x plain. Run 2 still
  pays JAX for what kiln.jit does not cover (eager operations, JAX's own jits such as
  ``jax.numpy``'s functions called outside any jit: traced, lowered, and loaded from JAX's
  cache); the plugin's summary gives JAX's lowering seconds, and the figure "run 2 less it"
  counts that apart.

``--modes`` runs a subset (``plain`` always; a run 2 brings its run 1).

Each repetition starts from empty caches; the modes of a repetition run in the order above
(run 2 needs run 1), so drift hits repetitions, not modes. Each figure is the median over the
repetitions; the pass / fail counts of every run must be equal (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from _children import child_env, run_child

DEFAULT_TESTS = ("transform_test.py", "combine_test.py", "update_test.py", "utils_test.py")
MODES = ("plain", "jax cache run 1", "jax cache run 2", "kiln run 1", "kiln run 2",
         "kiln-jit run 1", "kiln-jit run 2")


def _env(**extra: str) -> dict[str, str]:
    return child_env(JAX_PLATFORMS="cpu", KILN_PROGRESS="0", **extra)


def run_suite(files: list[str], env: dict[str, str], cwd: Path, kiln: bool,
              swap: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if kiln or swap:  # the swap is --kiln's default since issue 43: said either way
        cmd += ["--kiln", "--kiln-jit" if swap else "--kiln-no-jit"]
    t0 = time.perf_counter()
    proc = run_child(cmd, env=env, cwd=cwd, timeout=3600, check=False)
    wall = time.perf_counter() - t0
    tail = proc.stdout.strip().splitlines()[-3:]
    found = re.findall(r"(\d+) (passed|failed|skipped|error)", "\n".join(tail))
    counts = {k: int(n) for n, k in found}
    summary = "; ".join(ln for ln in proc.stdout.strip().splitlines()[-4:]
                        if ln.startswith("kiln:"))
    if proc.returncode not in (0, 1) or not counts:
        raise SystemExit(f"error: {shlex.join(cmd)} exited {proc.returncode}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, "counts": counts, "kiln_summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test files under the installed optax/_src (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        metavar="MODE", help="run only these modes (a run 2 brings its run 1; "
                        "'plain' is always run: the anchor); default: all of %(choices)s")
    args = parser.parse_args(argv)
    wanted = set(args.modes) | {"plain"}
    wanted |= {m.replace("run 2", "run 1") for m in wanted}
    modes = [m for m in MODES if m in wanted]
    import optax

    src = Path(optax.__file__).parent / "_src"
    files = [str(src / name) for name in args.tests]
    for f in files:
        if not Path(f).is_file():
            parser.error(f"no test file {f} in the installed optax")
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    print(f"$ {command}")
    vers = {d: metadata.version(d) for d in ("jax", "jaxlib", "optax", "jax-kiln", "pytest")}
    print(", ".join(f"{k} {v}" for k, v in vers.items()) + f"; {os.cpu_count()} CPUs")
    print(f"suite: optax {vers['optax']} {', '.join(args.tests)}; reps {args.reps}; modes "
          f"{', '.join(modes)}", flush=True)

    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="kiln-pytest-bench-") as tmp:
            tmpdir = Path(tmp)
            jcache, store = tmpdir / "jax-cache", tmpdir / "kiln-store"
            swap_store = tmpdir / "kiln-jit-store"
            for mode in modes:
                if mode == "plain":
                    r = run_suite(files, _env(), tmpdir, kiln=False)
                elif mode.startswith("jax cache"):
                    r = run_suite(files, _env(
                        JAX_COMPILATION_CACHE_DIR=str(jcache),
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1"), tmpdir, kiln=False)
                elif mode.startswith("kiln-jit"):
                    r = run_suite(files, _env(KILN_CACHE_DIR=str(swap_store)), tmpdir,
                                  kiln=True, swap=True)
                else:
                    r = run_suite(files, _env(KILN_CACHE_DIR=str(store)), tmpdir, kiln=True)
                samples[mode].append(r)
                print(f"  rep {rep + 1}/{args.reps} {mode:<16} {r['wall_s']:7.2f} s  "
                      f"{r['counts']}  {r['kiln_summary']}", flush=True)

    med = {m: statistics.median(s["wall_s"] for s in samples[m]) for m in modes}
    print()
    print(f"{'mode':<18}{'median s':>10}{'(min-max)':>20}{'/ plain':>9}")
    for m in modes:
        walls = [s["wall_s"] for s in samples[m]]
        print(f"{m:<18}{med[m]:>10.2f}{f'{min(walls):.2f}-{max(walls):.2f}':>20}"
              f"{med[m] / med['plain']:>8.3f}x")
    print()
    if "kiln run 2" in med and "jax cache run 2" in med:
        print(f"kiln run 2 / jax cache run 2: {med['kiln run 2'] / med['jax cache run 2']:.3f}x; "
              f"kiln run 2 / plain: {med['kiln run 2'] / med['plain']:.3f}x; "
              f"kiln run 1 / plain: {med['kiln run 1'] / med['plain']:.3f}x")
    if "kiln-jit run 2" in med:
        print(f"kiln-jit run 2 / plain: {med['kiln-jit run 2'] / med['plain']:.3f}x (target "
              f"0.3x); kiln-jit run 1 / plain: {med['kiln-jit run 1'] / med['plain']:.3f}x"
              + (f"; kiln-jit run 2 / kiln run 2: {med['kiln-jit run 2'] / med['kiln run 2']:.3f}x"
                 if "kiln run 2" in med else ""))
        # what run 2 still pays JAX for the programs kiln.jit does not cover (eager operations,
        # JAX's own jits): the lowering seconds of the plugin's summary (kiln >= this line)
        lows = [float(x) for s in samples["kiln-jit run 2"] for x in re.findall(
            r"JAX lowered \d+ programs itself in ([0-9.]+) s", s["kiln_summary"])]
        if lows:
            low = statistics.median(lows)
            print(f"kiln-jit run 2: JAX's own lowering (eager operations, JAX's jits) median "
                  f"{low:.2f} s; run 2 less it / plain: "
                  f"{(med['kiln-jit run 2'] - low) / med['plain']:.3f}x")
    counts = {json.dumps(s["counts"], sort_keys=True) for m in modes for s in samples[m]}
    print(f"pass/fail counts identical in every run: {len(counts) == 1} ({'; '.join(counts)})")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "pytest_plugin", "command": command, "versions": vers,
            "tests": args.tests, "reps": args.reps, "modes": modes, "samples": samples,
            "median_wall_s": med,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
