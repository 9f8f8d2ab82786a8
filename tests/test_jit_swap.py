"""The jax.jit swap (``kiln.replace_jax_jit``, ``kiln run --jit``, ``KILN_REPLACE_JIT=1``,
``pytest --kiln --kiln-jit``): every jax.jit outside JAX itself is a kiln.jit; what kiln.jit
cannot take stays jax.jit; ``kiln run -m``. Cross-process tests run real processes sharing one
store; counts and values, never timings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child
from kiln_test_helpers import error_of

import kiln
from kiln._jit import _swap


@pytest.fixture
def swapped():
    """jax.jit swapped for the test, put back after."""
    assert kiln.replace_jax_jit()
    yield
    kiln.restore_jax_jit()
    _swap._extra_exclude = ()


# ---------------------------------------------------------------------------------------------
# In one process
# ---------------------------------------------------------------------------------------------
def test_replace_and_restore():
    original = jax.jit
    assert kiln.replace_jax_jit() and jax.jit is not original
    assert not kiln.replace_jax_jit()  # once
    assert kiln.restore_jax_jit() and jax.jit is original
    assert not kiln.restore_jax_jit()


def test_the_swap_turns_eager_work_on_and_off(monkeypatch):
    from kiln._travel import _eager

    assert kiln.replace_jax_jit()
    try:
        assert _eager.is_enabled()
        before = kiln.stats()
        x = jnp.arange(51.0).reshape(17, 3)  # (shapes no other test's eager work has)
        np.testing.assert_allclose(jnp.cumprod(x * 0.5 + 1.0, axis=1),
                                   np.cumprod(np.arange(51.0).reshape(17, 3) * 0.5 + 1.0, axis=1),
                                   rtol=1e-6)
        assert kiln.stats().eager_writes > before.eager_writes
        # JAX's modules stay plain modules (a subclass would slow every attribute read, and
        # pickle differently: a host callback naming one could no longer be stored)
        assert type(jnp) is type(jax)
    finally:
        kiln.restore_jax_jit()
    assert not _eager.is_enabled()
    # KILN_EAGER=0: the swap leaves eager work to JAX
    monkeypatch.setenv("KILN_EAGER", "0")
    assert kiln.replace_jax_jit()
    try:
        assert not _eager.is_enabled()
    finally:
        kiln.restore_jax_jit()


def test_every_form_is_a_kiln_jit(swapped):
    import functools

    from jax import jit

    @jit
    def a(x):
        return x + 1

    @jax.jit(static_argnames="n")
    def b(x, n):
        return x * n

    c = functools.partial(jax.jit, static_argnums=1)(lambda x, n: x - n)
    d = jax.jit(lambda x: x * x, donate_argnums=())
    for f in (a, b, c, d):
        assert isinstance(f, _swap.SwappedJit), f
    x = jnp.arange(3.0)
    assert a(x).tolist() == [1.0, 2.0, 3.0]
    assert b(x, n=2).tolist() == [0.0, 2.0, 4.0]
    assert c(x, 1).tolist() == [-1.0, 0.0, 1.0]
    assert d(x).tolist() == [0.0, 1.0, 4.0]
    assert kiln.stats().misses == 4


def test_jax_and_kiln_internals_keep_jax_jit(swapped):
    def f(x):
        return x

    for module in ("jax.numpy.fake", "jaxlib.fake", "kiln._miss.fake", "jax"):
        scope = {"__name__": module, "jax": jax, "f": f}
        exec("g = jax.jit(f)", scope)
        assert not isinstance(scope["g"], kiln.JitFunction), module
    scope = {"__name__": "jaxtyping_like", "jax": jax, "f": f}  # only jax's own package
    exec("g = jax.jit(f)", scope)
    assert isinstance(scope["g"], kiln.JitFunction)


def test_exclude_by_module_and_qualname(swapped, monkeypatch):
    monkeypatch.setenv("KILN_JIT_EXCLUDE", "mylib.sub, prog:Model")

    def f(x):
        return x

    for module, expect_jax in (("mylib.sub", True), ("mylib.sub.deep", True),
                               ("mylib.subway", False), ("mylib", False)):
        scope = {"__name__": module, "jax": jax, "f": f}
        exec("g = jax.jit(f)", scope)
        assert isinstance(scope["g"], kiln.JitFunction) is not expect_jax, module

    class Model:
        def __call__(self, x):
            return x

    for qualname, expect_jax in (("Model.__call__", True), ("Model", True),
                                 ("Modelx.__call__", False)):
        g = Model.__call__
        g.__module__, g.__qualname__ = "prog", qualname
        assert isinstance(jax.jit(g), kiln.JitFunction) is not expect_jax, qualname

    kiln.replace_jax_jit(exclude=["tests_other"])
    scope = {"__name__": "tests_other.x", "jax": jax, "f": f}
    exec("g = jax.jit(f)", scope)
    assert not isinstance(scope["g"], kiln.JitFunction)


def test_keep_jax_jit_either_order(swapped):
    @jax.jit
    @kiln.keep_jax_jit
    def below(x):
        return x

    @kiln.keep_jax_jit
    @jax.jit
    def above(x):
        return x

    assert not isinstance(below, kiln.JitFunction)
    assert not isinstance(above, kiln.JitFunction)
    assert above(jnp.ones(1)).tolist() == [1.0]
    assert kiln.stats().traces == 0


def test_an_option_kiln_jit_refuses_falls_back(swapped, caplog):
    # jax.jit takes a NumPy integer as static_argnums; kiln.jit refuses it at decoration
    kiln.configure(explain=True)

    def f(x, n):
        return x * n

    g = jax.jit(f, static_argnums=np.int64(1))
    assert not isinstance(g, kiln.JitFunction)
    assert g(jnp.ones(2), 3).tolist() == [3.0, 3.0]
    assert kiln.stats().reasons["jit-swap-jax"] == 1
    assert "left to jax.jit: kiln.jit refused it: TypeError" in caplog.text


def test_jax_errors_stay_jax_errors(swapped):
    def f(x):
        return x

    with pytest.raises(TypeError, match="unexpected keyword"):
        jax.jit(f, no_such_option=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        jax.jit(no_such_option=1)
    with pytest.raises(ValueError):
        jax.jit(f, static_argnums=5, static_argnames=())(jnp.ones(1))


class _BadDigest:
    """Hashable (jax.jit takes it as static), but its __kiln_digest__ breaks kiln's rule."""

    def __hash__(self):
        return 1

    def __eq__(self, other):
        return isinstance(other, _BadDigest)

    def __kiln_digest__(self):
        return 42


