"""Public equinox / diffrax examples run unchanged through ``kiln.filter_jit``, cold and warm.

``examples/public/`` holds code cells of published notebooks (diffrax's neural ODE; equinox's
RNN, CNN and stateful-layer examples) as scripts, shrunk to run in seconds. Each reads
``EXAMPLE_JIT``: ``eqx`` (the published ``eqx.filter_jit``) or ``kiln`` (``kiln.filter_jit``,
the only change). Each script runs in three fresh processes: ``eqx``, then ``kiln`` on an
empty store (cold), then ``kiln`` again on that store (warm). The results (losses,
accuracies, parameter checksums: the last line printed, one JSON object) must agree, the
cold run must trace and compile what the warm one then loads, and the warm run must neither
compile nor trace.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, finish_child, start_child

PUBLIC = Path(__file__).resolve().parent.parent / "examples" / "public"

# script -> modules it needs besides jax and kiln
SCRIPTS: dict[str, tuple[str, ...]] = {
    "neural_ode": ("equinox", "diffrax", "optax"),
    "train_rnn": ("equinox", "optax"),
    "cnn": ("equinox", "optax", "jaxtyping", "sklearn"),
    "stateful": ("equinox", "optax"),
}
COUNTERS = ("hits", "misses", "traces", "compiles")



def _start(name: str, mode: str, cache: Path, cwd: Path) -> tuple[subprocess.Popen, float]:
    env = child_env(EXAMPLE_JIT="eqx" if mode == "eqx" else "kiln", KILN_CACHE_DIR=str(cache),
                    PYTHONDONTWRITEBYTECODE="1")
    proc = start_child([sys.executable, PUBLIC / f"{name}.py"], env=env, cwd=cwd)
    return proc, time.perf_counter()


def _finish(name: str, mode: str, started: tuple[subprocess.Popen, float]) -> dict[str, Any]:
    proc, start = started
    out, err = finish_child(proc, f"{name} ({mode})")
    wall = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.strip()]
    return {"result": json.loads(lines[-1]), "wall_s": wall, "stderr": err}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, dict]]:
    """``runs(name)``: the eqx, cold and warm runs of one script, each made once per module."""
    done: dict[str, dict[str, dict]] = {}

    def get(name: str) -> dict[str, dict]:
        for module in SCRIPTS[name]:
            pytest.importorskip(module)
        if name not in done:
            base = tmp_path_factory.mktemp(name)
            cache = base / "kiln-cache"
            # eqx and kiln-cold are independent: run them side by side (2 cores: ~1/4 less
            # wall time); the warm run starts once the cold one has written the store.
            started = {mode: _start(name, mode, cache, base) for mode in ("eqx", "cold")}
            try:
                by_mode = {mode: _finish(name, mode, s) for mode, s in started.items()}
            finally:
                for proc, _ in started.values():
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
            by_mode["warm"] = _finish(name, "warm", _start(name, "warm", cache, base))
            done[name] = by_mode
            print(name, {mode: round(r["wall_s"], 1) for mode, r in done[name].items()})
        return done[name]

    return get


def _metrics(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in COUNTERS}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_same_results(name: str, runs: Callable[[str], dict[str, dict]]) -> None:
    by_mode = runs(name)
    eqx = _metrics(by_mode["eqx"]["result"])
    assert eqx and not set(COUNTERS) & set(by_mode["eqx"]["result"])
    for mode in ("cold", "warm"):
        got = _metrics(by_mode[mode]["result"])
        assert got.keys() == eqx.keys(), mode
        for key, expected in eqx.items():
            assert got[key] == pytest.approx(expected, rel=1e-5, abs=1e-7), (mode, key)
    for mode, run in by_mode.items():
        # kiln never warns here (equinox's own BatchNorm UserWarning is not kiln's)
        assert not re.search(r"\b(Kiln|Store)Warning\b|Traceback", run["stderr"]), (
            mode,
            run["stderr"][-4000:],
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_warm_loads_without_compiling(name: str, runs: Callable[[str], dict[str, dict]]) -> None:
    by_mode = runs(name)
    cold, warm = by_mode["cold"]["result"], by_mode["warm"]["result"]
    assert cold["hits"] == 0 and cold["misses"] > 0
    assert cold["traces"] == cold["compiles"] == cold["misses"]
    assert warm["misses"] == 0 and warm["compiles"] == 0
    assert warm["hits"] == cold["misses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_warm_does_not_trace(name: str, runs: Callable[[str], dict[str, dict]]) -> None:
    warm = runs(name)["warm"]["result"]
    assert warm["traces"] == 0
