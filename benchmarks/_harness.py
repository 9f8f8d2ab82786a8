"""The one harness of the benchmarks: the processes they start, the rounds they run, the figures
they make of them, and the command line, table and JSON they share.

**Children.** A child starts from this process's environment less every ``KILN_*``, ``JAX_*`` and
``XLA_*`` variable: kiln's settings and store, JAX's platform, cache and flags, and XLA's flags
change what is measured, and a cache named there is the user's own. What a benchmark means its
children to have (a store or cache in a ``tempfile.TemporaryDirectory``, ``JAX_PLATFORMS=cpu``,
``XLA_FLAGS`` with a device count) it sets itself, through :func:`child_env` (:func:`kiln_store`
and :func:`jax_cache` spell the two usual settings). ``PYTHONPATH`` is kept (``PYTHONPATH=src``
runs a checkout's kiln in the children too). :func:`fresh` runs ``python ARGS`` in a fresh
process to its end and gives back its wall seconds, its CPU seconds and the last JSON line it
printed (its *payload*, :func:`last_json`). :func:`compile_bytecode` writes kiln's bytecode first,
as ``pip install`` does, so that no fresh process charges kiln for compiling its own source.

**Rounds.** :func:`interleave` runs every variant once per round, ``reps`` rounds, the order
rotating each round (round ``i`` starts at variant ``i % n``: two variants alternate), so drift in
the machine's load hits every variant alike; ``rotate=False`` keeps the order given, for
variants that need the one before them (a warm run after its cold run). :func:`clock` times
``number`` calls of a function in this process.

**Figures.** :func:`median`, :func:`spread` (median, min, max, p10, p90), :func:`medians` of
one field of records (None where a run gave no such figure), :func:`ratios` against a named
anchor, :func:`pair_ratios` of the runs of two variants round by round (the machine's drift
cancels within a pair).

**The front.** :func:`options` gives every script the same options (``--reps N``,
``--json PATH``, ``--quick`` where it has a smoke mode); :func:`begin` parses them, prints the
exact command line and the versions at the top of the output; :func:`table` lays out a table;
:func:`save` writes the figures as JSON with the command, the versions and the CPU count.

``tests/test_children.py`` fails on a benchmark that builds a child's environment or starts a
process on its own, or that does not take its options and write its JSON here;
``tests/children.py`` builds the tests' own rule for children on :func:`environment`, so this
module imports nothing outside the standard library. ``tests/test_bench_harness.py`` pins
the rest.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any, NamedTuple, TypeVar

V = TypeVar("V")
T = TypeVar("T")

SCRUB_PREFIXES = ("KILN_", "JAX_", "XLA_")


# -- children ------------------------------------------------------------------------------------
def environment(scrub: tuple[str, ...], settings: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment less the variables whose names start with one of ``scrub``,
    then ``settings`` (a setting of ``None`` leaves that variable out). The tests' harness
    (``tests/children.py``) builds its rule on this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(scrub)}
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def child_env(**settings: str | None) -> dict[str, str]:
    """A child's environment: this one's less ``SCRUB_PREFIXES``, then ``settings`` (a setting
    of ``None`` leaves that variable out)."""
    return environment(SCRUB_PREFIXES, settings)


def kiln_store(path: str | os.PathLike[str]) -> dict[str, str]:
    """The settings of a child using kiln's store at ``path`` (no progress lines)."""
    return {"KILN_CACHE_DIR": os.fspath(path), "KILN_PROGRESS": "0"}