def test_a_call_kiln_jit_refuses_goes_to_jax_jit(swapped):
    g = jax.jit(lambda x, s: x + 1, static_argnums=1)
    assert isinstance(g, kiln.JitFunction)
    assert g(jnp.ones(2), _BadDigest()).tolist() == [2.0, 2.0]
    assert g._jax_only is not None and "__kiln_digest__" in g._jax_only
    assert g(jnp.ones(2), _BadDigest()).tolist() == [2.0, 2.0]  # straight to jax.jit now
    assert kiln.stats().reasons["jit-swap-jax"] == 1


@pytest.mark.parametrize("options, call", [
    ({"static_argnums": 1}, lambda g, v: g(jnp.ones(2), v)),
    ({"static_argnums": -1}, lambda g, v: g(jnp.ones(2), v)),  # (no C++ dispatcher)
    ({"static_argnames": "s"}, lambda g, v: g(jnp.ones(2), s=v)),
])
def test_a_static_argument_jax_jit_cannot_hash_raises_jax_jit_s_error(swapped, options, call):
    """kiln.jit keys a numpy array (or a list) passed as a static argument by value; a jax.jit
    the swap made raises jax.jit's error for it, on the first call and after a hashable one,
    and takes hashable values as before (JAX's api_test.py
    test_jit_raises_on_first_invocation_on_non_hashable_static_argnum)."""
    def f(x, s):
        return x + 1

    want = error_of(lambda: call(_swap._ORIGINAL(f, **options), np.asarray(1)))
    assert isinstance(want, ValueError) and "Non-hashable static arguments" in str(want)
    g = jax.jit(f, **options)
    assert isinstance(g, kiln.JitFunction)
    for value in (np.asarray(1), [1]):
        got = error_of(lambda v=value: call(g, v))
        assert type(got) is ValueError and "Non-hashable static arguments" in str(got)
    assert call(g, 1).tolist() == [2.0, 2.0] and kiln.stats().misses == 1
    got = error_of(lambda: call(g, np.asarray(1)))
    assert type(got) is ValueError and "Non-hashable static arguments" in str(got)
    assert call(g, 1).tolist() == [2.0, 2.0] and kiln.stats().misses == 1


