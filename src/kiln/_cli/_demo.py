"""``kiln demo``: the Lotka-Volterra fit shipped with kiln, timed in fresh processes: kiln cold
and warm, plain ``jax.jit``, and ``jax.jit`` with JAX's persistent cache."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
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

# the rows: (label, jit mode, environment, repeated with --runs?)
_PLAN = (
    ("kiln, cold (empty store)", "kiln", "kiln", False),
    ("kiln, warm", "kiln", "kiln", True),
    ("jax.jit", "jax", "plain", False),
    ("jax.jit + JAX persistent cache, cold", "jax", "jaxcache", False),
    ("jax.jit + JAX persistent cache, warm", "jax", "jaxcache", True),
)


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``kiln`` parser's ``verbs``."""
    demo = verbs.add_parser(
        "demo", parents=common,
        help="time the Lotka-Volterra fit: kiln cold / warm vs jax.jit, each a fresh process",
        description="Run the Lotka-Volterra fit shipped with kiln (kiln_demo/lotka_volterra.py; "
        "needs the examples extra) in fresh processes: kiln with an empty "
        "store, kiln warm, plain jax.jit, and jax.jit with JAX's persistent cache; print the "
        "time to first result of each and check that all fitted the same parameters.",
    )
    demo.add_argument("--runs", type=int, default=1, metavar="N",
                      help="repeat the warm rows N times and report the median (default 1)")
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
    rows, params = _time_rows(script, args.runs)
    base = next(r for r in rows if r["mode"] == "jax.jit")["time_to_first_result_s"]
    for r in rows:
        t = r["time_to_first_result_s"]
        r["speedup_vs_jax_jit"] = base / t if t > 0 else None
    reference = params[0][1]
    report = _Timed(script, rows, args.runs, reference,
                    differing=sorted({label for label, p in params if p != reference}))
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


def _time_rows(script: Path, runs: int) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """Run each row of :data:`_PLAN` (the repeated ones ``runs`` times, their median kept),
    each in a fresh process, with progress on stderr; the rows, and ``(label, fitted
    parameters)`` of every run."""
    rows: list[dict[str, Any]] = []
    params: list[tuple[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kiln-demo-store-", ignore_cleanup_errors=True) as d1,
        tempfile.TemporaryDirectory(prefix="kiln-demo-jaxcache-", ignore_cleanup_errors=True) as d2,
    ):
        envs = {
            "kiln": _demo_env(KILN_CACHE_DIR=d1),
            "plain": _demo_env(),
            "jaxcache": _demo_env(
                JAX_ENABLE_COMPILATION_CACHE="true",
                JAX_COMPILATION_CACHE_DIR=d2,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
            ),
        }
        for i, (label, jit, env_name, repeat) in enumerate(_PLAN, 1):
            n = runs if repeat else 1
            results = []
            for j in range(n):
                run_no = f" (run {j + 1}/{n})" if n > 1 else ""
                print(f"kiln demo: [{i}/{len(_PLAN)}] running {label}{run_no} ...",
                      end="", file=sys.stderr, flush=True)
                res = _run_example(script, jit, envs[env_name])
                print(f" {res['time_to_first_result_s']:.2f} s to first result", file=sys.stderr,
                      flush=True)
                results.append(res)
                params.append((label, res.get("params")))
            rows.append({
                "mode": label,
                "jit": jit,
                "runs": n,
                "time_to_first_result_s": statistics.median(
                    float(r["time_to_first_result_s"]) for r in results),
                "process_wall_s": statistics.median(r["process_wall_s"] for r in results),
                "params": results[0].get("params"),
                "loss": results[0].get("loss"),
            })
    return rows, params


def _run_example(script: Path, jit: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script --jit JIT`` in a fresh process; its last stdout line is one JSON object."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--jit", jit],
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
    """``kiln demo``: the rows timed, and the rows whose fitted parameters differ from the
    first row's (``reference``)."""

    script: Path
    rows: list[dict[str, Any]]
    runs: int
    reference: Any
    differing: list[str]

    def as_json(self) -> dict[str, Any]:
        return {"script": str(self.script), "rows": self.rows,
                "identical_params": not self.differing}

    def as_text(self) -> Iterator[str | Table]:
        yield self._table()
        if not self.differing:
            yield f"fitted parameters identical in every row: {_params_text(self.reference)}"
        else:
            yield f"fitted parameters DIFFER from the first row in: {', '.join(self.differing)}"

    def _table(self) -> Table:
        from rich.table import Table

        title = "Lotka-Volterra fit, each row a fresh process"
        if self.runs > 1:
            title += f" (warm rows: median of {self.runs})"
        table = Table(
            title=title, caption="vs jax.jit: jax.jit's time to first result / this row's"
        )
        table.add_column("mode", no_wrap=True)
        table.add_column("first result (s)", justify="right")
        table.add_column("process wall (s)", justify="right")
        table.add_column("vs jax.jit", justify="right")
        table.add_column("params a / b / c / d", no_wrap=True)
        table.add_column("loss", justify="right")
        for r in self.rows:
            speedup = r["speedup_vs_jax_jit"]
            table.add_row(
                r["mode"],
                f"{r['time_to_first_result_s']:.2f}",
                f"{r['process_wall_s']:.2f}",
                "-" if speedup is None else f"{speedup:.1f}x",
                _params_text(r["params"]),
                f"{r['loss']:.6g}" if isinstance(r["loss"], float) else str(r["loss"]),
            )
        return table
