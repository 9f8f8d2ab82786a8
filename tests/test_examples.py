"""Run the example programs in ``examples/`` in-process and check their results.

The examples are loaded by file path (they are scripts, not part of the package).
Every end-to-end test is parametrized over ``JIT_MODES``: the same checks run through
``jax.jit`` and through ``kiln.jit`` (on the test's private store).

``examples/lotka_volterra.py`` runs the program that ships with kiln for ``kiln demo``
(``src/kiln_demo/``); imported, it offers that program's functions.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from kiln_test_children import run_child

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO = Path(__file__).resolve().parent.parent / "src" / "kiln_demo"
JIT_MODES = ["jax", "kiln"]

# Published estimates (Stan case study "Predator-Prey Population Dynamics").
LV_PUBLISHED = {"a": 0.55, "b": 0.028, "c": 0.84, "d": 0.026}


def _load(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    mod_name = f"kiln_examples_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def _last_json_line(out: str) -> dict:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert lines, "example printed nothing"
    return json.loads(lines[-1])


def test_hudson_bay_data() -> None:
    lv = _load("lotka_volterra")
    ts, ys = lv.load_data()
    assert ts.shape == (21,) and ys.shape == (21, 2)
    np.testing.assert_array_equal(ts, np.arange(21))
    assert np.all(ys > 0)
    np.testing.assert_allclose(ys[0], [30.0, 4.0])
    np.testing.assert_allclose(ys[-1], [24.7, 8.6], rtol=1e-6)
    assert lv.DEFAULT_DATA == DEMO / "hudson_bay.csv"
    assert (DEMO / "README.md").is_file()


def test_lotka_volterra_custom_data_path(tmp_path: Path) -> None:
    lv = _load("lotka_volterra")
    src = DEMO / "hudson_bay.csv"
    dst = tmp_path / "copy.csv"
    dst.write_text(src.read_text())
    ts, ys = lv.load_data(dst)
    ts0, ys0 = lv.load_data()
    np.testing.assert_array_equal(ts, ts0)
    np.testing.assert_array_equal(ys, ys0)


def test_lotka_volterra_example_is_the_shipped_program() -> None:
    import kiln_demo.lotka_volterra as shipped

    lv = _load("lotka_volterra")
    assert Path(shipped.__file__).resolve() == DEMO / "lotka_volterra.py"
    for name in lv.__all__:
        assert getattr(lv, name) is getattr(shipped, name), name


@pytest.mark.slow
def test_lotka_volterra_example_runs_the_shipped_program_as_a_script() -> None:
    proc = run_child([sys.executable, EXAMPLES / "lotka_volterra.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the program's own parser answered (this file has none)
    assert proc.stdout.startswith("usage: lotka_volterra.py ")
    assert "--timings" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("jit", JIT_MODES)
def test_lotka_volterra_fit(jit: str, capsys: pytest.CaptureFixture[str]) -> None:
    lv = _load("lotka_volterra")
    result = lv.main(["--jit", jit])
    printed = _last_json_line(capsys.readouterr().out)
    assert printed == result
    assert set(result["params"]) == set(LV_PUBLISHED)
    for name, expected in LV_PUBLISHED.items():
        assert result["params"][name] == pytest.approx(expected, rel=0.2), name
    assert math.isfinite(result["loss"]) and result["loss"] < 0.1
    assert result["time_to_first_result_s"] > 0


@pytest.mark.parametrize("jit", JIT_MODES)
def test_mlp_digits(jit: str, capsys: pytest.CaptureFixture[str]) -> None:
    mlp = _load("mlp_digits")
    result = mlp.main(["--jit", jit, "--steps", "200"])
    printed = _last_json_line(capsys.readouterr().out)
    assert printed == result
    assert result["test_accuracy"] > 0.9
    assert math.isfinite(result["loss"])
    assert result["time_to_first_result_s"] > 0


def test_unknown_jit_mode_rejected() -> None:
    lv = _load("lotka_volterra")
    with pytest.raises(SystemExit):
        lv.main(["--jit", "numba"])
