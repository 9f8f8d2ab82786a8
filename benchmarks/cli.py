"""Benchmark: how fast the ``kiln`` command line answers, whole processes.

Run from the repository root (about 1.5 minutes, most of it filling the store):

    python benchmarks/cli.py [--entries 1000] [--reps 5] [--json PATH]

A child process first fills a temporary store (``tempfile.TemporaryDirectory``, via
``KILN_CACHE_DIR``) with ``--entries`` real entries: a ``kiln.jit`` function called with that
many static values, plus the few JAX-cache values its eager operations write through the
kiln:// route. Then each command below runs ``--reps`` times, the commands taking turns (the
order rotates each round), and the figures are medians (min and max beside them) of each
process's wall seconds, start to exit, and CPU seconds (user + system, the operating system's
accounting of the finished child):

- ``kiln --version``, ``kiln --help``, ``kiln ls``, ``kiln ls --json``, ``kiln stats``: the
  ``kiln`` script as pip writes it for the entry point ``kiln = "kiln_cli:main"`` (run as
  ``python -c`` with the script's own lines, so a checkout that is not reinstalled measures its
  own entry point);
- ``python -m kiln ls``;
- anchors: ``python -c pass`` (the interpreter's floor), and ``kiln --version`` and ``kiln ls``
  through the entry point before it was split (``kiln = "kiln._cli:main"``), whose import runs
  ``kiln/__init__`` whole and so imports jax: what every verb paid then.

Each command also runs once under ``python -X importtime``, which says whether it imported jax.
``KILN_*``, ``JAX_*`` and ``XLA_*`` variables of the calling environment are removed
(``_children.py``), so the user's cache is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from _children import child_env, run_child
from _installed import compile_bytecode

_SCRIPT = ("import re, sys; from {} import main; "
           "sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0]); sys.exit(main())")
KILN_SCRIPT = ["-c", _SCRIPT.format("kiln_cli")]
# the entry point before it was split (kiln = "kiln._cli:main"): its import runs kiln/__init__ whole
OLD_SCRIPT = ["-c", _SCRIPT.format("kiln._cli")]
COMMANDS: dict[str, list[str]] = {
    "kiln --version": [*KILN_SCRIPT, "--version"],
    "kiln --help": [*KILN_SCRIPT, "--help"],
    "kiln ls": [*KILN_SCRIPT, "ls"],
    "kiln ls --json": [*KILN_SCRIPT, "ls", "--json"],
    "kiln stats": [*KILN_SCRIPT, "stats"],
    "python -m kiln ls": ["-m", "kiln", "ls"],
    "python -c pass": ["-c", "pass"],
    "old entry: kiln --version": [*OLD_SCRIPT, "--version"],
    "old entry: kiln ls": [*OLD_SCRIPT, "ls"],
}

FILL = '''\
import sys

import jax.numpy as jnp

import kiln

f = kiln.jit(lambda x, k: x * k + 1, static_argnums=1)
x = jnp.ones(8)
for k in range(int(sys.argv[1])):
    f(x, k).block_until_ready()
'''

_JAX_IMPORT = re.compile(r"^import time:[^|]*\|[^|]*\|\s*jax\s*$", re.MULTILINE)


def _env(store: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=store, JAX_PLATFORMS="cpu")


def _time(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one process running ``python *args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run_child([sys.executable, *args], env=env, stdin=subprocess.DEVNULL,
              stdout=subprocess.DEVNULL, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _imports_jax(args: list[str], env: dict[str, str]) -> bool:
    proc = run_child([sys.executable, "-X", "importtime", *args], env=env,
                     stdin=subprocess.DEVNULL, timeout=300, check=False)
    return _JAX_IMPORT.search(proc.stderr) is not None


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 entries, 2 reps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.entries, args.reps = 20, 2
    compile_bytecode()  # as an installed kiln: see benchmarks/_installed.py
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    print(f"$ {command}")
    vers = {d: metadata.version(d) for d in ("jax", "jaxlib", "jax-kiln")}
    print(", ".join(f"{k} {v}" for k, v in vers.items()) + f"; {os.cpu_count()} CPUs", flush=True)

    samples: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in COMMANDS}
    with tempfile.TemporaryDirectory(prefix="kiln-cli-bench-") as store:
        env = _env(store)
        start = time.perf_counter()
        run_child([sys.executable, "-c", FILL, str(args.entries)], env=env, stdout=None,
                  stderr=None, timeout=3600)
        rows = json.loads(run_child([sys.executable, "-m", "kiln", "ls", "--json"], env=env,
                                    timeout=300).stdout)
        print(f"store: {len(rows)} entries ({args.entries} kiln.jit, "
              f"{sum(r['function'].startswith('jax:') for r in rows)} JAX-cache), filled in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        jax = {name: _imports_jax(cmd, env) for name, cmd in COMMANDS.items()}
        names = list(COMMANDS)
        for warm_up in names:  # one unrecorded run each (page cache, bytecode)
            _time(COMMANDS[warm_up], env)
        for i in range(args.reps):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                wall, cpu = _time(COMMANDS[name], env)
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)

    result: dict[str, Any] = {"command": command, "versions": vers, "entries": len(rows),
                              "reps": args.reps, "commands": {}}
    print()
    print(f"{'command':<28} {'wall s (median, min-max)':>28} {'cpu s (median)':>15}  imports jax")
    for name in names:
        wall, cpu = _spread(samples[name]["wall"]), _spread(samples[name]["cpu"])
        result["commands"][name] = {"wall_s": wall, "cpu_s": cpu, "imports_jax": jax[name]}
        print(f"{name:<28} {wall['median']:>10.3f} ({wall['min']:.3f}-{wall['max']:.3f})"
              f"{'':>5} {cpu['median']:>15.3f}  {'yes' if jax[name] else 'no'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
