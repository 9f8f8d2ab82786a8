"""Unchanged programs whose jits live inside libraries (``examples/libraries/``: numpyro's MCMC,
blackjax's window adaptation and NUTS, a haiku + optax training loop, a jax-md simulation, an
MJX rollout, gymnax CartPole rollouts, evosax's SNES) and public programs as published (JAX's
own ``examples/mnist_classifier_fromscratch.py``, optax's "Getting started" notebook,
purejaxrl's PPO, flax's NNX MNIST tutorial) under ``python -m kiln run --jit``: every
``jax.jit`` outside JAX itself is a ``kiln.jit``, the libraries' too.

Each program runs in fresh processes: plain ``python script`` (``jax.jit`` as JAX defines it),
then ``kiln run --jit`` on an empty store (cold), then on that store (warm). The values each
prints (its last line, one JSON object, timings left out) must be identical in all three, and
the warm run must load every kiln.jit from the store (hits, no miss, no trace, no compile) and
every eager operation and JAX-internal jit through the kiln:// route (no JAX cache miss): kiln's
summary line on stderr (``kiln: hits: ...``) says so; and the warm run writes nothing to the
store (``kiln ls --json`` lists the same entries after it as after the cold run). A program is
skipped only when its library is not installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, finish_child, run_child, start_child

LIBRARIES = Path(__file__).resolve().parent.parent / "examples" / "libraries"

# script -> modules it needs besides jax and kiln
PROGRAMS: dict[str, tuple[str, ...]] = {
    "numpyro_logreg": ("numpyro", "sklearn"),
    "blackjax_nuts": ("blackjax", "sklearn"),
    "haiku_digits": ("haiku", "optax", "sklearn"),
    "jaxmd_lj_melt": ("jax_md",),
    "mjx_humanoid": ("mujoco.mjx",),
    "gymnax_cartpole": ("gymnax",),
    "evosax_snes": ("evosax",),
    "jax_example_mnist_classifier_fromscratch": ("sklearn",),
    "optax_getting_started": ("optax",),
    "purejaxrl_ppo": ("flax", "optax", "distrax", "gymnax"),
    "flax_nnx_mnist_tutorial": ("flax.nnx", "optax", "sklearn"),
}
TIMINGS = ("time_to_first_result_s", "imports_to_first_result_s")
SUMMARY = re.compile(r"^kiln: hits: (\d+), misses: (\d+), traces: (\d+), compiles: (\d+)", re.M)
ROUTE = re.compile(r"jax cache hits: (\d+), misses: (\d+)")
EAGER = re.compile(r"eager loaded: (\d+), compiled: (\d+)")

# Warm starts that do not yet load everything, each with its cause. The values are identical
# all the same; these assert what happens, and turn into failures once it is fixed.
KNOWN_WARM_MISSES: dict[str, str] = {}
# Warm starts that load everything without compiling, but trace one function whose fingerprint
# differs in every process while its program does not (the mode's alias: _Miss._same_program)
# (warm starts that trace a function whose fingerprint differs in every process; numpyro's
# MCMC, whose cache is keyed by id() of the model's arguments, was one: a dict key that is an
# id() now counts as an identity, kiln._keys._walk._objects.is_identity)
SAME_PROGRAM_LOADS: dict[str, str] = {}
# First warm starts that trace one function once, then never again (a later warm start loads
# everything): its fingerprint differs from the cold run's, its program does not, so it is
# loaded without compiling (_Miss._same_program) and stored under the new fingerprint
KNOWN_FIRST_WARM_MISSES = {
    # jax_md.quantity.canonicalize_force sets its closure cell _force_fn on its first call,
    # here in the trace of jax_md.simulate.nve's init_fn; a warm start loads init_fn without
    # tracing it, so the cell is still None when block is keyed: one new entry, once
    "jaxmd_lj_melt": "the trace of init_fn sets canonicalize_force's _force_fn cell",
}


# Warm starts that write to the store: how many warm runs in a row do (the run after them
# writes nothing), and why
WARM_WRITES: dict[str, tuple[int, str]] = {
    # the first warm run writes what it compiled through the kiln:// route
    # (test_warm_run_loads_without_compiling)
    "numpyro_logreg": (1, "route entries of eager work under jax.grad"),
    # the eager work blackjax's init reaches under jax.grad of concrete values, compiled
    # through the kiln:// route on the first warm run (test_warm_run_loads_without_compiling)
    "blackjax_nuts": (1, "eager work under jax.grad, compiled through the route once"),
    **{name: (1, why) for name, why in KNOWN_FIRST_WARM_MISSES.items()},
}
# the warm runs after the cold one, in order
WARM_RUNS = ("warm", "warm again", "warm 3")


def _env(cache: Path) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=str(cache), KILN_PROGRESS="0", JAX_PLATFORMS="cpu",
                     PYTHONDONTWRITEBYTECODE="1")


def _start(name: str, mode: str, cache: Path, cwd: Path) -> tuple[subprocess.Popen, str]:
    script = str(LIBRARIES / f"{name}.py")
    argv = [script] if mode == "plain" else ["-m", "kiln", "run", "--jit", "--explain", script]
    return start_child([sys.executable, *argv], env=_env(cache), cwd=cwd), mode


def _store(cache: Path) -> dict[str, str]:
    """``kiln ls --json`` of a store: each entry's key -> its kind, function and signature."""
    proc = run_child([sys.executable, "-m", "kiln", "ls", "--json"], env=_env(cache), check=True)
    return {r["key"]: f"{r['kind']} {r['function']} ({r['signature']})"
            for r in json.loads(proc.stdout or "[]")}