def test_a_function_no_weak_reference_can_be_made_to_is_left_to_jax_jit(swapped):
    """jax.jit's calls of a callable without __weakref__ raise TypeError; kiln.jit's would run
    it: the swap leaves it to jax.jit (JAX's api_test.py
    test_jit_of_nonweakreferenceable_function)."""
    class CallableWithSlots:
        __slots__ = ()

        def __call__(self, x):
            return x + 1

    g = jax.jit(CallableWithSlots())
    assert not isinstance(g, kiln.JitFunction)
    with pytest.raises(TypeError, match="cannot create weak reference"):
        g(3)
    assert kiln.stats().reasons["jit-swap-jax"] == 1


def test_jax_jit_attributes_are_jax_jit_s(swapped):
    def f(x):
        return x * 2

    g = jax.jit(f)
    x = jnp.ones(3)
    assert isinstance(g.lower(x), jax.stages.Lowered)
    assert isinstance(g.trace(x), jax.stages.Traced)
    assert g.eval_shape(x).shape == (3,)
    assert g.__wrapped__ is f
    assert g(x).tolist() == [2.0, 2.0, 2.0]
    assert g._cache_size() == 1  # kiln's table
    assert callable(g._cache_miss)  # jax.jit's own, through the plain jax.jit of f
    g.clear_cache()
    assert g._cache_size() == 0
    reasons = kiln.stats().reasons
    assert reasons["jit-swap-attribute"] == 4  # lower, trace, eval_shape, _cache_miss
    assert reasons["jit-swap-kiln"] == 1


# ---------------------------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------------------------
LIB = '''
import functools

import jax
import jax.numpy as jnp
from kiln_probe import TRACE


@jax.jit
def lib_decorated(x):
    TRACE()
    return jnp.sin(x) * 2


def _scale(x, k):
    TRACE()
    return x * k


lib_partial = functools.partial(jax.jit, static_argnums=1)(_scale)
'''

EXCLUDED = '''
import jax
from kiln_probe import TRACE


@jax.jit
def excluded(x):
    TRACE()
    return x - 1
'''

PROG = '''
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import jit

import kiln
import mylib
import excluded_lib

LOCK = threading.Lock()


@jit
def from_import(x):
    TRACE()
    return x + 1


def _plain(x, y):
    TRACE()
    return x @ y


called = jax.jit(_plain)


@functools.partial(jax.jit, static_argnames="n")
def powered(x, n):
    TRACE()
    return x ** n


@jax.jit(static_argnames="k")
def factory(x, k):
    TRACE()
    return x * k


@jax.jit
@kiln.keep_jax_jit
def kept(x):
    TRACE()
    return x / 2


def _np_static(x, n):
    TRACE()
    return x + n


refused = jax.jit(_np_static, static_argnums=np.int64(1))


@jax.jit
def verify(x):
    TRACE()
    LOCK.locked()
    return x * 3


x = jnp.arange(4.0)
m = jnp.arange(4.0).reshape(2, 2)
call("from_import", from_import, x)
call("called", called, m, m)
call("powered", powered, x, n=3)
call("factory", factory, x, k=2.0)
call("lib_decorated", mylib.lib_decorated, x)
call("lib_partial", mylib.lib_partial, x, 4)
call("kept", kept, x)
call("refused", refused, x, 5)
call("verify", verify, x)
call("excluded", excluded_lib.excluded, x)
report(types={name: type(f).__name__ for name, f in [
    ("from_import", from_import), ("called", called), ("powered", powered),
    ("factory", factory), ("lib_decorated", mylib.lib_decorated),
    ("lib_partial", mylib.lib_partial), ("kept", kept), ("refused", refused),
    ("verify", verify), ("excluded", excluded_lib.excluded)]})
'''

