"""Warm starts: a fresh process runs stored executables with zero traces, lowerings and compiles.

Process A fills the store (cold), process B (same files, fresh interpreter) must run every
function without tracing, lowering or compiling -- counted by kiln and, independently, by jax's
own monitoring events -- and give the same results, including host callbacks
(``jax.debug.print``, ``jax.pure_callback``, ``equinox.error_if``), loops, LAPACK-backed linear
algebra (jax-ml/jax #28908), ``precompile`` from ``ShapeDtypeStruct`` and pytree outputs.
See ``Program`` in ``conftest.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROG = '''\
import dataclasses
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kiln


@kiln.jit
def plain(x):
    TRACE()
    return jnp.sin(x) * 2


@kiln.jit
def debug_print(x):
    TRACE()
    jax.debug.print("kiln-debug-print sum={s}", s=x.sum())
    return x + 1


def host_square(x):
    return np.asarray(np.asarray(x) ** 2, dtype=np.float32)


@kiln.jit
def pure_cb(x):
    TRACE()
    return jax.pure_callback(host_square, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1


@kiln.jit
def error_if(x):
    TRACE()
    return eqx.error_if(x, x < 0, "kiln-negative-input") * 2


def _cond(c):
    return c[1] < 5


def _double(c):
    return c[0] * 2, c[1] + 1


@kiln.jit
def while_loop(x):
    TRACE()
    return jax.lax.while_loop(_cond, _double, (x, 0))[0]


def _body(i, c):
    return c + i * c


@kiln.jit
def fori_loop(x):
    TRACE()
    return jax.lax.fori_loop(0, 4, _body, x)


def _step(c, x):
    return c + x, c * x


@kiln.jit
def scan(xs):
    TRACE()
    return jax.lax.scan(_step, jnp.float32(0), xs)


@kiln.jit
def precompiled(x, y):
    TRACE()
    return x @ y


class Affine(eqx.Module):
    w: jax.Array
    b: jax.Array


@kiln.jit
def returns_module(x, *, scale, shift=1.0):
    TRACE()
    return Affine(x * scale, x + shift)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    y: jax.Array
    t: jax.Array


@kiln.jit
def returns_dataclass(state, *, dt):
    TRACE()
    return State(state.y + dt * state.t, state.t + dt)


class Tagged(eqx.Module):
    y: jax.Array
    tag: str = eqx.field(static=True)


@kiln.jit
def returns_module_static_field(x):
    TRACE()
    return Tagged(x * 2, "tagged")


@kiln.jit
def local_lambda(x):
    TRACE()
    return jax.tree.map(lambda a: a * 2, x)


x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
bad = np.array([1.0, -2.0, 3.0], dtype=np.float32)
m = np.arange(6, dtype=np.float32).reshape(2, 3)
n = np.arange(12, dtype=np.float32).reshape(3, 4)
cold = sys.argv[1] == "cold"
call("plain", plain, x)
call("debug_print", debug_print, x)
call("pure_cb", pure_cb, x)
call("error_if", error_if, x)
call("error_if:bad", error_if, bad)
call("while_loop", while_loop, x)
call("fori_loop", fori_loop, x)
call("scan", scan, x)
if cold:
    sds = (jax.ShapeDtypeStruct((2, 3), np.float32), jax.ShapeDtypeStruct((3, 4), np.float32))
    call("precompile", precompiled.precompile, *sds)
else:
    call("precompiled", precompiled, m, n)
call("returns_module", returns_module, x, scale=np.float32(3.0))
call("returns_dataclass", returns_dataclass, State(x, x * 0), dt=np.float32(0.5))
call("returns_module_static_field", returns_module_static_field, x)
call("local_lambda", local_lambda, x)
report()
'''

LINALG = '''\
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kiln


@kiln.jit
def inv(a):
    TRACE()
    return jnp.linalg.inv(a)


@kiln.jit
def cholesky(a):
    TRACE()
    return jnp.linalg.cholesky(a)


@kiln.jit
def svd(a):
    TRACE()
    return jnp.linalg.svd(a, compute_uv=False)


@kiln.jit
def eigh(a):
    TRACE()
    return jnp.linalg.eigh(a)[0]


@kiln.jit
def solve(a, b):
    TRACE()
    return jnp.linalg.solve(a, b)


rng = np.random.default_rng(0)
g = rng.standard_normal((5, 5)).astype(np.float32)
a = (g @ g.T + 5 * np.eye(5)).astype(np.float32)
b = rng.standard_normal(5).astype(np.float32)
# argv: the functions to call (each warm process calls one, so it is the first LAPACK use)
for name in sys.argv[1:]:
    fn = globals()[name]
    call(name, fn, a, b) if name == "solve" else call(name, fn, a)
report(a=a.tolist(), b=b.tolist())
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    prog = xp.Program(tmp_path_factory.mktemp("warm"))
    prog.write("prog.py", PROG)
    return {"A": prog.run("cold"), "B": prog.run("warm")}


LINALG_FUNCTIONS = ["inv", "cholesky", "svd", "eigh", "solve"]


@pytest.fixture(scope="module")
def linalg(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    """A: one cold process compiles all; then one fresh warm process per function (a crash
    there is recorded as an AssertionError carrying the exit code, not raised here)."""
    prog = xp.Program(tmp_path_factory.mktemp("linalg"))
    prog.write("prog.py", LINALG)
    out: dict[str, Any] = {"A": prog.run(*LINALG_FUNCTIONS)}
    for name in LINALG_FUNCTIONS:
        try:
            out[name] = prog.run(name)
        except AssertionError as e:
            out[name] = e
    return out


X = np.array([1.0, 2.0, 3.0], dtype=np.float32)

EXPECT = {
    "plain": [np.sin(X) * 2],
    "debug_print": [X + 1],
    "pure_cb": [X**2 + 1],
    "error_if": [X * 2],
    "while_loop": [X * 32],
    "fori_loop": [X * 1 * 2 * 3 * 4],
    "scan": [X.sum(), np.array([0.0, 2.0, 9.0])],
    "returns_module": [X * 3, X + 1],
    "returns_dataclass": [X, np.full(3, 0.5)],
    "returns_module_static_field": [X * 2],
    "local_lambda": [X * 2],
}
# Fixed, kept as regression tests: returns_module, returns_module_static_field, local_lambda.
WARM_BUGS: dict[str, str] = {}


def _check(rec: dict[str, Any], want: list[Any]) -> None:
    assert "error" not in rec, rec["error"]
    assert len(rec["leaves"]) == len(want), rec
    for got, w in zip(rec["leaves"], want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-6)


def _params() -> list[Any]:
    return [
        pytest.param(
            name,
            marks=(pytest.mark.xfail(strict=True, reason=WARM_BUGS[name]),)
            if name in WARM_BUGS else (),
        )
        for name in EXPECT
    ]


@pytest.mark.parametrize("name", _params())
def test_warm_start_round_trip(runs: dict[str, Any], xp: Any, name: str) -> None:
    a, b = runs["A"][name], runs["B"][name]
    xp.assert_cold(a)
    _check(a, EXPECT[name])
    xp.assert_warm(b)
    _check(b, EXPECT[name])
    assert b["tree"] == a["tree"]


def test_outputs_keep_their_pytree_types(runs: dict[str, Any]) -> None:
    b = runs["B"]
    assert b["returns_dataclass"].get("type") == "State", b["returns_dataclass"]
    assert b["scan"].get("type") == "tuple", b["scan"]


def test_equinox_module_output_type(runs: dict[str, Any]) -> None:
    assert runs["B"]["returns_module"].get("type") == "Affine", runs["B"]["returns_module"]


def test_debug_print_prints_in_the_warm_process(runs: dict[str, Any]) -> None:
    for run in (runs["A"], runs["B"]):
        assert "kiln-debug-print sum=6" in run.stdout


def test_equinox_runtime_error_raised_by_the_warm_process(runs: dict[str, Any]) -> None:
    """The stored executable keeps equinox's error check: bad input raises, with the message."""
    for run in (runs["A"], runs["B"]):
        rec = run["error_if:bad"]
        assert "error" in rec, rec
        assert "kiln-negative-input" in rec["error"]
        assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec  # same executable
        assert rec["py_traces"] == 0, rec


