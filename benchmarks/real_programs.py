"""Benchmark: real programs, whole processes, kiln warm vs JAX's persistent cache warm.

Run from the repository root (about 2 minutes per program and mode with ``--reps 5``):

    python benchmarks/real_programs.py [--reps 5] [--programs lotka_volterra,flax_cnn,...]
                                       [--modes kiln,jax,run,run-jit,run-server]
                                       [--anchor MODE] [--no-events] [--json PATH] [--quick]

Each program is run as a fresh process in up to five modes (``--modes``; by default every mode
but ``run-server`` that applies to the program), each once cold (its own empty store or cache),
then warm:

- ``kiln`` (``kiln cold`` / ``kiln warm``): the program's own kiln variant (``--jit kiln``,
  ``EXAMPLE_JIT=kiln``: ``kiln.jit`` in its code); the programs of ``examples/libraries/``,
  whose jits live in the libraries, have none;
- ``jax`` (``jax cold`` / ``jax cache warm``): plain ``jax.jit`` / ``eqx.filter_jit`` with JAX's
  persistent cache in a directory (minimum compile time 0, any entry size, as JAX's docs
  suggest for this comparison);
- ``run`` (``kiln run cold`` / ``kiln run warm``): the plain program under ``python -m kiln
  run --no-jit``: JAX's cache routed into kiln's store alone (trace and lower every run, skip
  the compile);
- ``run-jit`` (``kiln run --jit cold`` / ``kiln run --jit warm``): the plain program under
  ``python -m kiln run --jit`` (``kiln run``'s default since issue 43): every ``jax.jit``
  outside JAX itself a ``kiln.jit``;
- ``run-server`` (``kiln run --server cold`` / ``kiln run --server warm``): ``python -m kiln
  run --server --jit``, the warm process (``kiln_server``). Each of its rounds starts anew: a
  fresh store and a fresh folder of sockets (``KILN_SERVER_DIR``), a plain ``kiln run --jit``
  cold on a store of its own (``kiln run --jit cold (paired)``: the anchor of the server's
  cost to a first run), then the first ``kiln run --server`` (a plain run that records the
  program's imports and starts the server at its end), a wait until ``kiln server ls`` lists
  the server (untimed; at most ``--server-wait`` seconds), the warm client process (timed), and
  ``kiln server stop`` (in that order: the server imports in the background after the first
  ``--server`` run, so nothing timed runs beside it). The warm run counts as served only
  where the server's count of runs went from 0 to 1 (``kiln server ls --json``); a round it
  did not serve is flagged ("NOT SERVED", ``unserved_rounds`` in the JSON, exit status 1),
  with the end of the server's log.
  These runs never go under the listener (it would import jax in the client, before the
  hand-over, and hear nothing of the child): compare with ``--no-events``. Printed: server warm
  over JAX's cache warm and over ``kiln run --jit`` warm (medians of the ratios of each round,
  and ratios of medians), and the first ``kiln run --server`` over the paired first plain
  ``kiln run --jit`` (ratio and seconds added).

Warm runs come in ``--reps`` rounds of every mode, interleaved (the order rotates each round).
Figures per run, in seconds: ``wall``, the whole process (interpreter start and exit
included); ``ttfr``, the program's own ``time_to_first_result_s`` (from the top of the script,
before its ``import jax``, to its first result; not every published example prints one);
``itfr``, its ``imports_to_first_result_s`` (from the end of its imports; the programs of
``examples/libraries/`` print it); and JAX's own trace and lowering seconds
(``_jax_events.py``: a listener on JAX's monitoring events, installed in every run without
changing the program), ``jit`` (the program's and its libraries' jits, kiln's traces of them)
apart from ``eager`` (operations outside any jit, and functions JAX jits itself called
outside any jit). The listener imports jax before the program starts (and ``kiln run``
imports jax and kiln before it), so ``ttfr`` leaves out the import of jax in every mode;
``wall`` is the figure that holds everything. Beside each program, the import floor: the
median wall of ``python -c "import jax, <its libraries>"`` (what no cache can save).
``--no-events`` runs the programs without the listener (no trace and lowering seconds; ``ttfr``
then holds the import of jax, as the program alone measures it). Ratios are to JAX's cache warm
(``--anchor``: to another warm run, e.g. ``"kiln run warm"``).

The results each run prints (its last JSON line, timings and kiln's counters left out) must be
identical in every mode and run; the script says so or fails. Targets, every
program: kiln warm wall <= 1.0x JAX's cache warm, time to first result <= 0.8x; the mode
(``kiln run --jit``) warm wall <= 1.0x JAX's cache warm, its jits' trace + lowering seconds
<= 25% of JAX's cache warm, and where tracing dominates, wall <= 0.55x. Stores and
caches live in temporary directories; ``KILN_*``, ``JAX_*`` and ``XLA_*`` variables of the
calling environment are removed (``_harness.py``), so your own cache is never touched.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "examples"
LIB = EX / "libraries"
EVENTS = Path(__file__).resolve().parent / "_jax_events.py"
# volatile fields of a program's result line: timings and kiln's counters
_VOLATILE = {"time_to_first_result_s", "first_step_s", "hits", "misses", "traces", "compiles",
             "kiln", "seconds", "elapsed_s", "wall_s", "steady_s", "jit", "mode",
             "imports_to_first_result_s"}

# name: (script, kiln argv / env (None: no kiln variant), plain argv / env, libraries its
# import floor imports)
PROGRAMS: dict[str, tuple[Path, tuple[list[str], dict[str, str]] | None,
                          tuple[list[str], dict[str, str]], str]] = {
    "lotka_volterra": (EX / "lotka_volterra.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                       "jax, diffrax, optimistix, equinox"),
    "mlp_digits": (EX / "mlp_digits.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                   "jax, optax, sklearn.datasets"),
    "flax_digits": (EX / "flax_digits.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                    "jax, flax.linen, flax.nnx, optax, sklearn.datasets"),
    "flax_cnn": (EX / "flax_cnn.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
                 "jax, flax.linen, flax.training.train_state, optax, sklearn.datasets"),
    "eqx_transformer": (EX / "eqx_transformer.py", (["--jit", "kiln"], {}),
                        (["--jit", "jax"], {}), "jax, equinox, optax"),
    "gp_fit": (EX / "gp_fit.py", (["--jit", "kiln"], {}), (["--jit", "jax"], {}),
               "jax, optimistix, sklearn.datasets"),
    **{f"public_{p}": (EX / "public" / f"{p}.py", ([], {"EXAMPLE_JIT": "kiln"}),
                       ([], {"EXAMPLE_JIT": "eqx"}), "jax, equinox, optax")
       for p in ("cnn", "neural_ode", "stateful", "train_rnn")},
    # unchanged programs whose jits live in libraries (kiln reaches them through kiln run --jit)
    "numpyro_logreg": (LIB / "numpyro_logreg.py", None, ([], {}),
                       "jax, numpyro, numpyro.infer, sklearn.datasets"),
    "blackjax_nuts": (LIB / "blackjax_nuts.py", None, ([], {}), "jax, blackjax, sklearn.datasets"),
    "haiku_digits": (LIB / "haiku_digits.py", None, ([], {}),
                     "jax, haiku, optax, sklearn.datasets"),
    # a library's object as static self of its jitted methods (issue 42)
    "gymnax_cartpole": (LIB / "gymnax_cartpole.py", None, ([], {}), "jax, gymnax"),
    # all eager work: jnp outside any jit (issue 45)
    "eager_prep": (EX / "eager_prep.py", None, ([], {}), "jax, sklearn.datasets"),
    "evosax_snes": (LIB / "evosax_snes.py", None, ([], {}), "jax, evosax.algorithms"),
    # (these two have a jit of the user's own: EXAMPLE_JIT=kiln makes it kiln.jit)
    "jaxmd_lj_melt": (LIB / "jaxmd_lj_melt.py", ([], {"EXAMPLE_JIT": "kiln"}), ([], {}),
                      "jax, jax_md"),
    "mjx_humanoid": (LIB / "mjx_humanoid.py", ([], {"EXAMPLE_JIT": "kiln"}), ([], {}),
                     "jax, mujoco, mujoco.mjx"),
    # public programs as published (issue 42): JAX's own example, optax's "Getting started",
    # purejaxrl's PPO, flax's NNX MNIST tutorial (nnx.jit steps taking an nnx.Optimizer)
    "jax_example_mnist_classifier_fromscratch": (
        LIB / "jax_example_mnist_classifier_fromscratch.py", None, ([], {}),
        "jax, jax.scipy.special, sklearn.datasets"),
    "optax_getting_started": (LIB / "optax_getting_started.py", None, ([], {}), "jax, optax"),
    "purejaxrl_ppo": (LIB / "purejaxrl_ppo.py", None, ([], {}),
                      "jax, flax.linen, flax.training.train_state, optax, distrax, gymnax"),
    "flax_nnx_mnist_tutorial": (LIB / "flax_nnx_mnist_tutorial.py", None, ([], {}),
                                "jax, flax.nnx, optax, sklearn.datasets"),
}

# mode: (its cold run's name, its warm runs' name)
MODES = {"kiln": ("kiln cold", "kiln warm"), "jax": ("jax cold", "jax cache warm"),
         "run": ("kiln run cold", "kiln run warm"),
         "run-jit": ("kiln run --jit cold", "kiln run --jit warm"),
         "run-server": ("kiln run --server cold", "kiln run --server warm")}
# the modes run by default (the server's rounds take a cold run more each: asked for by name)
DEFAULT_MODES = ("kiln", "jax", "run", "run-jit")
# the paired first plain kiln run of each of the server's rounds
SERVER_PLAIN_COLD = "kiln run --jit cold (paired)"


def _base_env() -> dict[str, str]:
    """A child's environment: ``EXAMPLE_JIT`` only where a program's variant sets it, and the
    published examples' folder on ``PYTHONPATH``."""
    return bench.child_env(EXAMPLE_JIT=None, PYTHONPATH=os.pathsep.join(
        [str(EX / "public"), os.environ.get("PYTHONPATH", "")]))