SWAPPED = ("from_import", "called", "powered", "factory", "lib_decorated", "lib_partial")
LEFT_TO_JAX = ("kept", "refused", "excluded")
KILN_RUN_JIT = ("-m", "kiln", "run", "--jit", "prog.py")


@pytest.fixture
def program(tmp_path, xp):
    prog = xp.Program(tmp_path, base_env={"KILN_JIT_EXCLUDE": "excluded_lib"})
    prog.write("prog.py", PROG)
    prog.write("mylib.py", LIB)
    prog.write("excluded_lib.py", EXCLUDED)
    return prog


@pytest.mark.slow
def test_unchanged_program_warm_start_traces_nothing(program):
    plain = program.run()  # python prog.py: jax.jit as JAX defines it
    assert set(plain.extra["types"].values()) == {"PjitFunction"}
    assert plain.stats["misses"] == 0

    cold = program.run(main=KILN_RUN_JIT, env={"KILN_EXPLAIN": "1"})
    warm = program.run(main=KILN_RUN_JIT, env={"KILN_EXPLAIN": "1"})
    by_env = program.run(env={"KILN_REPLACE_JIT": "1"})  # python prog.py, the swap from import
    for run in (cold, warm, by_env):
        types = run.extra["types"]
        for name in SWAPPED + ("verify",):
            assert types[name] == "SwappedJit", (name, types)
        for name in LEFT_TO_JAX:
            assert types[name] == "PjitFunction", (name, types)
        for name in plain.results:  # the same values as plain jax.jit
            assert run[name]["leaves"] == plain[name]["leaves"], name
            assert run[name]["dtypes"] == plain[name]["dtypes"], name
            assert "error" not in run[name], run[name]

    for name in SWAPPED:
        assert cold[name]["misses"] == 1 and cold[name]["compiles"] == 1, (name, cold[name])
        assert cold[name]["py_traces"] == 1
        for run in (warm, by_env):
            rec = run[name]
            assert (rec["hits"], rec["misses"], rec["traces"], rec["py_traces"]) == (1, 0, 0, 0)
            assert (rec["jax_traces"], rec["jax_lowerings"], rec["xla_compiles"]) == (0, 0, 0)
    # left to jax.jit: traced by jax in every process (the excluded module, the marked function,
    # the option kiln.jit refuses)
    for name in LEFT_TO_JAX:
        for run in (cold, warm, by_env):
            assert run[name]["py_traces"] == 1 and run[name]["misses"] == 0, (name, run[name])
    # the verify path (a global lock has no digest): traced and lowered, never compiled again
    assert warm["verify"]["py_traces"] == 1 and warm["verify"]["xla_compiles"] == 0
    assert warm["verify"]["hits"] == 1

    # KILN_EXPLAIN=1 says what each jax.jit became
    err = warm.stderr
    assert "__main__.from_import: jax.jit made kiln.jit" in err
    assert "mylib.lib_decorated: jax.jit made kiln.jit" in err
    assert "mylib._scale: jax.jit made kiln.jit" in err
    assert re.search(r"__main__\.verify: jax\.jit made kiln\.jit, on the verify path .*LOCK", err)
    assert "excluded_lib.excluded: left to jax.jit: excluded by 'excluded_lib'" in err
    assert "__main__.kept: left to jax.jit: marked with kiln.keep_jax_jit" in err
    assert "__main__._np_static: left to jax.jit: kiln.jit refused it: TypeError" in err
    summary = [ln for ln in err.splitlines() if ln.startswith("kiln: hits:")][-1]
    assert "jax.jit as kiln.jit: 7 (verify path: 1), left to jax.jit: 3" in summary


MODULE = '''
import json
import sys

import jax
import jax.numpy as jnp

import kiln


@jax.jit
def double(x):
    return x * 2


out = double(jnp.arange(3.0)).tolist()
print("RESULT " + json.dumps({"argv": sys.argv[1:], "name": __name__, "out": out,
                              "type": type(double).__name__, "traces": kiln.stats().traces,
                              "hits": kiln.stats().hits}))
'''


