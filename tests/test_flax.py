"""flax under kiln.jit: ``examples/flax_digits.py`` in-process and cold / warm across processes.

The example trains a ``flax.linen`` MLP (``model.apply`` inside an optax Adam train step) and a
``flax.nnx`` MLP (``nnx.split`` outside, ``nnx.merge(graphdef, state)`` inside the jitted step,
the ``nnx.State`` a pytree argument, the ``GraphDef`` a static argument) on scikit-learn's 8x8
digits. Under ``--jit kiln`` its JSON line carries, per model, the ``kiln.stats()`` counters
that model added.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kiln_test_children import child_env, run_child

pytest.importorskip("flax")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flax_digits.py"
MODELS = ("linen", "nnx")
COLD = {"hits": 0, "misses": 3, "traces": 3, "compiles": 3}  # train_step + 2 accuracy shapes


def _load() -> ModuleType:
    mod_name = "kiln_examples_flax_digits"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def _last_json_line(out: str) -> dict[str, Any]:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert lines, "example printed nothing"
    return json.loads(lines[-1])


def _same_results(a: dict[str, Any], b: dict[str, Any]) -> None:
    for model in MODELS:
        for metric in ("test_accuracy", "train_accuracy"):
            assert a[model][metric] == b[model][metric], (model, metric)
        assert a[model]["loss"] == pytest.approx(b[model]["loss"], rel=1e-5), model


def test_flax_digits_kiln_matches_jax(capsys: pytest.CaptureFixture[str]) -> None:
    flax_digits = _load()
    want = flax_digits.main(["--jit", "jax"])
    assert _last_json_line(capsys.readouterr().out) == want
    got = flax_digits.main(["--jit", "kiln"])
    assert _last_json_line(capsys.readouterr().out) == got
    for result in (want, got):
        for model in MODELS:
            assert result[model]["test_accuracy"] > 0.9, (result["jit"], model)
            assert 0 < result[model]["loss"] < 0.1, (result["jit"], model)
        assert result["time_to_first_result_s"] > 0
    _same_results(got, want)
    for model in MODELS:
        assert "kiln" not in want[model]
        assert got[model]["kiln"] == COLD, model  # the test's private store starts empty


# ----------------------------------------------------------------------------------------------
# Across processes: the example run twice on one private store
# ----------------------------------------------------------------------------------------------


def _run_example(store: Path) -> dict[str, Any]:
    proc = run_child([sys.executable, EXAMPLE, "--jit", "kiln"],
                     env=child_env(KILN_CACHE_DIR=str(store)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    return _last_json_line(proc.stdout)


@pytest.fixture(scope="module")
def cold_warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example under ``--jit kiln`` in two fresh processes sharing one empty store."""
    store = tmp_path_factory.mktemp("flax") / "cache"
    return _run_example(store), _run_example(store)


@pytest.mark.slow
def test_warm_run_loads_every_executable(cold_warm: tuple[dict[str, Any], dict[str, Any]]) -> None:
    cold, warm = cold_warm
    _same_results(warm, cold)
    for model in MODELS:
        assert cold[model]["kiln"] == COLD, model
        assert warm[model]["test_accuracy"] > 0.9, model
        counts = warm[model]["kiln"]
        assert (counts["hits"], counts["misses"], counts["compiles"]) == (3, 0, 0), model
    assert warm["linen"]["kiln"]["traces"] == 0


@pytest.mark.slow
def test_warm_nnx_steps_do_not_trace(cold_warm: tuple[dict[str, Any], dict[str, Any]]) -> None:
    _, warm = cold_warm
    assert warm["nnx"]["kiln"]["traces"] == 0


@pytest.mark.slow
def test_closed_over_graphdef_is_keyed_by_value(xp: Any, tmp_path: Path) -> None:
    prog = xp.Program(tmp_path)
    prog.write(
        "prog.py",
        """
        import sys

        import jax.numpy as jnp
        from flax import nnx

        import kiln


        class Scaled(nnx.Module):
            def __init__(self, scale, rngs):
                self.linear = nnx.Linear(3, 4, rngs=rngs)
                self.scale = scale  # a plain float: static, held by the graphdef only

            def __call__(self, x):
                return self.scale * self.linear(x)


        graphdef, state = nnx.split(Scaled(float(sys.argv[1]), nnx.Rngs(0)))


        @kiln.jit
        def f(state, x):
            TRACE()
            return nnx.merge(graphdef, state)(x).sum()


        x = jnp.ones((2, 3))
        call("f", f, state, x)
        report(want=float(nnx.merge(graphdef, state)(x).sum()))
    """,
    )
    one = prog.run("1.0")
    xp.assert_cold(one["f"])
    assert xp.value(one["f"]) == pytest.approx(one.extra["want"], rel=1e-6)
    two = prog.run("2.0")  # same code, same state shapes; only graphdef's `scale` differs
    assert xp.value(two["f"]) == pytest.approx(two.extra["want"], rel=1e-6)
    xp.assert_cold(two["f"])


TRAIN_STATE = r'''
import json, sys, jax, jax.numpy as jnp, optax, kiln
import flax.linen as nn
from flax.training import train_state

lr = float(sys.argv[1])
model = nn.Dense(3)
params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"]
tx = optax.adamw(lr)
state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
apply_fn = state.apply_fn


@kiln.jit
def train_step(state, x):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.sum(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss


x = jnp.ones((2, 4))
losses = []
for _ in range(3):  # step: the Python int 0, then the weak int32[] the step returned
    state, loss = train_step(state, x)
    losses.append(float(loss))
s = kiln.stats()
print(json.dumps({"losses": losses, "step": int(state.step), "compiles": s.compiles,
                  "hits": s.hits, "traces": s.traces, "written": s.stores_written,
                  "own_tx": state.tx is tx, "own_apply_fn": state.apply_fn is apply_fn}))
'''


@pytest.mark.slow
def test_a_train_state_step_is_stored_and_gives_back_the_caller_s_objects(tmp_path: Path) -> None:
    """A step returning a flax TrainState: stored, although its output structure
    holds ``apply_fn`` and optax's local functions; a warm result holds the caller's own
    ``tx`` and ``apply_fn``; ``step=0`` then the returned weak int32[] is one program; another
    learning rate is another program (never stale)."""
    script = tmp_path / "train_state.py"
    script.write_text(TRAIN_STATE)
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"))

    def run(lr: str) -> dict[str, Any]:
        proc = run_child([sys.executable, script, lr], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-8000:]
        assert "KilnWarning" not in proc.stderr, proc.stderr[-3000:]
        return _last_json_line(proc.stdout)

    cold = run("0.1")
    assert (cold["compiles"], cold["traces"], cold["written"]) == (1, 1, 1)
    assert cold["own_tx"] and cold["own_apply_fn"] and cold["step"] == 3
    warm = run("0.1")
    assert (warm["compiles"], warm["traces"], warm["hits"]) == (0, 0, 1)
    assert warm["losses"] == cold["losses"] and warm["own_tx"] and warm["own_apply_fn"]
    other = run("0.2")
    assert other["compiles"] == 1 and other["losses"][1:] != cold["losses"][1:]
