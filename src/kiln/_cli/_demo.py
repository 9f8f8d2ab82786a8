"""``kiln demo``: the Lotka-Volterra fit shipped with kiln, timed in fresh processes: kiln cold
and warm, plain ``jax.jit``, and ``jax.jit`` with JAX's persistent cache, in interleaved rounds
after an untimed warm-up process; each row's median (min-max) over the rounds."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import Failure
from ._render import show

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["register"]

#: What the demo program imports beyond kiln's own dependencies (the ``examples`` extra).
_DEMO_NEEDS = ("equinox", "diffrax", "optimistix")

#: Rounds by default: one round (seven fresh processes) takes about 30 s on 2 CPU cores, so the
#: demo with its warm-up takes 100-110 s there.
DEFAULT_ROUNDS = 3

# the rows, in the table's order: (label, jit mode, caches). Every round runs each row once,
# in a fresh process: "kiln" on a new empty store (the cold row fills it, the warm row reads
# it), "plain" with no cache, "jaxcache" with JAX's persistent cache in a new empty directory,
# "run": the unchanged jax.jit program under ``kiln run`` (every jax.jit a kiln.jit, its
# default) on a new empty store of its own.
_PLAN = (
    ("kiln, cold (empty store)", "kiln", "kiln"),
    ("kiln, warm", "kiln", "kiln"),
    ("jax.jit", "jax", "plain"),
    ("jax.jit + JAX persistent cache, cold", "jax", "jaxcache"),
    ("jax.jit + JAX persistent cache, warm", "jax", "jaxcache"),
    ("kiln run (jax.jit code unchanged), cold", "run", "run"),
    ("kiln run (jax.jit code unchanged), warm", "run", "run"),
)
# the rows a round runs back to back (a warm row right after the cold row that filled its
# cache); round r starts at group r mod 4, so no row always runs first or after the same row
_GROUPS = ((0, 1), (2,), (3, 4), (5, 6))
_BASELINE = 2  # the row every other is compared with: plain jax.jit


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``kiln`` parser's ``verbs``."""
    demo = verbs.add_parser(
        "demo", parents=common,
        help="time the Lotka-Volterra fit: kiln cold / warm vs jax.jit, each a fresh process",
        description="Run the Lotka-Volterra fit shipped with kiln (kiln_demo/lotka_volterra.py; "
        "needs the examples extra) in fresh processes: kiln with an empty store, kiln warm, "
        "plain jax.jit, jax.jit with JAX's persistent cache, cold and warm, and the unchanged "
        "jax.jit program under kiln run, cold and warm. After one "
        "untimed warm-up process, N rounds run every row once each (interleaved; new empty "
        "caches every round); print each row's time to first result (median and min-max over "
        "the rounds, and the ratio to plain jax.jit) and check that all fitted the same "
        "parameters.",
    )
    demo.add_argument("--runs", type=int, default=DEFAULT_ROUNDS, metavar="N",
                      help="rounds: run every row N times, interleaved, and report each row's "
                      f"median and min-max (default {DEFAULT_ROUNDS})")
    demo.add_argument("--script", metavar="PATH",
                      help="the program to run (default: kiln_demo/lotka_volterra.py)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise Failure(f"--runs must be >= 1, got {args.runs}", code=2)
    script = Path(args.script) if args.script else _default_demo_script()
    if not script.is_file():
        raise Failure(
            f"demo script not found: {script}; "
            + ("pass the path of an existing script" if args.script
               else "the kiln_demo package is incomplete: reinstall kiln, or pass --script PATH")
        )
    times, params = _time_rounds(script, args.runs)
    rows = _rows(times)
    reference = params[0][1]
    differing = {label for label, p in params if p != reference}
    report = _Timed(script, rows, args.runs, reference,
                    differing=[label for label, _, _ in _PLAN if label in differing])
    show(report, as_json=args.json)
    if report.differing:
        raise Failure("fitted parameters differ between rows: " + ", ".join(report.differing))
    return 0


def _default_demo_script() -> Path:
    """The demo program shipped with kiln, ``kiln_demo/lotka_volterra.py``: located, never
    imported here (``kiln demo`` runs it as a script in fresh processes)."""
    import importlib.util

    spec = importlib.util.find_spec("kiln_demo")
    if spec is None or not spec.submodule_search_locations:
        raise Failure("the demo program is not installed (package kiln_demo, part of kiln); "
                      "reinstall kiln, or pass --script PATH")
    missing = [m for m in _DEMO_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise Failure(f"the demo needs {', '.join(missing)}, not installed; install kiln's "
                      "examples extra: pip install 'jax-kiln[examples]'")
    return Path(next(iter(spec.submodule_search_locations))) / "lotka_volterra.py"


def _progress(text: str, end: str = "\n") -> None:
    print(text, end=end, file=sys.stderr, flush=True)


def _time_rounds(
    script: Path, rounds: int
) -> tuple[list[list[dict[str, Any]]], list[tuple[str, Any]]]:
    """One untimed warm-up process (``--jit kiln`` on a store of its own: imports, the page
    cache, kiln's bytecode), then ``rounds`` rounds of every row of :data:`_PLAN`, each run a
    fresh process, with progress on stderr. Returns every row's results (in round order) and
    ``(label, fitted parameters)`` of every timed run, in the order they ran."""
    times: list[list[dict[str, Any]]] = [[] for _ in _PLAN]
    params: list[tuple[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-demo-", ignore_cleanup_errors=True) as tmp:
        _progress("kiln demo: warm-up (untimed: imports, disk cache) ...", end="")
        _run_example(script, "kiln", _demo_env(KILN_CACHE_DIR=os.path.join(tmp, "warm-up")))
        _progress(" done")
        for r in range(rounds):
            store = os.path.join(tmp, f"store-{r}")
            run_store = os.path.join(tmp, f"run-store-{r}")
            jax_cache = os.path.join(tmp, f"jax-cache-{r}")
            envs = {
                "kiln": _demo_env(KILN_CACHE_DIR=store),
                "run": _demo_env(KILN_CACHE_DIR=run_store, KILN_PROGRESS="0"),
                "plain": _demo_env(),
                "jaxcache": _demo_env(
                    JAX_ENABLE_COMPILATION_CACHE="true",
                    JAX_COMPILATION_CACHE_DIR=jax_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
                ),
            }
            start = r % len(_GROUPS)
            for group in _GROUPS[start:] + _GROUPS[:start]:
                for i in group:
                    label, jit, caches = _PLAN[i]
                    _progress(f"kiln demo: round {r + 1}/{rounds}: {label} ...", end="")
                    res = _run_example(script, jit, envs[caches])
                    _progress(f" {float(res['time_to_first_result_s']):.2f} s to first result")
                    times[i].append(res)
                    params.append((label, res.get("params")))
            for d in (store, run_store, jax_cache):
                shutil.rmtree(d, ignore_errors=True)
    return times, params


def _rows(times: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per :data:`_PLAN` entry from its runs: median and min-max of the time to first
    result, median process wall time, and the ratio of its median to plain ``jax.jit``'s: of
    the process wall time for the ``kiln run`` rows (``ratio_of``), whose time to first result
    leaves out ``import jax``, which ``kiln run`` does before the script starts."""
    rows: list[dict[str, Any]] = []
    for (label, jit, _), results in zip(_PLAN, times, strict=True):
        ttfr = [float(r["time_to_first_result_s"]) for r in results]
        rows.append({
            "mode": label,
            "jit": jit,
            "runs": len(results),
            "time_to_first_result_s": statistics.median(ttfr),
            "min_s": min(ttfr),
            "max_s": max(ttfr),
            "times_s": ttfr,
            "process_wall_s": statistics.median(r["process_wall_s"] for r in results),
            "params": results[0].get("params"),
            "loss": results[0].get("loss"),
        })
    for row in rows:
        of = "process_wall_s" if row["jit"] == "run" else "time_to_first_result_s"
        base, t = rows[_BASELINE][of], row[of]
        row["ratio_of"] = of
        row["ratio_to_jax_jit"] = t / base if base > 0 else None
        row["speedup_vs_jax_jit"] = base / t if t > 0 else None
    return rows


def _run_example(script: Path, jit: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script --jit JIT`` in a fresh process (``run``: ``kiln run script --jit jax``);
    its last stdout line is one JSON object."""
    argv = ([sys.executable, "-m", "kiln", "run", str(script), "--jit", "jax"] if jit == "run"
            else [sys.executable, str(script), "--jit", jit])
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv,
        env=env, capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result: Any = None
    if proc.returncode == 0 and lines:
        with contextlib.suppress(ValueError):
            result = json.loads(lines[-1])
    if not isinstance(result, dict) or "time_to_first_result_s" not in result:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        what = f"exited with status {proc.returncode}" if proc.returncode else (
            "did not print a JSON line with time_to_first_result_s last")
        raise Failure(f"{script} --jit {jit} {what}" + (f":\n{tail}" if tail else ""))
    result["process_wall_s"] = wall
    return result


def _demo_env(**set_vars: str) -> dict[str, str]:
    env = dict(os.environ)
    # Each row controls its own caches: no inherited kiln store, no inherited JAX cache.
    for var in ("KILN_STORE", "KILN_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(var, None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.update(set_vars)
    return env


def _params_text(params: Any) -> str:
    if not isinstance(params, dict):
        return str(params)
    return " / ".join(f"{params[k]:.6g}" if isinstance(params[k], float) else str(params[k])
                      for k in sorted(params))


@dataclasses.dataclass(frozen=True)
class _Timed:
    """``kiln demo``: the rows timed over ``runs`` rounds, and the rows whose fitted
    parameters differ from the first run's (``reference``)."""

    script: Path
    rows: list[dict[str, Any]]
    runs: int
    reference: Any
    differing: list[str]

    def as_json(self) -> dict[str, Any]:
        return {"script": str(self.script), "rounds": self.runs, "warm_up_runs": 1,
                "rows": self.rows, "identical_params": not self.differing}

    def as_text(self) -> Iterator[str | Table]:
        yield self._table()
        if not self.differing:
            yield f"fitted parameters identical in every row: {_params_text(self.reference)}"
        else:
            yield f"fitted parameters DIFFER from the first row in: {', '.join(self.differing)}"

    def _table(self) -> Table:
        from rich.table import Table

        table = Table(
            title="Lotka-Volterra fit: time to first result of a fresh process, "
            + (f"median of {self.runs} interleaved rounds" if self.runs > 1
               else "one round (one sample per row: noisy)"),
            caption="after one untimed warm-up process; each round runs every row once, on new "
            "empty caches; wall: the whole process (median); vs jax.jit: this row's median / "
            "plain jax.jit's (kiln run rows: of the wall, since kiln run imports jax before the "
            "script starts its clock)",
        )
        table.add_column("mode", no_wrap=True)
        table.add_column("median (s)", justify="right")
        table.add_column("min-max (s)", justify="right", no_wrap=True)
        table.add_column("wall (s)", justify="right")
        table.add_column("vs jax.jit", justify="right")
        table.add_column("params a / b / c / d", no_wrap=True)
        table.add_column("loss", justify="right")
        for r in self.rows:
            ratio = r["ratio_to_jax_jit"]
            table.add_row(
                r["mode"],
                f"{r['time_to_first_result_s']:.2f}",
                f"{r['min_s']:.2f}-{r['max_s']:.2f}",
                f"{r['process_wall_s']:.2f}",
                "-" if ratio is None else f"{ratio:.2f}x" + (
                    " (wall)" if r["ratio_of"] == "process_wall_s" else ""),
                _params_text(r["params"]),
                f"{r['loss']:.6g}" if isinstance(r["loss"], float) else str(r["loss"]),
            )
        return table