def _kiln_run(cwd: Path, *args: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = child_env(KILN_CACHE_DIR=str(cwd / "store"), KILN_JAX_CACHE="0", JAX_PLATFORMS="cpu",
                    PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    return run_child([sys.executable, "-m", "kiln", "run", *args], cwd=cwd, env=env, timeout=300)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_kiln_run_m_runs_a_module_with_its_arguments(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(MODULE)
    (tmp_path / "pkg" / "__main__.py").write_text("from pkg import train\n")

    # the swap is kiln run's default; --jit says so explicitly
    cold = _result(_kiln_run(tmp_path, "-m", "pkg.train", "--steps", "3", "-x"))
    assert cold == {"argv": ["--steps", "3", "-x"], "name": "__main__", "out": [0.0, 2.0, 4.0],
                    "type": "SwappedJit", "traces": 1, "hits": 0}
    warm = _result(_kiln_run(tmp_path, "--jit", "-m", "pkg.train", "--steps", "3", "-x"))
    assert warm == {**cold, "traces": 0, "hits": 1}
    # other arguments: an input of the guard (kiln._keys._guard), verified once (the same
    # module: loaded), then warm
    other = _result(_kiln_run(tmp_path, "--jit", "-m", "pkg.train", "a"))
    assert other == {**cold, "argv": ["a"], "traces": 1, "hits": 1}
    again = _result(_kiln_run(tmp_path, "--jit", "-m", "pkg.train", "a"))
    assert again == {**cold, "argv": ["a"], "traces": 0, "hits": 1}
    # --no-jit (or KILN_REPLACE_JIT=0): jax.jit as JAX defines it; a package runs its __main__;
    # an option after the module is the module's
    plain = _result(_kiln_run(tmp_path, "--no-jit", "-m", "pkg"))
    assert (plain["type"], plain["out"], plain["name"]) == ("PjitFunction", [0.0, 2.0, 4.0],
                                                            "pkg.train")
    off = _result(_kiln_run(tmp_path, "-m", "pkg.train", "--no-jit", env={"KILN_REPLACE_JIT": "0"}))
    assert (off["type"], off["argv"]) == ("PjitFunction", ["--no-jit"])
    on = _result(_kiln_run(tmp_path, "--jit", "-m", "pkg.train", env={"KILN_REPLACE_JIT": "0"}))
    assert (on["type"], on["hits"]) == ("SwappedJit", 1)  # the flag wins over the environment
    both = _kiln_run(tmp_path, "--jit", "--no-jit", "-m", "pkg.train")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr

    missing = _kiln_run(tmp_path, "-m", "no_such_module")
    assert missing.returncode == 1 and "error: No module named 'no_such_module'" in missing.stderr
    both = _kiln_run(tmp_path, "prog.py", "-m", "pkg.train")
    assert both.returncode == 2


SUITE = '''
import functools

import jax
import jax.numpy as jnp


@jax.jit
def loss(w):
    return jnp.sum(jnp.tanh(w) ** 2)


grad = jax.jit(jax.grad(loss.__wrapped__))


@functools.partial(jax.jit, static_argnums=1)
def tile(x, n):
    return jnp.tile(x, n)


def test_loss():
    assert float(loss(jnp.zeros(3))) == 0.0


def test_grad():
    assert grad(jnp.zeros(3)).tolist() == [0.0, 0.0, 0.0]


def test_tile():
    assert tile(jnp.arange(2.0), 2).tolist() == [0.0, 1.0, 0.0, 1.0]
'''


def _pytest(tmp_path: Path, *flags: str, **env_extra: str) -> tuple[int, int, int]:
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu",
                    PYTHONDONTWRITEBYTECODE="1", **env_extra)
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py",
         *flags], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = re.search(r"kiln: kiln\.jit hits (\d+), misses (\d+), traces (\d+)", proc.stdout)
    assert got, proc.stdout
    hits, misses, traces = map(int, got.groups())
    return hits, misses, traces


@pytest.mark.slow
def test_pytest_kiln_jit_second_run_traces_nothing(tmp_path):
    assert _pytest(tmp_path, "--kiln") == (0, 3, 3)  # the swap: --kiln's default
    assert _pytest(tmp_path, "--kiln") == (3, 0, 0)
    # another command line is another input of the guard (kiln._keys._guard): each function
    # verified once (traced, its module the same: loaded, no compile), then warm
    assert _pytest(tmp_path, "--kiln", "--kiln-jit") == (3, 0, 3)
    assert _pytest(tmp_path, "--kiln", "--kiln-jit") == (3, 0, 0)
    assert _pytest(tmp_path, KILN_PYTEST_JIT="1") == (3, 0, 3)
    assert _pytest(tmp_path, KILN_PYTEST="1") == (3, 0, 0)  # (the same command line)


@pytest.mark.slow
@pytest.mark.parametrize("off", [("--kiln", "--kiln-no-jit"), ("--kiln", "KILN_PYTEST_JIT=0"),
                                 ("--kiln", "KILN_REPLACE_JIT=0")])
def test_pytest_kiln_without_the_swap(tmp_path, off):
    """``--kiln-no-jit`` (``KILN_PYTEST_JIT=0``, ``KILN_REPLACE_JIT=0``): the route alone, every
    jax.jit JAX's own (no kiln.jit line in the summary, JAX's cache line only)."""
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    flags = [f for f in off if f.startswith("-")]
    extra = dict(f.split("=") for f in off if "=" in f)
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu",
                    PYTHONDONTWRITEBYTECODE="1", **extra)
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py",
         *flags], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kiln.jit hits" not in proc.stdout and "kiln: JAX cache hits" in proc.stdout


