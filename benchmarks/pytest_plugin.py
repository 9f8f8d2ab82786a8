"""Benchmark: a real public JAX test suite run twice with ``pytest --kiln`` (kiln's plugin:
JAX's persistent cache routed into kiln's store), against plain pytest and against pytest with
JAX's own persistent cache in a directory.

Run from the repository root (needs optax, whose wheel ships its tests; ``pip install
optax``):

    python benchmarks/pytest_plugin.py [--reps 5] [--tests FILE ...] [--modes MODE ...]
                                       [--split] [--json PATH]

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
  "run 2 less it" counts that apart;
- ``kiln-server run 1`` / ``run 2``: ``python -m kiln run --server --jit -m pytest`` (the
  same pytest arguments, without ``--kiln``: ``kiln run`` turns on the route and the swap
  itself, and ``--kiln-jit`` would imply ``--kiln``) on a fresh kiln store and a fresh folder
  of sockets (``KILN_SERVER_DIR``), from a working folder nothing writes to: run 1 is a plain
  ``kiln run`` that records pytest's imports and starts the warm process at its end; then,
  untimed, a wait until ``kiln server ls`` lists it (at most ``--server-wait`` seconds); run 2
  is forked from it (skipping the imports of pytest, jax, optax and the test modules it could
  preload); then ``kiln server stop``. Run 2 counts as served only where the server's count
  of runs went from 0 to 1; a repetition it did not serve is flagged ("NOT SERVED").
  Printed: run 2 / plain, run 2 / kiln-jit run 2, run 1 / kiln-jit run 1 (the server's cost
  to a first run).

``--modes`` runs a subset (``plain`` always; a run 2 brings its run 1).

``--split`` runs every mode but the server's under ``_pytest_split.py`` (a pytest plugin: the
seconds before the tests, JAX's trace and lowering seconds by its monitoring events, eager and
jit apart, and kiln's own seconds from ``kiln.stats()``) and prints where each mode's seconds go,
with its trace + lowering against plain pytest's (issue 45's target: <= 10% in run 2).

Each repetition starts from empty caches; the modes of a repetition run in the order above
(run 2 needs run 1), so drift hits repetitions, not modes. Each figure is the median over the
repetitions; the pass / fail counts of every run must be equal (printed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as bench
from real_programs import server_log, server_of, stop_servers, wait_for_server

HERE = Path(__file__).resolve().parent

DEFAULT_TESTS = ("transform_test.py", "combine_test.py", "update_test.py", "utils_test.py")
MODES = ("plain", "jax cache run 1", "jax cache run 2", "kiln run 1", "kiln run 2",
         "kiln-jit run 1", "kiln-jit run 2", "kiln-server run 1", "kiln-server run 2")
# how kiln server ls names the server of ``kiln run --server -m pytest``
SERVER_TARGET = "-m pytest"


def run_suite(files: list[str], env: dict[str, str], cwd: Path, kiln: bool,
              swap: bool = False, server: bool = False,
              split: Path | None = None) -> dict[str, Any]:
    cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if split is not None:  # where the seconds go (_pytest_split.py), at three points
        cmd[2:2] = ["-p", "_pytest_split"]
        env = {**env, "BENCH_SPLIT": str(split),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                           env.get("PYTHONPATH")]))}
    if server:  # kiln run does the plugin's set-up itself (the route; the swap: --jit)
        cmd = ["-m", "kiln", "run", "--server", "--jit", *cmd]
    elif kiln or swap:  # the swap is --kiln's default since issue 43: said either way
        cmd += ["--kiln", "--kiln-jit" if swap else "--kiln-no-jit"]
    if split is not None:
        env["BENCH_T0"] = repr(time.time())
    proc = bench.fresh(cmd, env=env, cwd=cwd, timeout=3600, check=False)
    tail = proc.stdout.strip().splitlines()[-3:]
    found = re.findall(r"(\d+) (passed|failed|skipped|error)", "\n".join(tail))
    counts = {k: int(n) for n, k in found}
    # the plugin's summary (stdout); kiln run's (stderr)
    summary = "; ".join([ln for ln in proc.stdout.strip().splitlines()[-4:]
                         if ln.startswith("kiln:")]
                        + [ln for ln in proc.stderr.strip().splitlines()[-4:]
                           if ln.startswith("kiln: hits:")])
    if proc.returncode not in (0, 1) or not counts:
        raise SystemExit(f"error: {shlex.join([sys.executable, *cmd])} exited "
                         f"{proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = {"wall_s": proc.wall_s, "counts": counts, "kiln_summary": summary}
    if split is not None:
        out["split"] = json.loads(split.read_text())
    return out


def split_row(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Where a mode's seconds went, medians over its repetitions: before the tests (Python,
    pytest, its plugins and the imports of collection), JAX's trace + lowering and kiln's own
    seconds (each over the whole run), and the rest (the tests' own work, XLA, exit)."""
    rows = []
    for s in samples:
        marks = s["split"]
        last = marks["finished"]
        jax = {k: last["jax"].get(k, {}).get("trace_s", 0.0) + last["jax"].get(k, {}).get(
            "lower_s", 0.0) for k in ("eager", "jit")}
        kiln = sum(last["kiln"].values())
        rows.append({"wall": s["wall_s"], "before_tests": marks["collected"]["t"],
                     "jax_eager": jax["eager"], "jax_jit": jax["jit"],
                     "jax": jax["eager"] + jax["jit"], "kiln": kiln,
                     "lowerings": sum(last["jax"].get(k, {}).get("lowerings", 0)
                                      for k in ("eager", "jit"))})
    return {k: bench.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=1)
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test files under the installed optax/_src (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        metavar="MODE", help="run only these modes (a run 2 brings its run 1; "
                        "'plain' is always run: the anchor); default: all of %(choices)s")
    parser.add_argument("--server-wait", type=float, default=60.0,
                        help="kiln-server: seconds to wait for the server after run 1 "
                        "(default: %(default)s)")
    parser.add_argument("--split", action="store_true",
                        help="run each non-server mode under _pytest_split.py and print where "
                        "its seconds go (before the tests, JAX's trace + lowering, kiln)")
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

    # kiln-server: each repetition's folder of sockets, short (AF_UNIX paths hold ~107 bytes)
    sockets: dict[int, str] = {}

    def server_run(mode: str, rep: int, tmpdir: Path) -> dict[str, Any]:
        where = tmpdir / "server"
        cwd = where / "cwd"  # nothing writes here (it is on the client's sys.path)
        if rep not in sockets:
            sockets[rep] = tempfile.mkdtemp(prefix="kbs", dir="/tmp" if os.path.isdir("/tmp")
                                            else None)
        senv = env(KILN_CACHE_DIR=str(where / "store"), KILN_SERVER_DIR=sockets[rep],
                   KILN_SERVER_IDLE="600")
        if mode.endswith("run 1"):
            cwd.mkdir(parents=True)
            out = run_suite(files, senv, cwd, kiln=False, server=True)
            if "kiln-server run 2" not in modes:
                stop_servers(senv, cwd)
            return out
        try:
            ready, waited = wait_for_server(SERVER_TARGET, senv, cwd, args.server_wait)
            out = run_suite(files, senv, cwd, kiln=False, server=True)
            after = server_of(SERVER_TARGET, senv, cwd)
        finally:
            stop_servers(senv, cwd)
        served = (ready is not None and after is not None
                  and after.get("pid") == ready.get("pid") and after.get("runs") == 1)
        why = None if served else (
            (f"no server listed after {waited:.1f} s" if ready is None else
             "the server was gone after the run" if after is None else
             f"the server counted {after.get('runs')} runs") + "; log: "
            + server_log(where / "store"))
        out |= {"ready_s": waited, "served": served, "not_served_why": why}
        out["kiln_summary"] += f"  [server ready after {waited:.2f} s; " + (
            "served]" if served else f"NOT SERVED: {why}]")
        return out

    with tempfile.TemporaryDirectory(prefix="kiln-pytest-bench-") as tmp:
        def run(mode: str, rep: int) -> dict[str, Any]:
            # each repetition from empty caches; run 2 after its run 1, in the order of MODES
            tmpdir = Path(tmp) / f"rep{rep}"
            tmpdir.mkdir(exist_ok=True)
            if mode.startswith("kiln-server"):
                return server_run(mode, rep, tmpdir)
            split = (tmpdir / f"split-{mode.replace(' ', '-')}.json") if args.split else None
            if mode == "plain":
                return run_suite(files, env(), tmpdir, kiln=False, split=split)
            if mode.startswith("jax cache"):
                return run_suite(files, env(**bench.jax_cache(tmpdir / "jax-cache")), tmpdir,
                                 kiln=False, split=split)
            if mode.startswith("kiln-jit"):
                return run_suite(files, env(KILN_CACHE_DIR=str(tmpdir / "kiln-jit-store")),
                                 tmpdir, kiln=True, swap=True, split=split)
            return run_suite(files, env(KILN_CACHE_DIR=str(tmpdir / "kiln-store")), tmpdir,
                             kiln=True, split=split)

        try:
            samples = bench.interleave(modes, args.reps, run, rotate=False,
                                       label=lambda m: f"{m:<17}",
                                       show=lambda r: f"{r['wall_s']:7.2f} s  {r['counts']}  "
                                                      f"{r['kiln_summary']}")
        finally:  # no server left behind, whatever happened
            for where in sockets.values():
                stop_servers(env(KILN_SERVER_DIR=where), Path(tmp))
                for name in os.listdir(where):
                    os.unlink(os.path.join(where, name))
                os.rmdir(where)

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
    splits = {m: split_row(samples[m]) for m in modes if all("split" in s for s in samples[m])}
    if splits:
        base = splits["plain"]["jax"] if "plain" in splits else None
        print()
        print("where the seconds go (medians; JAX's trace + lowering by its monitoring events; "
              "kiln's own by kiln.stats()):")
        print(bench.table(
            ["mode", "wall s", "before the tests s", "JAX trace+lower s (eager / jit)",
             "lowerings", "/ plain's trace+lower", "kiln s", "rest s"],
            [[m, f"{r['wall']:.2f}", f"{r['before_tests']:.2f}",
              f"{r['jax']:.2f} ({r['jax_eager']:.2f} / {r['jax_jit']:.2f})",
              f"{r['lowerings']:.0f}", f"{r['jax'] / base:.1%}" if base else "-",
              f"{r['kiln']:.2f}",
              f"{r['wall'] - r['before_tests'] - r['jax'] - r['kiln']:.2f}"]
             for m, r in splits.items()]))
    unserved: list[int] = []
    if "kiln-server run 2" in med:
        unserved = [i + 1 for i, s in enumerate(samples["kiln-server run 2"]) if not s["served"]]
        print(f"kiln-server run 2 / plain: {over_plain['kiln-server run 2']:.3f}x"
              + (f"; kiln-server run 2 / kiln-jit run 2: "
                 f"{med['kiln-server run 2'] / med['kiln-jit run 2']:.3f}x"
                 if "kiln-jit run 2" in med else "")
              + f"; server ready after "
              f"{bench.median(s['ready_s'] for s in samples['kiln-server run 2']):.2f} s; "
              + ("served in every repetition" if not unserved else
                 f"NOT SERVED in repetitions {unserved}: its figures do not hold"))
    if "kiln-server run 1" in med and "kiln-jit run 1" in med:
        ones = bench.pair_ratios([s["wall_s"] for s in samples["kiln-server run 1"]],
                                 [s["wall_s"] for s in samples["kiln-jit run 1"]])
        added = bench.median(a["wall_s"] - b["wall_s"] for a, b in zip(
            samples["kiln-server run 1"], samples["kiln-jit run 1"], strict=True))
        print(f"kiln-server run 1 / kiln-jit run 1 (the server's cost to a first run): "
              f"{bench.median(ones):.3f}x paired ({added:+.2f} s)")
    counts = {json.dumps(s["counts"], sort_keys=True) for m in modes for s in samples[m]}
    print(f"pass/fail counts identical in every run: {len(counts) == 1} ({'; '.join(counts)})")
    bench.save(args, {"tests": args.tests, "modes": modes, "samples": samples,
                      "median_wall_s": med, "server_unserved_repetitions": unserved,
                      "split": splits})
    return 1 if unserved else 0

if __name__ == "__main__":
    raise SystemExit(main())