def test_precompile_from_shape_dtype_struct(runs: dict[str, Any], xp: Any) -> None:
    """precompile(ShapeDtypeStruct...) in A; real arrays in B: a hit with zero traces."""
    pre = runs["A"]["precompile"]
    assert "error" not in pre, pre["error"]
    assert pre["misses"] == 1 and pre["compiles"] == 1 and pre["stores_written"] >= 1, pre
    rec = runs["B"]["precompiled"]
    xp.assert_warm(rec)
    m = np.arange(6, dtype=np.float32).reshape(2, 3)
    n = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(xp.value(rec), m @ n)




@pytest.mark.parametrize("name", LINALG_FUNCTIONS)
def test_linalg_executables_load_in_a_fresh_process(
    linalg: dict[str, Any], xp: Any, name: str
) -> None:
    """LAPACK-backed executables loaded in a fresh process run and are right (jax #28908)."""
    a = np.array(linalg["A"].extra["a"], dtype=np.float64)
    b = np.array(linalg["A"].extra["b"], dtype=np.float64)
    want = {
        "inv": np.linalg.inv(a),
        "cholesky": np.linalg.cholesky(a),
        "svd": np.linalg.svd(a, compute_uv=False),
        "eigh": np.linalg.eigh(a)[0],
        "solve": np.linalg.solve(a, b),
    }[name]
    warm_run = linalg[name]
    if isinstance(warm_run, AssertionError):
        raise warm_run
    cold, warm = linalg["A"][name], warm_run[name]
    xp.assert_cold(cold)
    xp.assert_warm(warm)
    for rec in (cold, warm):
        np.testing.assert_allclose(xp.value(rec), want, rtol=1e-4, atol=1e-5)