def _run(argv: list[str], env: dict[str, str], cwd: Path,
         events: Path | None = None) -> dict[str, Any]:
    """One fresh process of ``python ARGV``; with ``events``, under the listener on JAX's trace
    and lowering events (``_jax_events.py``), whose counts come back as ``events``."""
    proc = bench.fresh(argv if events is None else [EVENTS, events, *argv], env=env, cwd=cwd)
    return _record(proc, events)


def _record(proc: bench.Fresh, events: Path | None = None) -> dict[str, Any]:
    """The figures of one finished run (see :func:`_run`)."""
    got = proc.payload if isinstance(proc.payload, dict) else {}
    out = {"wall": proc.wall_s, "ttfr": got.get("time_to_first_result_s"),
           "itfr": got.get("imports_to_first_result_s"),
           "result": _stable(proc.payload if proc.payload is not None else {})}
    if events is not None:
        out["events"] = json.loads(events.read_text())
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("kiln: hits:")]
    if summary:
        out["kiln_summary"] = summary[-1]
    return out


def _stable(result: Any) -> Any:
    if isinstance(result, dict):
        return {k: _stable(v) for k, v in result.items() if k not in _VOLATILE}
    return result


def _floor(libs: str, env: dict[str, str], cwd: Path) -> float:
    return bench.median(bench.fresh(["-c", f"import {libs}"], env=env, cwd=cwd).wall_s
                        for _ in range(3))


