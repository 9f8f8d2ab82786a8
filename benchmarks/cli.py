"""Benchmark: how fast the ``kiln`` command line answers, whole processes.

Run from the repository root (about 1.5 minutes, most of it filling the store):

    python benchmarks/cli.py [--quick] [--entries 1000] [--reps 5] [--json PATH]

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
(``_harness.py``), so the user's cache is never touched.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import _harness as bench

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


def _time(args: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall and CPU seconds of one process running ``python *args``."""
    run = bench.fresh(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      timeout=300)
    return {"wall": run.wall_s, "cpu": run.cpu_s}


def _imports_jax(args: list[str], env: dict[str, str]) -> bool:
    proc = bench.run_child([sys.executable, "-X", "importtime", *args], env=env,
                           stdin=subprocess.DEVNULL, timeout=300, check=False)
    return _JAX_IMPORT.search(proc.stderr) is not None


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=2)
    parser.add_argument("--entries", type=int, default=None,
                        help="entries in the store (default 1000; 20 with --quick)")
    args = bench.begin(parser, argv, installed=True)
    entries = args.entries if args.entries is not None else (20 if args.quick else 1000)

    with tempfile.TemporaryDirectory(prefix="kiln-cli-bench-") as store:
        env = bench.child_env(KILN_CACHE_DIR=store, JAX_PLATFORMS="cpu")
        start = time.perf_counter()
        bench.run_child([sys.executable, "-c", FILL, str(entries)], env=env, stdout=None,
                        stderr=None, timeout=3600)
        rows = json.loads(bench.run_child([sys.executable, "-m", "kiln", "ls", "--json"],
                                          env=env, timeout=300).stdout)
        print(f"store: {len(rows)} entries ({entries} kiln.jit, "
              f"{sum(r['function'].startswith('jax:') for r in rows)} JAX-cache), filled in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        jax = {name: _imports_jax(cmd, env) for name, cmd in COMMANDS.items()}
        for warm_up in COMMANDS.values():  # one unrecorded run each (page cache, bytecode)
            _time(warm_up, env)
        samples = bench.interleave(list(COMMANDS), args.reps,
                                   lambda name, _: _time(COMMANDS[name], env))

    result: dict[str, Any] = {"entries": len(rows), "commands": {}}
    for name, runs in samples.items():
        wall, cpu = bench.spread(r["wall"] for r in runs), bench.spread(r["cpu"] for r in runs)
        result["commands"][name] = {"wall_s": wall, "cpu_s": cpu, "imports_jax": jax[name]}
    print()
    print(bench.table(["command", "wall s (median)", "(min-max)", "cpu s (median)",
                       "imports jax"],
                      [[name, c["wall_s"]["median"],
                        f"{c['wall_s']['min']:.3f}-{c['wall_s']['max']:.3f}",
                        c["cpu_s"]["median"], "yes" if c["imports_jax"] else "no"]
                       for name, c in result["commands"].items()]))
    bench.save(args, result)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
