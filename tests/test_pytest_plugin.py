"""kiln's pytest plugin (``pytest --kiln``): a JAX test suite's second run loads what the first
compiled, through JAX's cache routed into kiln's store. Real pytest processes."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
from kiln_test_children import child_env, run_child

SUITE = textwrap.dedent('''
    import json, os, sys
    import jax, jax.numpy as jnp
    from jax._src import compiler

    COMPILES = []
    _real = compiler.backend_compile_and_load

    def _counting(*args, **kwargs):
        COMPILES.append(1)
        return _real(*args, **kwargs)

    compiler.backend_compile_and_load = _counting

    def test_matmul():
        x = jnp.arange(6.0).reshape(2, 3)
        assert float(jax.jit(lambda a: (a @ a.T).sum())(x)) == 83.0

    def test_grad():
        f = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(w) ** 2)))
        assert f(jnp.zeros(3)).tolist() == [0.0, 0.0, 0.0]

    def test_zz_report():
        with open(os.environ["REPORT"], "w") as fh:
            json.dump({"compiles": len(COMPILES), "kiln_imported": "kiln" in sys.modules}, fh)
''')


def _pytest(tmp_path, *flags, **env_extra):
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu",
                    REPORT=str(tmp_path / "report.json"), PYTHONDONTWRITEBYTECODE="1", **env_extra)
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py", *flags],
        cwd=tmp_path, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    return json.loads((tmp_path / "report.json").read_text()), proc.stdout


@pytest.mark.slow
def test_second_run_under_kiln_compiles_nothing(tmp_path):
    # the route alone (--kiln-no-jit): every jax.jit JAX's, its compiles through JAX's cache
    cold, out = _pytest(tmp_path, "--kiln", "--kiln-no-jit")
    assert cold["compiles"] >= 2
    hits, misses, written = map(int, re.search(
        r"kiln: JAX cache hits (\d+), misses (\d+), written (\d+)", out).groups())
    assert (hits, misses, written) == (0, cold["compiles"], cold["compiles"])

    warm, out = _pytest(tmp_path, "--kiln", "--kiln-no-jit")
    assert warm["compiles"] == 0
    hits, misses, written, lowered = map(int, re.search(
        r"kiln: JAX cache hits (\d+), misses (\d+), written (\d+); JAX lowered (\d+) "
        r"programs itself in \d+\.\d\d s", out).groups())
    assert (hits, misses, written) == (cold["compiles"], 0, 0)
    assert lowered == hits  # JAX lowers each of its programs before its cache looks it up

    # KILN_PYTEST=1 turns it on as --kiln does (KILN_PYTEST_JIT=0: as --kiln-no-jit)
    env_on, out = _pytest(tmp_path, KILN_PYTEST="1", KILN_PYTEST_JIT="0")
    assert env_on["compiles"] == 0 and "kiln: JAX cache hits" in out


@pytest.mark.slow
def test_without_the_flag_the_plugin_does_nothing(tmp_path):
    plain, out = _pytest(tmp_path)
    assert plain["compiles"] >= 2
    assert plain["kiln_imported"] is False  # the plugin did not even import kiln
    assert "kiln:" not in out
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_broken_entry_never_fails_a_suite_that_makes_warnings_errors(tmp_path):
    """pytest's ``filterwarnings = error`` (common in JAX projects): a bad entry is logged,
    JAX compiles again, the entry is replaced, and every test passes."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    # the route alone (--kiln-no-jit): the store holds JAX's two entries, both truncated
    cold, _ = _pytest(tmp_path, "--kiln", "--kiln-no-jit")
    for path in sorted((tmp_path / "store").rglob("*.kiln"))[:2]:
        path.write_bytes(path.read_bytes()[:100])  # truncated
    broken, out = _pytest(tmp_path, "--kiln", "--kiln-no-jit")
    assert broken["compiles"] == 2
    warm, out = _pytest(tmp_path, "--kiln", "--kiln-no-jit")
    assert warm["compiles"] == 0  # replaced


@pytest.mark.slow
def test_a_bad_kiln_setting_is_one_usage_error(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = child_env(KILN_MAX_SIZE="lots", REPORT=str(tmp_path / "r.json"), JAX_PLATFORMS="cpu")
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py",
         "--kiln"], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "kiln: KILN_MAX_SIZE" in proc.stderr and "INTERNALERROR" not in proc.stdout