def _seconds(counts: dict[str, float]) -> float:
    return counts["trace_s"] + counts["lower_s"]


# -- the warm process (kiln run --server) ---------------------------------------------------------
def _servers(env: dict[str, str], cwd: Path) -> list[dict[str, Any]]:
    """``kiln server ls --json`` in ``env`` (its ``KILN_SERVER_DIR``): the live servers."""
    proc = bench.run_child([sys.executable, "-m", "kiln", "server", "ls", "--json"], env=env,
                           cwd=cwd, timeout=60, check=False)
    try:
        got = json.loads(proc.stdout or "[]")
    except ValueError:
        return []
    return [s for s in got if isinstance(s, dict)] if isinstance(got, list) else []


def server_of(target: str | Path, env: dict[str, str], cwd: Path) -> dict[str, Any] | None:
    """The live server whose program is ``target`` (a script's path, or ``-m MODULE`` as
    ``kiln server ls`` names it), or None."""
    want = str(target)
    return next((s for s in _servers(env, cwd) if s.get("state", "serving") == "serving" and (
        str(s.get("target", "")) == want
        or os.path.realpath(str(s.get("target", ""))) == os.path.realpath(want))), None)


def wait_for_server(target: str | Path, env: dict[str, str], cwd: Path,
                    limit_s: float = 60.0) -> tuple[dict[str, Any] | None, float]:
    """Poll ``kiln server ls`` until the server of ``target`` is listed (it lists itself once
    it has imported everything and listens); that server (None after ``limit_s`` seconds) and
    the seconds waited."""
    start = time.perf_counter()
    while True:
        found = server_of(target, env, cwd)
        waited = time.perf_counter() - start
        if found is not None or waited >= limit_s:
            return found, waited
        time.sleep(0.25)


