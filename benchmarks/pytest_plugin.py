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
  a ``kiln.jit``; ``--kiln``'s default) on a fresh kiln store, then again. Target: run 2 <=
  0.3x plain. Run 2 still pays JAX for what kiln.jit does not cover (eager operations, JAX's
  own jits such as ``jax.numpy``'s functions called outside any jit: traced, lowered, and
  loaded from JAX's cache); the plugin's summary gives JAX's lowering seconds, and the figure
  "run 2 less it" counts that apart.

``--modes`` runs a subset (``plain`` always; a run 2 brings its run 1).

Each repetition starts from empty caches; the modes of a repetition run in the order above
(run 2 needs run 1), so drift hits repetitions, not modes. Each figure is the median over the
repetitions; the pass / fail counts of every run must be equal (printed).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

DEFAULT_TESTS = ("transform_test.py", "combine_test.py", "update_test.py", "utils_test.py")
MODES = ("plain", "jax cache run 1", "jax cache run 2", "kiln run 1", "kiln run 2",
         "kiln-jit run 1", "kiln-jit run 2")


def run_suite(files: list[str], env: dict[str, str], cwd: Path, kiln: bool,
              swap: bool = False) -> dict[str, Any]:
    cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if kiln or swap:  # the swap is --kiln's default since issue 43: said either way
        cmd += ["--kiln", "--kiln-jit" if swap else "--kiln-no-jit"]
    proc = bench.fresh(cmd, env=env, cwd=cwd, timeout=3600, check=False)
    tail = proc.stdout.strip().splitlines()[-3:]
    found = re.findall(r"(\d+) (passed|failed|skipped|error)", "\n".join(tail))
    counts = {k: int(n) for n, k in found}
    summary = "; ".join(ln for ln in proc.stdout.strip().splitlines()[-4:]
                        if ln.startswith("kiln:"))
    if proc.returncode not in (0, 1) or not counts:
        raise SystemExit(f"error: {shlex.join([sys.executable, *cmd])} exited "
                         f"{proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"wall_s": proc.wall_s, "counts": counts, "kiln_summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5)
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test files under the installed optax/_src (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        metavar="MODE", help="run only these modes (a run 2 brings its run 1; "
                        "'plain' is always run: the anchor); default: all of %(choices)s")
    args = bench.begin(parser, argv, dists=("jax", "jaxlib", "optax", "jax-kiln", "pytest"))
    wanted = set(args.modes) | {"plain"}
    wanted |= {m.replace("run 2", "run 1") for m in wanted}
    modes = [m for m in MODES if m in wanted]
    import optax

    src = Path(optax.__file__).parent / "_src"
    files = [str(src / name) for name in args.tests]
    for f in files:
        if not Path(f).is_file():
            parser.error(f"no test file {f} in the installed optax")
    print(f"suite: optax {args.versions['optax']} {', '.join(args.tests)}; reps {args.reps}; "
          f"modes {', '.join(modes)}", flush=True)

    def env(**extra: str) -> dict[str, str]:
        return bench.child_env(JAX_PLATFORMS="cpu", KILN_PROGRESS="0", **extra)

    with tempfile.TemporaryDirectory(prefix="kiln-pytest-bench-") as tmp:
        def run(mode: str, rep: int) -> dict[str, Any]:
            # each repetition from empty caches; run 2 after its run 1, in the order of MODES
            tmpdir = Path(tmp) / f"rep{rep}"
            tmpdir.mkdir(exist_ok=True)
            if mode == "plain":
                return run_suite(files, env(), tmpdir, kiln=False)
            if mode.startswith("jax cache"):
                return run_suite(files, env(**bench.jax_cache(tmpdir / "jax-cache")), tmpdir,
                                 kiln=False)
            if mode.startswith("kiln-jit"):
                return run_suite(files, env(KILN_CACHE_DIR=str(tmpdir / "kiln-jit-store")),
                                 tmpdir, kiln=True, swap=True)
            return run_suite(files, env(KILN_CACHE_DIR=str(tmpdir / "kiln-store")), tmpdir,
                             kiln=True)

        samples = bench.interleave(modes, args.reps, run, rotate=False, label=lambda m: f"{m:<16}",
                                   show=lambda r: f"{r['wall_s']:7.2f} s  {r['counts']}  "
                                                  f"{r['kiln_summary']}")

    walls = {m: bench.spread(s["wall_s"] for s in samples[m]) for m in modes}
    med = {m: w["median"] for m, w in walls.items()}
    over_plain = bench.ratios(med, "plain")
    print()
    print(bench.table(["mode", "median s", "(min-max)", "/ plain"],
                      [[m, f"{w['median']:.2f}", f"{w['min']:.2f}-{w['max']:.2f}",
                        f"{over_plain[m]:.3f}x"] for m, w in walls.items()]))
    print()
    if "kiln run 2" in med and "jax cache run 2" in med:
        print(f"kiln run 2 / jax cache run 2: {med['kiln run 2'] / med['jax cache run 2']:.3f}x; "
              f"kiln run 2 / plain: {over_plain['kiln run 2']:.3f}x; "
              f"kiln run 1 / plain: {over_plain['kiln run 1']:.3f}x")
    if "kiln-jit run 2" in med:
        print(f"kiln-jit run 2 / plain: {over_plain['kiln-jit run 2']:.3f}x (target "
              f"0.3x); kiln-jit run 1 / plain: {over_plain['kiln-jit run 1']:.3f}x"
              + (f"; kiln-jit run 2 / kiln run 2: {med['kiln-jit run 2'] / med['kiln run 2']:.3f}x"
                 if "kiln run 2" in med else ""))
        # what run 2 still pays JAX for the programs kiln.jit does not cover (eager operations,
        # JAX's own jits): the lowering seconds of the plugin's summary (kiln >= this line)
        lows = [float(x) for s in samples["kiln-jit run 2"] for x in re.findall(
            r"JAX lowered \d+ programs itself in ([0-9.]+) s", s["kiln_summary"])]
        if lows:
            low = bench.median(lows)
            print(f"kiln-jit run 2: JAX's own lowering (eager operations, JAX's jits) median "
                  f"{low:.2f} s; run 2 less it / plain: "
                  f"{(med['kiln-jit run 2'] - low) / med['plain']:.3f}x")
    counts = {json.dumps(s["counts"], sort_keys=True) for m in modes for s in samples[m]}
    print(f"pass/fail counts identical in every run: {len(counts) == 1} ({'; '.join(counts)})")
    bench.save(args, {"tests": args.tests, "modes": modes, "samples": samples,
                      "median_wall_s": med})
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