def test_pytest_kiln_jit_and_kiln_no_jit_together_is_a_usage_error(tmp_path):
    (tmp_path / "test_suite.py").write_text("def test_nothing():\n    pass\n")
    proc = run_child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "test_suite.py", "--kiln-jit", "--kiln-no-jit"], cwd=tmp_path,
                     env=child_env(KILN_CACHE_DIR=str(tmp_path / "store")), timeout=300)
    assert proc.returncode == 4 and "--kiln-jit and --kiln-no-jit" in proc.stderr


# ---------------------------------------------------------------------------------------------
# equinox's filter_jit under the swap: its jax.jit is a kiln.jit
# ---------------------------------------------------------------------------------------------
EQX_PROG = '''
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp

import kiln

SCALE = 2.0


def apply(model, x):
    TRACE()
    return model(x) * SCALE


def unusable(x, y):
    TRACE()
    return x + jnp.sum(y)  # y's buffer cannot be reused: jax warns that it was not usable


def donated(tree):
    return [a.is_deleted() for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)]


def main():
    # classes defined in a function: a step's output holds the class its input held
    class Model(eqx.Module):
        buffer: jax.Array
        mlp: eqx.nn.MLP  # holds equinox's final activation, a lambda

        @eqx.filter_jit(donate="all")
        def step(self, x):
            TRACE()
            return self.mlp(x), eqx.tree_at(lambda s: s.buffer, self, self.buffer.at[0].add(1))

        def __call__(self, x):
            TRACE()
            return self.mlp(x) * SCALE, eqx.tree_at(lambda s: s.buffer, self,
                                                    self.buffer.at[0].add(1))

    m = Model(jnp.zeros(4), eqx.nn.MLP(3, 3, 4, 1, key=jax.random.key(0)))
    deleted = {}
    call("apply", eqx.filter_jit(apply), m.mlp, jnp.ones(3))
    _, m2 = call("method", m.step, jnp.ones(3))
    deleted["method"] = donated(m)
    out = call("instance", eqx.filter_jit(m2, donate="all"), jnp.ones(3))
    deleted["instance"] = donated(m2)
    m3 = out[1]
    # new buffers, one program
    call("instance_again", eqx.filter_jit(m3, donate="all"), jnp.ones(3))
    deleted["instance_again"] = donated(m3)
    m4 = Model(jnp.zeros(4), eqx.nn.MLP(3, 3, 4, 1, key=jax.random.key(1)))
    call("kiln_instance", kiln.filter_jit(m4, donate="all"), jnp.ones(3))
    deleted["kiln_instance"] = donated(m4)
    seen = {}
    for name, static in (("warn", 1), ("warn_verify", object())):  # object(): no digest
        def g(x, y, static=static):
            return unusable(x, y)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(name, eqx.filter_jit(g, donate="warn"), jnp.array(1.0), jnp.ones(10))
        seen[name] = sum("donated buffers were not usable" in str(w.message) for w in caught)
    reasons = kiln.stats().reasons
    report(deleted=deleted, warnings=seen, swap_verify=reasons.get("jit-swap-verify", 0),
           swap_kiln=reasons.get("jit-swap-kiln", 0))


main()
'''