def _finish(name: str, started: tuple[subprocess.Popen, str]) -> dict[str, Any]:
    proc, mode = started
    out, err = finish_child(proc, f"{name} ({mode})")
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("{")]
    result = json.loads(lines[-1])
    run: dict[str, Any] = {"values": {k: v for k, v in result.items() if k not in TIMINGS},
                           "stderr": err}
    if mode != "plain":
        summary = SUMMARY.findall(err)
        assert summary, f"{name} ({mode}): no kiln summary:\n{err[-4000:]}"
        run["hits"], run["misses"], run["traces"], run["compiles"] = map(int, summary[-1])
        route = ROUTE.findall(err)
        run["route_hits"], run["route_misses"] = map(int, route[-1]) if route else (0, 0)
        eager = EAGER.findall(err)
        run["eager_hits"], run["eager_misses"] = map(int, eager[-1]) if eager else (0, 0)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, dict]]:
    """``runs(name)``: the plain, cold and warm runs of one program (and more warm runs where
    the first are known to miss or to write to the store), each made once per module; after
    each kiln run, the store's entries (``store``)."""
    done: dict[str, dict[str, dict]] = {}

    def get(name: str) -> dict[str, dict]:
        for module in PROGRAMS[name]:
            pytest.importorskip(module)
        if name not in done:
            base = tmp_path_factory.mktemp(name)
            cache = base / "kiln-cache"
            # plain and cold are independent: side by side (2 cores); warm once cold wrote
            started = [_start(name, mode, cache, base) for mode in ("plain", "cold")]
            try:
                by_mode = {s[1]: _finish(name, s) for s in started}
            finally:
                for proc, _ in started:
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
            by_mode["cold"]["store"] = _store(cache)
            by_mode["warm"] = _finish(name, _start(name, "warm", cache, base))
            by_mode["warm"]["store"] = _store(cache)
            # one warm run more than those known to miss or to write, each listed after it
            writes = WARM_WRITES.get(name, (0, ""))[0]
            again = 1 if name in KNOWN_FIRST_WARM_MISSES or by_mode["warm"]["route_misses"] else 0
            for mode in WARM_RUNS[1:1 + max(again, writes)]:
                by_mode[mode] = _finish(name, _start(name, mode, cache, base))
                by_mode[mode]["store"] = _store(cache)
            done[name] = by_mode
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_values_identical_to_jax_jit(name: str, runs: Callable[[str], dict[str, dict]]) -> None:
    by_mode = runs(name)
    plain = by_mode["plain"]["values"]
    assert plain
    for mode, run in by_mode.items():
        assert run["values"] == plain, mode  # exactly: the same executables' results
        assert not re.search(r"\b(Kiln|Store)Warning\b|Traceback", run["stderr"]), (
            mode, run["stderr"][-4000:])