def _held(sockets: str | Path) -> list[Path]:
    """The lock files of ``sockets`` a live server holds (one still importing is not listed by
    ``kiln server ls`` yet, but holds its lock from its start)."""
    held = []
    for lock in Path(sockets).glob("*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.append(lock)
        finally:
            os.close(fd)
    return held


def stop_servers(env: dict[str, str], cwd: Path, limit_s: float = 60.0) -> bool:
    """``kiln server stop`` in ``env`` (every server of its ``KILN_SERVER_DIR``), again until no
    server holds its lock there (one that was still importing lists itself first); False, with
    a warning, where one is left after ``limit_s`` seconds (it ends by itself after
    ``KILN_SERVER_IDLE``)."""
    end = time.perf_counter() + limit_s
    while True:
        bench.run_child([sys.executable, "-m", "kiln", "server", "stop"], env=env, cwd=cwd,
                        timeout=60, check=False)
        held = _held(env["KILN_SERVER_DIR"])
        if not held:
            return True
        if time.perf_counter() >= end:
            print(f"warning: a server still holds {held[0]}", file=sys.stderr, flush=True)
            return False
        time.sleep(0.5)


def server_log(store: Path, lines: int = 5) -> str:
    """The last lines of the servers' logs under the store (why a server did not serve)."""
    logs = sorted((store / "server" / "logs").glob("*.log"))
    text = "\n".join(f.read_text(errors="replace") for f in logs).strip().splitlines()
    return " | ".join(text[-lines:]) if text else "(no server log)"


def serve_round(name: str, argv: list[str], plain_argv: list[str], env: dict[str, str],
                plain_env: dict[str, str], script: Path, tmp: Path, rnd: int,
                wait_s: float = 60.0) -> dict[str, Any]:
    """One round of ``run-server`` (see the module's docstring): the paired first plain
    ``kiln run``, the first ``kiln run --server``, the wait, the warm client process (its
    record, with ``cold_plain``, ``cold_server``, ``ready_s`` and ``served``), the stop."""
    where = tmp / f"{name}-server-{rnd}"
    cwd = where / "cwd"  # a folder nothing writes to (it is on the client's sys.path)
    cwd.mkdir(parents=True)
    store = where / "store"
    # the sockets' folder: short (AF_UNIX paths hold ~107 bytes), 0700, fresh each round
    with tempfile.TemporaryDirectory(prefix="kbs", dir="/tmp" if os.path.isdir("/tmp")
                                     else None) as sockets:
        env = env | bench.kiln_store(store) | {"KILN_SERVER_DIR": sockets,
                                                "KILN_SERVER_IDLE": "600"}
        plain_env = plain_env | bench.kiln_store(where / "plain-store")
        try:
            cold_plain = _run(plain_argv, plain_env, cwd)
            cold_server = _run(argv, env, cwd)
            ready, waited = wait_for_server(script, env, cwd, wait_s)
            warm = _run(argv, env, cwd)
            after = server_of(script, env, cwd)
            served = (ready is not None and after is not None
                      and after.get("pid") == ready.get("pid") and after.get("runs") == 1)
        finally:
            stop_servers(env, cwd)
    why = None
    if not served:
        why = (f"no server listed after {waited:.1f} s" if ready is None else
               "the server was gone after the run" if after is None else
               f"the server counted {after.get('runs')} runs") + "; log: " + server_log(store)
    line = (f"cold plain {cold_plain['wall']:.2f} s, cold --server {cold_server['wall']:.2f} s, "
            f"ready after {waited:.2f} s, warm {warm['wall']:.2f} s, "
            + ("served" if served else f"NOT SERVED ({why})"))
    print(f"  [{rnd + 1}] {name} run-server: {line}", flush=True)
    return {**warm, "cold_plain": cold_plain, "cold_server": cold_server, "ready_s": waited,
            "served": served, "not_served_why": why}


def server_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The server's figures: its warm run over JAX's cache warm and over ``kiln run --jit``
    warm (median of the rounds' ratios; ratio of the medians), its first run's cost over the
    paired first plain ``kiln run``, and the rounds it did not serve (1-based)."""
    warm = [r["wall"] for r in runs[MODES["run-server"][1]]]
    out: dict[str, Any] = {
        "served": [r["served"] for r in runs[MODES["run-server"][1]]],
        "unserved_rounds": [i + 1 for i, r in enumerate(runs[MODES["run-server"][1]])
                            if not r["served"]],
        "ready_s": bench.median(r["ready_s"] for r in runs[MODES["run-server"][1]])}
    for mode, key in (("jax", "over_jax_cache_warm"), ("run-jit", "over_run_jit_warm")):
        other = runs.get(MODES[mode][1])
        if other:
            theirs = [r["wall"] for r in other]
            out[key] = {"paired": bench.median(bench.pair_ratios(warm, theirs)),
                        "of_medians": bench.median(warm) / bench.median(theirs)}
    cold = [r["wall"] for r in runs[MODES["run-server"][0]]]
    plain = [r["wall"] for r in runs[SERVER_PLAIN_COLD]]
    out["cold_over_plain_cold"] = bench.median(bench.pair_ratios(cold, plain))
    out["cold_added_s"] = bench.median(c - p for c, p in zip(cold, plain, strict=True))
    return out


def _server_line(name: str, f: dict[str, Any]) -> str:
    parts = [f"{name} server:"]
    for key, what in (("over_jax_cache_warm", "JAX's cache warm"),
                      ("over_run_jit_warm", "kiln run --jit warm")):
        if key in f:
            parts.append(f" warm / {what} {f[key]['paired']:.3f}x paired "
                         f"({f[key]['of_medians']:.3f}x of medians);")
    parts.append(f" first kiln run --server / first kiln run --jit {f['cold_over_plain_cold']:.3f}x"
                 f" ({f['cold_added_s']:+.2f} s); server ready {f['ready_s']:.2f} s after the "
                 "first run; ")
    parts.append("served every round" if not f["unserved_rounds"] else
                 f"NOT SERVED in rounds {f['unserved_rounds']}: its figures do not hold")
    return "".join(parts)


def measure(name: str, reps: int, tmp: Path, modes: tuple[str, ...] = DEFAULT_MODES,
            anchor: str = "jax cache warm", events: bool = True,
            server_wait_s: float = 60.0) -> dict[str, Any]:
    script, kiln_variant, (jax_argv, jax_env), libs = PROGRAMS[name]
    modes = tuple(m for m in modes if m != "kiln" or kiln_variant is not None)
    base = _base_env()
    plain = base | jax_env
    envs = {
        "jax": plain | bench.jax_cache(tmp / f"{name}-jax-cache") | {"KILN_JAX_CACHE": "0"},
        "run": plain | bench.kiln_store(tmp / f"{name}-route"),
        "run-jit": plain | bench.kiln_store(tmp / f"{name}-swap"),
    }
    argvs = {"jax": [str(script), *jax_argv],
             "run": ["-m", "kiln", "run", "--no-jit", str(script), *jax_argv],
             "run-jit": ["-m", "kiln", "run", "--jit", str(script), *jax_argv],
             "run-server": ["-m", "kiln", "run", "--server", "--jit", str(script), *jax_argv]}
    if kiln_variant is not None:
        kiln_argv, kiln_env = kiln_variant
        envs["kiln"] = base | kiln_env | bench.kiln_store(tmp / f"{name}-store")
        argvs["kiln"] = [str(script), *kiln_argv]
    listener = tmp / f"{name}-events.json" if events else None

    def run(mode: str, rnd: int) -> dict[str, Any]:
        if mode == "run-server":  # a cold run each round, on a fresh store and server
            return serve_round(name, argvs["run-server"], argvs["run-jit"], plain, plain, script,
                               tmp, rnd, server_wait_s)
        return _run(argvs[mode], envs[mode], tmp, listener)

    runs = {MODES[m][0]: rs for m, rs in bench.interleave(
        [m for m in modes if m != "run-server"], 1, run, rotate=False).items()}
    runs |= {MODES[m][1]: rs for m, rs in bench.interleave(modes, reps, run).items()}
    if "run-server" in modes:
        served = runs[MODES["run-server"][1]]
        runs[MODES["run-server"][0]] = [r.pop("cold_server") for r in served]
        runs[SERVER_PLAIN_COLD] = [r.pop("cold_plain") for r in served]
    results = {json.dumps(r["result"], sort_keys=True) for rs in runs.values() for r in rs}
    med = {m: bench.median(r["wall"] for r in rs) for m, rs in runs.items()}
    ttfr, itfr = bench.medians(runs, "ttfr"), bench.medians(runs, "itfr")
    out: dict[str, Any] = {"wall_s": med, "ttfr_s": ttfr, "itfr_s": itfr,
                           "identical_results": len(results) == 1,
                           "import_floor_s": _floor(libs, base, tmp), "anchor": anchor}
    if events:  # (the server's runs go without the listener)
        out["trace_lower_s"] = {
            m: {kind: {f: bench.median(r["events"][kind][f] for r in rs)
                       for f in ("trace_s", "lower_s", "traces", "lowerings")}
                for kind in ("jit", "eager")} for m, rs in runs.items()
            if all("events" in r for r in rs)}
    if "run-server" in modes:
        out["server"] = server_figures(runs)
    warm = [MODES[m][1] for m in modes]
    if anchor in med:
        out["wall_ratios"] = {m: r for m, r in bench.ratios(med, anchor).items() if m in warm}
        out["ttfr_ratios"] = {m: r for m, r in bench.ratios(ttfr, anchor).items()
                              if m in warm and r is not None}
        if events:
            jit = {m: _seconds(out["trace_lower_s"][m]["jit"]) for m in warm
                   if m in out["trace_lower_s"]}
            out["jit_trace_lower_ratios"] = ({} if anchor not in jit else {
                m: r for m, r in bench.ratios(jit, anchor).items() if r is not None})
        if "kiln" in modes and anchor == "jax cache warm":  # (kiln warm / JAX's cache, as before)
            out["wall_ratio"] = out["wall_ratios"]["kiln warm"]
            out["ttfr_ratio"] = out["ttfr_ratios"].get("kiln warm")
    out["runs"] = runs
    return out


def add_programs(parser: argparse.ArgumentParser) -> None:
    """``--programs``: a benchmark over :data:`PROGRAMS` (all of them by default)."""
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help="comma-separated names of real_programs.PROGRAMS (default: all)")


def chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The names ``--programs`` gives, checked."""
    names = [n for n in args.programs.split(",") if n]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: unknown {unknown}; known: {', '.join(PROGRAMS)}")
    return names


def _line(name: str, r: dict[str, Any]) -> str:
    """One program's figures as text: per warm mode its wall, ratio to the anchor, time to
    first result, imports to first result, and its jits' / eager trace + lowering seconds."""
    w, t, i, tl = r["wall_s"], r["ttfr_s"], r["itfr_s"], r.get("trace_lower_s")
    ratios = r.get("wall_ratios", {})

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    parts = []
    for mode in (m for m in w if " cold" not in m):
        ratio = f" ({ratios[mode]:.3f}x)" if mode in ratios else ""
        events = "" if tl is None or mode not in tl else (
            f", trace+lower jit {_seconds(tl[mode]['jit']):.2f} / "
            f"eager {_seconds(tl[mode]['eager']):.2f}")
        parts.append(f"{mode}: wall {w[mode]:.2f}{ratio}, ttfr {s(t[mode])}, itfr {s(i[mode])}"
                     + events)
    cold = ", ".join(f"{m} {w[m]:.2f}" for m in w if " cold" in m)
    return (f"{name}: " + "; ".join(parts) + f"; cold wall: {cold}; import floor "
            f"{r['import_floor_s']:.2f}; identical results: {r['identical_results']}")


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=1)
    add_programs(parser)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: "
                        f"{','.join(DEFAULT_MODES)})")
    parser.add_argument("--anchor", default="jax cache warm",
                        help="the warm run the ratios are to (default: %(default)s)")
    parser.add_argument("--no-events", action="store_true",
                        help="run the programs without the listener on JAX's events")
    parser.add_argument("--server-wait", type=float, default=60.0,
                        help="run-server: seconds to wait for the server after its first run "
                        "(default: %(default)s)")
    args = bench.begin(parser, argv, installed=True)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: {modes}; known: {', '.join(MODES)}")
    if "run-server" in modes and not args.no_events:
        print("note: the run-server runs go without the listener on JAX's events; compare "
              "them with --no-events", flush=True)
    if args.anchor not in {w for _, w in MODES.values()}:
        parser.error(f"--anchor: {args.anchor!r}; a warm run: "
                     + ", ".join(w for _, w in MODES.values()))
    report: dict[str, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen(parser, args):
            r = report[name] = measure(name, args.reps, Path(tmp), modes, args.anchor,
                                       events=not args.no_events,
                                       server_wait_s=args.server_wait)
            print(_line(name, r), flush=True)
            ok &= r["identical_results"]
            if "server" in r:
                print(_server_line(name, r["server"]), flush=True)
                ok &= not r["server"]["unserved_rounds"]
    bench.save(args, {"programs": report})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
