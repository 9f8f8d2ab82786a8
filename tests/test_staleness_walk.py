"""Code and data a trace uses that the walk once did not reach.

Across real processes sharing one store (``Program`` in ``conftest.py``), as in
``test_staleness.py``: A compiles, B loads with zero traces, the edits, C returns the NEW
value, equal to plain ``jax.jit``'s in a fresh process (C_jax), D (edits undone) the
original one. One function per scenario, all in one program (process starts are the cost):

- a dataclass field's metadata read while tracing (``__dataclass_fields__``: dunder data);
- a custom primitive's lowering rule, and a rule registered for one of jax's primitives;
- ``from . import consts`` and the other relative imports inside a function of a package,
  of a module loaded before the trace and of one the trace imports;
- an ``np.frompyfunc`` ufunc's and an ``np.vectorize``'s Python function;
- a flax config flag that flax's own code reads while tracing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

X = [1.0, 2.0, 3.0]  # the argument of every function (float32)


@dataclass(frozen=True)
class Scenario:
    name: str  # the probe name and the function in prog.py
    edits: tuple[tuple[str, str, str], ...]  # (file, old, new)
    before: Any  # the value before the edits; None: only compared with plain jax.jit's
    after: Any
    kind: str = "fingerprint"  # "fingerprint": D hits the first entry again; "manifest": the
    # entry under the same key was replaced in C, so D recompiles


def _x(f: Any) -> list[float]:
    return [float(f(v)) for v in X]


SCENARIOS = [
    Scenario("field_metadata", (("prog.py", '{"scale": 2.0}', '{"scale": 3.0}'),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("field_default_factory", (("prog.py", "lambda: [4.0]", "lambda: [5.0]"),),
             _x(lambda v: v + 4), _x(lambda v: v + 5)),
    Scenario("custom_lowering", (("prims.py", "y * 2.0  # lowering", "y * 3.0  # lowering"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("custom_jvp_rule", (("prims.py", "g * 10.0  # jvp", "g * 20.0  # jvp"),),
             _x(lambda v: 10.0), _x(lambda v: 20.0)),
    Scenario("override_lowering", (("prims.py", "y * 4.0  # cbrt", "y * 5.0  # cbrt"),),
             _x(lambda v: v * 4), _x(lambda v: v * 5), kind="manifest"),
    Scenario("relative_loaded", (("rpkg/consts.py", "RATE = 2.0", "RATE = 3.0"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("relative_lazy", (("rpkg/lazyc.py", "RATE = 2.0", "RATE = 3.0"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3), kind="manifest"),
    Scenario("relative_from_sub", (("rpkg/sub.py", "FACTOR = 2.0", "FACTOR = 3.0"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("relative_parent", (("rpkg/parentc.py", "UP = 2.0", "UP = 3.0"),),
             _x(lambda v: v + 2), _x(lambda v: v + 3)),
    Scenario("frompyfunc", (("prog.py", "a * 2.0  # frompyfunc", "a * 3.0  # frompyfunc"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("vectorize", (("prog.py", "a * 2.0  # vectorize", "a * 3.0  # vectorize"),),
             _x(lambda v: v * 2), _x(lambda v: v * 3)),
    Scenario("flax_config", (("prog.py", '"flax_fix_rng_separator", False',
                              '"flax_fix_rng_separator", True'),), None, None),
]

PRIMS = '''\
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

# a custom primitive: impl, abstract eval, lowering
double_p = Primitive("kiln_test_double")
double_p.def_impl(lambda x: x * 2.0)
double_p.def_abstract_eval(lambda x: x)


def _double_lowering(ctx, x):
    return mlir.lower_fun(lambda y: y * 2.0  # lowering
                          , multiple_results=False)(ctx, x)


mlir.register_lowering(double_p, _double_lowering)


def double(x):
    return double_p.bind(x)


# a custom primitive with a JVP rule (its derivative is what is computed)
ident_p = Primitive("kiln_test_ident")
ident_p.def_impl(lambda x: x)
ident_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(ident_p, mlir.lower_fun(lambda y: y, multiple_results=False))


def _ident_jvp(primals, tangents):
    (x,), (g,) = primals, tangents
    return ident_p.bind(x), g * 10.0  # jvp


ad.primitive_jvps[ident_p] = _ident_jvp


def ident(x):
    return ident_p.bind(x)


# a rule registered for one of jax's own primitives: reached by no user code at all
def _cbrt_lowering(ctx, x, **params):
    return mlir.lower_fun(lambda y: y * 4.0  # cbrt
                          , multiple_results=False)(ctx, x)


mlir.register_lowering(lax.cbrt_p, _cbrt_lowering)
'''

PROG = '''\
import dataclasses
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kiln
import prims
import rpkg.consts  # noqa: F401 - loaded before the walk (rpkg.lazyc is not)
import rpkg.parentc  # noqa: F401
import rpkg.sub  # noqa: F401
from rpkg import mod as rmod
from rpkg.inner import deep

flax.config.update("flax_fix_rng_separator", False)

jit = jax.jit if sys.argv[1:] == ["jax"] else kiln.jit


@dataclasses.dataclass(frozen=True)
class MetaCfg:
    a: float = dataclasses.field(default=1.0, metadata={"scale": 2.0})


CFG = MetaCfg()


@dataclasses.dataclass(frozen=True)
class FactoryCfg:
    b: list = dataclasses.field(default_factory=lambda: [4.0])


@jit
def field_metadata(x):
    TRACE()
    return x * dataclasses.fields(CFG)[0].metadata["scale"]


@jit
def field_default_factory(x):
    TRACE()
    return x + dataclasses.fields(FactoryCfg)[0].default_factory()[0]


@jit
def custom_lowering(x):
    TRACE()
    return prims.double(x)


@jit
def custom_jvp_rule(x):
    TRACE()
    return jax.grad(lambda v: prims.ident(v).sum())(x)


@jit
def override_lowering(x):
    TRACE()
    return jnp.cbrt(x)


@jit
def relative_loaded(x):
    TRACE()
    return rmod.rel_loaded(x)


@jit
def relative_lazy(x):
    TRACE()
    return rmod.rel_lazy(x)


@jit
def relative_from_sub(x):
    TRACE()
    return rmod.rel_from_sub(x)


@jit
def relative_parent(x):
    TRACE()
    return deep.rel_parent(x)


UF = np.frompyfunc(lambda a: a * 2.0  # frompyfunc
                   , 1, 1)


@jit
def frompyfunc(x):
    TRACE()
    return x * np.float32(UF(1.0))


VF = np.vectorize(lambda a: a * 2.0  # vectorize
                  )


@jit
def vectorize(x):
    TRACE()
    return x * np.float32(VF(1.0))


@jit
def flax_config(x):
    TRACE()
    params = nn.Dense(3).init(jax.random.key(0), x[None, :])
    return x * params["params"]["kernel"].sum()


@jit
def control(x):
    TRACE()
    return x - 1.0


x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
for name in NAMES:
    call(name, globals()[name], x)
report()
'''

FILES = {
    "prims.py": PRIMS,
    "rpkg/__init__.py": "",
    "rpkg/consts.py": "RATE = 2.0\n",
    "rpkg/lazyc.py": "RATE = 2.0\n",
    "rpkg/sub.py": "FACTOR = 2.0\n",
    "rpkg/parentc.py": "UP = 2.0\n",
    "rpkg/mod.py": (
        "def rel_loaded(x):\n    from . import consts\n\n    return x * consts.RATE\n\n\n"
        "def rel_lazy(x):\n    from . import lazyc\n\n    return x * lazyc.RATE\n\n\n"
        "def rel_from_sub(x):\n    from .sub import FACTOR\n\n    return x * FACTOR\n"
    ),
    "rpkg/inner/__init__.py": "",
    "rpkg/inner/deep.py": (
        "def rel_parent(x):\n    from .. import parentc\n\n    return x + parentc.UP\n"
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    """A (cold), B (warm), C (all edits), C_jax (plain jax.jit, edited), D (edits undone)."""
    prog = xp.Program(tmp_path_factory.mktemp("walk"))
    names = [s.name for s in SCENARIOS] + ["control"]
    prog.write("prog.py", f"NAMES = {json.dumps(names)}\n" + PROG)
    for name, text in FILES.items():
        prog.write(name, text)
    out = {"A": prog.run(), "A_jax": prog.run("jax"), "B": prog.run()}
    for s in SCENARIOS:
        for file, old, new in s.edits:
            prog.edit(file, old, new)
    out["C"], out["C_jax"] = prog.run(), prog.run("jax")
    for s in SCENARIOS:
        for file, old, new in s.edits:
            prog.edit(file, new, old)
    out["D"] = prog.run()
    return out


@pytest.mark.parametrize("s", [pytest.param(s, id=s.name) for s in SCENARIOS])
def test_edit_gives_the_new_value(runs: dict[str, Any], xp: Any, s: Scenario) -> None:
    a, a_jax, b, c, c_jax, d = (runs[k][s.name] for k in ("A", "A_jax", "B", "C", "C_jax", "D"))
    xp.assert_cold(a)
    xp.assert_warm(b)  # unchanged: no trace, no compile
    before, after = xp.value(a_jax), xp.value(c_jax)
    assert before != after  # the edit changes what plain jax.jit computes
    if s.before is not None:
        np.testing.assert_allclose(before, s.before)
        np.testing.assert_allclose(after, s.after)
    for rec in (a, b, d):
        np.testing.assert_allclose(xp.value(rec), before)
    # C: the new value, from a recompile (never the stored executable)
    np.testing.assert_allclose(xp.value(c), after)
    assert c["misses"] == 1 and c["hits"] == 0 and c["compiles"] == 1, c
    assert c["py_traces"] >= 1, c
    if s.kind == "fingerprint":
        xp.assert_warm(d)  # edits undone: the first entry again


def test_control_still_hits_after_unrelated_edits(runs: dict[str, Any], xp: Any) -> None:
    """Its key holds through every edit; C's edits are inputs of its guard: verified once,
    never compiled; D, every edit undone, warm."""
    for run in "BCD":
        (xp.assert_same_key if run == "C" else xp.assert_warm)(runs[run]["control"])
        np.testing.assert_allclose(xp.value(runs[run]["control"]), [0.0, 1.0, 2.0])


def test_no_kiln_warnings_and_no_bad_entries(runs: dict[str, Any]) -> None:
    for name, run in runs.items():
        assert "KilnWarning" not in run.stderr, (name, run.stderr[-2000:])
        assert run.stats["bad_entries"] == 0, (name, run.stats)