def _assert_loads_everything(name: str, cold: dict[str, Any], warm: dict[str, Any]) -> None:
    explain = warm["stderr"][-4000:]
    assert cold["misses"] > 0 and cold["compiles"] == cold["misses"], cold
    assert warm["hits"] == cold["misses"], explain
    traces = 1 if name in SAME_PROGRAM_LOADS else 0
    assert (warm["misses"], warm["traces"], warm["compiles"]) == (0, traces, 0), explain
    if traces:
        assert "fingerprint changed, lowered module did not" in warm["stderr"], explain
    # JAX's eager work: loaded with no trace or lowering (kiln._travel._eager), the rest of
    # JAX's own jits (eager calls left to JAX, jits inside a trace) through the kiln:// route;
    # none compiled
    assert warm["eager_misses"] == 0 and warm["route_misses"] == 0, explain
    assert warm["eager_hits"] + warm["route_hits"] > 0, explain


# every program, those of KNOWN_WARM_MISSES expected to fail (strictly: a fix shows)
WARM_PARAMS = [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WARM_MISSES[n]))
    if n in KNOWN_WARM_MISSES else n for n in PROGRAMS]


@pytest.mark.slow
@pytest.mark.parametrize("name", WARM_PARAMS)
def test_warm_run_loads_without_compiling(name: str,
                                          runs: Callable[[str], dict[str, dict]]) -> None:
    by_mode = runs(name)
    cold, warm = by_mode["cold"], by_mode["warm"]
    if name in KNOWN_FIRST_WARM_MISSES:
        # one function traced on the first warm start, loaded without compiling and stored
        # under its new fingerprint; every later start loads all with no trace
        assert (warm["misses"], warm["traces"], warm["compiles"]) == (0, 1, 0), \
            warm["stderr"][-4000:]
        assert warm["hits"] == cold["misses"]
        assert "fingerprint changed, lowered module did not" in warm["stderr"]
        warm = by_mode["warm again"]
        _assert_loads_everything(name, cold, warm)
        return
    if warm["route_misses"]:
        # JAX's eager work reached under jax.grad / jax.jvp of concrete values (numpyro's and
        # blackjax's inits) is compiled through jit_p's own path, not jax.jit's cache_miss: the
        # cold run compiled it once, as an eager entry; the first warm run, which loaded that
        # entry and so never lowered the program, compiles it there once more and JAX's cache
        # keeps it (through the route); every later warm run loads everything
        assert warm["eager_misses"] == 0 and warm["compiles"] == 0, warm["stderr"][-4000:]
        warm = by_mode["warm again"]
    _assert_loads_everything(name, cold, warm)


@pytest.mark.slow
@pytest.mark.parametrize("name", WARM_PARAMS)
def test_warm_run_writes_no_store_entry(name: str,
                                        runs: Callable[[str], dict[str, dict]]) -> None:
    """Nothing changed, so nothing is stored: the store holds the same entries (kiln ls
    --json) after a warm run as before it; warm runs that write say why (WARM_WRITES), and
    the run after them writes nothing."""
    by_mode = runs(name)
    before = by_mode["cold"]["store"]
    assert before
    writes, why = WARM_WRITES.get(name, (0, ""))
    for i, mode in enumerate(m for m in WARM_RUNS if m in by_mode):
        after = by_mode[mode]["store"]
        written = sorted(e for key, e in after.items() if key not in before)
        if i < writes:  # known to write: fails once fixed, to be taken off WARM_WRITES
            assert written, f"{name} ({mode}) wrote nothing: fixed? ({why})"
        else:
            assert not written, (mode, written)
            assert after.keys() == before.keys(), mode  # nothing evicted or replaced either
        before = after