def jax_cache(path: str | os.PathLike[str]) -> dict[str, str]:
    """The settings of a child using JAX's persistent cache in the directory ``path``, every
    compile kept (minimum compile time 0, any entry size), as JAX's docs suggest for a
    comparison."""
    return {"JAX_COMPILATION_CACHE_DIR": os.fspath(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _shown(argv: Sequence[str]) -> str:
    """``argv`` for an error message, a ``-c`` program of several lines by its first."""
    return shlex.join(a if "\n" not in a else a.lstrip().partition("\n")[0] + " ..."
                      for a in argv)


def run_child(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float = 900, check: bool = True,
              stdin: int | IO[Any] | None = None,
              stdout: int | IO[Any] | None = subprocess.PIPE,
              stderr: int | IO[Any] | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (``env``: a :func:`child_env`; by default ``child_env()``), its
    output kept as text unless ``stdout`` / ``stderr`` say otherwise. ``check``: a non-zero
    exit is ``SystemExit("error: <argv> exited <status>")`` with the tail of its stderr."""
    args = [os.fspath(a) for a in argv]
    proc = subprocess.run(args, env=child_env() if env is None else env, cwd=cwd, stdin=stdin,
                          stdout=stdout, stderr=stderr, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"error: {_shown(args)} exited {proc.returncode}\n"
                         f"{(proc.stderr or '')[-4000:]}")
    return proc


def start_child(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
                cwd: str | Path | None = None, stdin: int | IO[Any] | None = None,
                stdout: int | IO[Any] | None = subprocess.PIPE,
                stderr: int | IO[Any] | None = subprocess.PIPE) -> subprocess.Popen[str]:
    """Start ``argv`` (``env``: a :func:`child_env`; by default ``child_env()``); its output
    piped, as text, unless ``stdout`` / ``stderr`` say otherwise."""
    return subprocess.Popen([os.fspath(a) for a in argv],
                            env=child_env() if env is None else env, cwd=cwd, stdin=stdin,
                            stdout=stdout, stderr=stderr, text=True)


def last_json(text: str, marker: str = "") -> Any:
    """The last line of ``text`` that starts with ``marker`` and holds JSON after it, parsed
    (without a marker: the last line that is a JSON object or list); None when there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith(marker):
            continue
        rest = line[len(marker):].strip()
        if not marker and not rest.startswith(("{", "[")):
            continue
        try:
            return json.loads(rest)
        except ValueError:
            continue
    return None


class Fresh(NamedTuple):
    """A fresh process run to its end.

    ``wall_s``: seconds from its start to its exit as this process saw them (interpreter start
    and exit included); ``cpu_s``: its user + system seconds, the operating system's accounting
    of the finished child; ``payload``: its last JSON line (:func:`last_json`), or None.
    """

    wall_s: float
    cpu_s: float
    returncode: int
    stdout: str
    stderr: str
    payload: Any

    def record(self) -> dict[str, Any]:
        """The payload (a JSON object) with ``wall_s`` added."""
        if not isinstance(self.payload, dict):
            raise SystemExit(f"error: a child printed no JSON object\n{self.stdout[-2000:]}\n"
                             f"{self.stderr[-2000:]}")
        return {**self.payload, "wall_s": self.wall_s}


def fresh(args: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
          cwd: str | Path | None = None, timeout: float = 900, check: bool = True,
          marker: str = "", stdin: int | IO[Any] | None = None,
          stdout: int | IO[Any] | None = subprocess.PIPE) -> Fresh:
    """Run ``python ARGS`` (this interpreter) in a fresh process to its end, in ``env`` (a
    :func:`child_env`; by default ``child_env()``), and time it; its payload is its last JSON
    line starting with ``marker`` (:func:`last_json`). ``check``: as :func:`run_child`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = run_child([sys.executable, *args], env=env, cwd=cwd, timeout=timeout, check=check,
                     stdin=stdin, stdout=stdout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = proc.stdout or ""
    return Fresh(wall_s=wall, cpu_s=cpu, returncode=proc.returncode, stdout=out,
                 stderr=proc.stderr or "", payload=last_json(out, marker))


def compile_bytecode(folders: Iterable[str | os.PathLike[str]] | None = None) -> None:
    """Write the bytecode of ``kiln``, ``kiln_early`` (which every kiln process imports),
    ``kiln_cli`` and ``kiln_demo`` for this Python (or of the packages in ``folders``), as ``pip
    install`` would.

    An editable checkout gets its bytecode only when Python may write it, and
    ``PYTHONDONTWRITEBYTECODE=1`` (set on some machines) stops that: every fresh process then
    compiles kiln's changed modules from source again, ~0.05 s that no installed kiln pays, and
    that a cold-start figure would charge to kiln. Compiled here once, before the measured
    processes start.
    """
    if folders is None:
        found = []
        for name in ("kiln", "kiln_early", "kiln_cli", "kiln_demo"):
            spec = importlib.util.find_spec(name)
            found += (spec.submodule_search_locations or []) if spec else []
        folders = found
    for folder in folders:
        if not compileall.compile_dir(os.fspath(folder), quiet=1, workers=1):
            print(f"warning: could not compile the bytecode in {folder}", file=sys.stderr)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- rounds --------------------------------------------------------------------------------------
def rotation(variants: Sequence[V], round: int) -> list[V]:
    """The order of the variants in round ``round`` (from 0): starting at ``round % n``."""
    k = round % len(variants) if variants else 0
    return [*variants[k:], *variants[:k]]


def interleave(variants: Sequence[V], reps: int, run: Callable[[V, int], T], *,
               rotate: bool = True, show: Callable[[T], str | None] | None = None,
               label: Callable[[V], str] = str) -> dict[V, list[T]]:
    """``run(variant, round)`` for every variant in each of ``reps`` rounds; the results per
    variant, in round order. The order rotates each round (:func:`rotation`) unless ``rotate``
    is false. ``show``: a progress line per run (``  [round/reps] <label>: <show(result)>``)."""
    out: dict[V, list[T]] = {v: [] for v in variants}
    for i in range(reps):
        for v in rotation(variants, i) if rotate else variants:
            result = run(v, i)
            out[v].append(result)
            line = show(result) if show is not None else None
            if line is not None:
                print(f"  [{i + 1}/{reps}] {label(v)}: {line}", flush=True)
    return out


def clock(fn: Callable[[], Any], number: int = 1) -> float:
    """Seconds per call of ``number`` calls of ``fn`` in a row (``perf_counter``)."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


# -- figures -------------------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    """The median of ``values`` (``statistics.median``)."""
    return statistics.median(list(values))


def spread(values: Iterable[float]) -> dict[str, float]:
    """``median``, ``min``, ``max``, ``p10``, ``p90`` (deciles, within the values) and ``n``
    of ``values``."""
    vs = list(values)
    q = statistics.quantiles(vs, n=10, method="inclusive") if len(vs) >= 2 else [vs[0]] * 9
    return {"median": statistics.median(vs), "min": min(vs), "max": max(vs), "p10": q[0],
            "p90": q[-1], "n": len(vs)}


def medians(samples: Mapping[V, Sequence[Mapping[str, Any]]],
            field: str) -> dict[V, float | None]:
    """Per variant, the median of ``field`` over its records; None where a record has none
    (a figure the run did not give)."""
    out: dict[V, float | None] = {}
    for v, rs in samples.items():
        values = [r.get(field) for r in rs]
        out[v] = None if not values or None in values else statistics.median(values)
    return out


def ratios(values: Mapping[V, float | None], anchor: V) -> dict[V, float | None]:
    """Each value over the anchor's (None where either is None or the anchor is 0)."""
    base = values[anchor]
    return {v: None if x is None or not base else x / base for v, x in values.items()}


def pair_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]``: the runs of two variants taken in the same round."""
    return [x / y for x, y in zip(a, b, strict=True)]


# -- the front -----------------------------------------------------------------------------------
def options(doc: str | None, *, reps: int | None = 5, quick_reps: int | None = None,
            aliases: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--reps N`` (``reps`` by default; none when ``reps``
    is None; ``aliases``: other names of it), ``--json PATH``, and ``--quick`` (a smoke test:
    ``quick_reps`` repetitions) when ``quick_reps`` is given. The description is the first
    paragraph of ``doc``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if reps is not None:
        parser.add_argument("--reps", *aliases, dest="reps", type=int, default=None,
                            help=f"repetitions (default {reps}"
                            + (f"; {quick_reps} with --quick)" if quick_reps else ")"))
        parser.set_defaults(_reps=reps, _quick_reps=quick_reps)
    if quick_reps is not None:
        parser.add_argument("--quick", action="store_true",
                            help="smoke test: too few repetitions to quote")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser


def versions(dists: Iterable[str]) -> dict[str, str]:
    """Python's version and each distribution's (``not installed`` where it is not)."""
    out = {"python": sys.version.split()[0]}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def begin(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *,
          dists: Iterable[str] = ("jax", "jaxlib", "jax-kiln"),
          installed: bool = False) -> argparse.Namespace:
    """Parse ``argv``; print the exact command line (``$ ...``) and the versions of ``dists``
    with the CPU count; with ``installed``, compile kiln's bytecode as ``pip install`` does
    (:func:`compile_bytecode`). ``args.reps`` is resolved (``--quick`` gives the quick count)
    and must be >= 1; ``args.command``, ``args.versions`` and ``args.benchmark`` (the script's
    name) are set, for :func:`save`."""
    args = parser.parse_args(argv)
    if not hasattr(args, "quick"):
        args.quick = False
    if hasattr(args, "_reps"):
        if args.reps is None:
            args.reps = args._quick_reps if args.quick and args._quick_reps else args._reps
        if args.reps < 1:
            parser.error("--reps must be >= 1")
        del args._reps, args._quick_reps
    args.command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    args.benchmark = Path(sys.argv[0]).stem
    args.versions = versions(dists)
    print(f"$ {args.command}")
    print(", ".join(f"{k} {v}" for k, v in args.versions.items()) + f"; {os.cpu_count()} CPUs"
          + ("  [QUICK: too few repetitions, figures are noisy]" if args.quick else ""),
          flush=True)
    if installed:
        compile_bytecode()
    return args


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """``rows`` under ``header`` as aligned text: the first column to the left, the others to
    the right; floats with 3 decimals, None as ``-`` (format a cell as a string to say more)."""
    cells = [list(header), *([_cell(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=False))).rstrip()
                     for r in cells)


def save(args: argparse.Namespace, figures: Mapping[str, Any]) -> None:
    """Write ``figures`` as JSON to ``args.json`` (when given) with the benchmark's name, the
    command line, the versions, the CPU count and the repetitions first."""
    if args.json is None:
        return
    head = {"benchmark": args.benchmark, "command": args.command, "versions": args.versions,
            "cpus": os.cpu_count(), "quick": args.quick, "reps": getattr(args, "reps", None)}
    Path(args.json).write_text(json.dumps({**head, **figures}, indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