@pytest.mark.slow
def test_equinox_filter_jit_under_the_swap_warm_starts_donates_and_never_goes_stale(
        tmp_path, xp):
    """``eqx.filter_jit`` under ``kiln run --jit``: its statics (the user's function, an MLP's
    lambda, a Module class defined in a function) are keyed by value and code, so a warm start
    traces nothing (before: the verify path, "static argument static (tuple) has no canonical
    digest"); a step returning a Module of a local class is stored (before: not stored, a
    KilnWarning); ``filter_jit(instance, donate="all")`` donates the instance's buffers as
    equinox does; jax's unused-donation warning is given once per process, warm too; an edit
    of what the trace read misses."""
    prog = xp.Program(tmp_path)
    prog.write("prog.py", EQX_PROG)
    plain = prog.run()  # python prog.py: equinox on jax.jit as JAX defines it
    cold = prog.run(main=KILN_RUN_JIT, env={"KILN_EXPLAIN": "1"})
    warm = prog.run(main=KILN_RUN_JIT, env={"KILN_EXPLAIN": "1"})
    names = list(plain.results)
    assert names == ["apply", "method", "instance", "instance_again", "kiln_instance", "warn",
                     "warn_verify"]
    for run in (cold, warm):
        for name in names:
            assert run[name]["leaves"] == plain[name]["leaves"], (name, run[name])
            assert run[name]["tree"] == plain[name]["tree"], name
        assert run.extra["deleted"] == plain.extra["deleted"]
        assert run.extra["warnings"] == plain.extra["warnings"] == {"warn": 1, "warn_verify": 1}
    deleted = plain.extra["deleted"]
    assert all(all(v) and v for v in deleted.values()), deleted  # every buffer donated

    fast = ("apply", "method", "instance", "kiln_instance", "warn")
    for name in fast:
        xp.assert_cold(cold[name])
        xp.assert_warm(warm[name])
    # a new instance of the same structure: equinox's jax.jit and its static argument are the
    # first one's, so this process's executable runs (no trace, no store read)
    for run in (cold, warm):
        rec = run["instance_again"]
        assert (rec["misses"], rec["py_traces"], rec["compiles"]) == (0, 0, 0), rec
    xp.assert_warm_verified(warm["warn_verify"])  # object(): no digest, the verify path
    assert (cold.extra["swap_verify"], warm.extra["swap_verify"]) == (1, 1)

    # never stale: what the traces read, edited
    prog.edit("prog.py", "SCALE = 2.0", "SCALE = 3.0")
    edited = prog.run(main=KILN_RUN_JIT)
    for name in ("apply", "instance", "kiln_instance"):
        assert edited[name]["misses"] == 1 and edited[name]["py_traces"] == 1, name
        assert edited[name]["leaves"] != plain[name]["leaves"], name
    xp.assert_same_key(edited["warn"])  # reads no SCALE (its file was edited: verified once)
    prog.edit("prog.py", "return self.mlp(x), eqx.tree_at", "return -self.mlp(x), eqx.tree_at")
    edited = prog.run(main=KILN_RUN_JIT)
    assert edited["method"]["misses"] == 1 and edited["method"]["py_traces"] == 1
    assert edited["method"]["leaves"][0] == [-v for v in plain["method"]["leaves"][0]]
