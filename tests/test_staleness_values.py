"""Never stale, by construction: values a function reaches through library objects, static
arguments, lazy imports, patches and hidden state (reproducers of stale results, and more).

Each scenario is a function of one program run in fresh processes sharing a store (see
``Program`` in ``conftest.py``), called twice per run: through ``kiln.jit`` and through plain
``jax.jit`` of the same Python function. The reference is always plain ``jax.jit`` in the same
process, so "the right value" needs no hand-computed expectation:

- A (cold store), B (warm), Bv (warm, ``KILN_VERIFY=1``): kiln equals jax; B hits with no trace;
- C (every edit applied, another ``PYTHONHASHSEED``): kiln equals jax, and jax's value differs
  from A's (the edit matters), so a hit on A's entry would be caught;
- D (edits undone, the first seed again): kiln equals jax and hits again.

``control_*`` functions depend on nothing that is edited; they must hit in C too, although C
runs with another hash seed (no key part may depend on ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Scenario:
    name: str  # the probe name and the function pair in prog.py
    edits: tuple[tuple[str, str, str], ...]  # (file, old, new); () for env-only changes
    # how an unchanged program starts warm: "fingerprint", B and D hit with no trace;
    # "manifest", B does (D follows C's entry under the same key); "verify", traced, no compile
    warm: str = "fingerprint"
    # the oldest Python on which kiln sees the edit (3.12: sys.monitoring records every
    # function that ran while tracing; 3.11 records those that emitted equations)
    python: tuple[int, int] = (3, 11)


SCENARIOS = [
    # library objects built at module level hold their parameters in closure cells
    Scenario("optax_sgd_lr", (("prog.py", "optax.sgd(0.1)  # opt", "optax.sgd(0.5)  # opt"),)),
    Scenario("optax_adam_to_sgd",
             (("prog.py", "optax.adam(0.1)  # opt2", "optax.sgd(0.1)  # opt2"),)),
    Scenario("optax_schedule", (("prog.py", "linear_schedule(1.0,", "linear_schedule(2.0,"),)),
    Scenario("initializer_default", (("prog.py", "constant(2.0)", "constant(3.0)"),)),
    # library functions and types held as values are identified by name
    Scenario("conf_activation", (("conf.py", "ACT = jax.nn.relu\n", "ACT = jax.nn.relu6\n"),)),
    Scenario("conf_dtype",
             (("conf.py", "COMPUTE_DTYPE = jnp.float32", "COMPUTE_DTYPE = jnp.bfloat16"),)),
    Scenario("default_reduce", (("prog.py", "reduce=jnp.mean", "reduce=jnp.sum"),)),
    Scenario("closure_factory", (("prog.py", "make_step(jnp.tanh)", "make_step(jnp.sin)"),)),
    Scenario("eqx_static_field",
             (("prog.py", "Act(jnp.ones(3), jax.nn.relu)", "Act(jnp.ones(3), jax.nn.relu6)"),)),
    # transformations and partials wrap what they are given
    Scenario("grad_partial", (("prog.py", "partial(loss, reg=0.5)", "partial(loss, reg=2.0)"),)),
    Scenario("grad_closure", (("prog.py", "make_loss(0.5)", "make_loss(2.0)"),)),
    Scenario("vmap_partial_global",
             (("prog.py", "partial(h, scale=2.0)", "partial(h, scale=3.0)"),)),
    Scenario("jit_partial_global", (("prog.py", "partial(h2, k=2.0)", "partial(h2, k=5.0)"),)),
    # modules imported while tracing
    # (the key is taken before the trace imports the module, so the edited and the original
    # program share a key, and D recompiles once more: "manifest", as in test_staleness.py)
    Scenario("lazy_from_import", (("lazy_a.py", "SCALE = 2.0", "SCALE = 3.0"),), "manifest"),
    Scenario("lazy_import_attribute", (("lazy_b.py", "SCALE = 2.0", "SCALE = 3.0"),),
             "manifest"),
    Scenario("lazy_importlib", (("lazy_c.py", "SCALE = 2.0", "SCALE = 3.0"),), "manifest"),
    Scenario("module_getattr", (("lazyattr.py", "return 2.0", "return 3.0"),)),
    # static arguments: their methods, class variables and code
    Scenario("static_dataclass_method",
             (("cfgs.py", "return self.base * 2", "return self.base * 3"),)),
    Scenario("static_classvar", (("cfgs.py", "SCALE: ClassVar[float] = 2.0",
                                  "SCALE: ClassVar[float] = 4.0"),)),
    Scenario("static_function", (("prog.py", "return 0.1  # lr", "return 0.2  # lr"),)),
    Scenario("static_callback_main", (("prog.py", "2.0  # cb", "3.0  # cb"),)),
    # pytree node registrations of the argument types
    Scenario("pytree_unflatten", (("pairs.py", "return Pair(children[0], children[1])",
                                   "return Pair(children[1], children[0])"),)),
    # patches of library names by a module imported at start
    Scenario("patched_library_name", (("patch_a.py", "jnp.cosh = fake_a", "jnp.cosh = fake_b"),)),
    Scenario("patched_library_lambda", (("patch_b.py", "# no patch", "jnp.sinh = lambda x: x"),)),
    # code exec'd into a fresh namespace (a notebook cell runner)
    Scenario("exec_cell", (("prog.py", "x * 2.0  # cell h", "x * 5.0  # cell h"),)),
    # hidden state read while tracing
    # (numpy's global generator is keyed by the state the trace drew from, a manifest item:
    # the seed-1 entry of C replaces the seed-0 one under the same key, and D recompiles once
    # more, as for the other manifest items)
    Scenario("numpy_global_seed", (("prog.py", "np.random.seed(0)", "np.random.seed(1)"),),
             "manifest"),
    Scenario("set_iteration", ()),  # C runs with another PYTHONHASHSEED
    Scenario("dict_order", (("prog.py", 'ORDER = {"a": 1.0, "b": 2.0}',
                             'ORDER = {"b": 2.0, "a": 1.0}'),)),
    # found by a breaking session: values inside dataclasses and enums, dunder methods,
    # descriptors, metaclasses, attributes of functions and instances, literal getattr names
    Scenario("dataclass_function_field",
             (("gaps.py", "return 2.0  # scale", "return 3.0  # scale"),)),
    Scenario("static_dataclass_function_field",
             (("gaps.py", "return 2.0  # static scale", "return 3.0  # static scale"),)),
    Scenario("dataclass_partial_field", (("gaps.py", "return 2.0 * k", "return 3.0 * k"),)),
    Scenario("dataclass_class_field", (("gaps.py", "K = 2.0  # act", "K = 3.0  # act"),)),
    Scenario("enum_partial_value", (("gaps.py", "return 2.0  # enum", "return 3.0  # enum"),)),
    Scenario("dunder_getitem", (("gaps.py", "self.vals[i] * 2", "self.vals[i] * 3"),)),
    Scenario("descriptor_get", (("gaps.py", "return self.v * 2", "return self.v * 3"),)),
    Scenario("metaclass_property", (("gaps.py", "return 2.0  # meta", "return 3.0  # meta"),)),
    Scenario("function_attribute", (("gaps.py", "helper.K = 2.0", "helper.K = 3.0"),)),
    Scenario("instance_extra_attribute", (("gaps.py", "CFG_X.extra = 2.0", "CFG_X.extra = 3.0"),)),
    Scenario("getattr_literal", (("gaps.py", "SCALE_G = 2.0", "SCALE_G = 3.0"),)),
    # a function reached through a computed name, returning a constant (no equation of its
    # own): in the manifest on Python 3.12+ (every function that ran while tracing); on 3.11
    # its file is an input of the guard (verified, another program: compiled)
    Scenario("computed_name", (("ops.py", "return 2.0", "return 3.0"),), "manifest"),
]

CONTROLS = ["control_frozenset_constant", "control_int_set", "control_library_calls"]

PROG = '''\
import functools
import importlib
from functools import partial
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kiln
import patch_a
import patch_b
import conf
import gaps
import lazyattr
import ops
from cfgs import Cfg, CfgVar
from pairs import Pair

np.random.seed(0)

PAIRS = []  # (name, function, args, static kwargs)


def pair(name, fn, *args, static=(), **kwargs):
    PAIRS.append((name, fn, args, kwargs, static))


X = np.array([1.0, 2.0, 3.0], dtype=np.float32)

opt = optax.sgd(0.1)  # opt
opt2 = optax.adam(0.1)  # opt2


def optax_sgd_lr(x):
    updates, _ = opt.update(x, opt.init(x))
    return x + updates


def optax_adam_to_sgd(x):
    updates, _ = opt2.update(x, opt2.init(x))
    return x + updates


sched = optax.linear_schedule(1.0, 0.0, 10)


def optax_schedule(x):
    return x * sched(3)


def initializer_default(x, init=jax.nn.initializers.constant(2.0)):
    return x * init(jax.random.PRNGKey(0), (3,), jnp.float32)


def conf_activation(x):
    return conf.ACT(x * 4.0 - 2.0)


def conf_dtype(x):
    return (x / 3.0).astype(conf.COMPUTE_DTYPE).astype(jnp.float32)


def default_reduce(x, reduce=jnp.mean):
    return reduce(x) * x


def make_step(act):
    def step(x):
        return act(x)

    return step


closure_factory = make_step(jnp.tanh)


class Act(eqx.Module):
    w: jax.Array
    act: Callable = eqx.field(static=True)

    def __call__(self, x):
        return self.act(self.w * x * 4.0 - 2.0)


ACT_MODEL = Act(jnp.ones(3), jax.nn.relu)


def eqx_static_field(m, x):
    return m(x)


def loss(x, reg):
    return jnp.sum(x ** 2) * reg


grad_partial = jax.grad(partial(loss, reg=0.5))


def make_loss(reg):
    def l(x):
        return jnp.sum(x ** 2) * reg

    return l


grad_closure = jax.grad(make_loss(0.5))


def h(x, scale):
    return x * scale


vh = jax.vmap(partial(h, scale=2.0))


def vmap_partial_global(x):
    return vh(x) + 1.0


def h2(x, k):
    return x - k


hj = jax.jit(partial(h2, k=2.0))


def jit_partial_global(x):
    return hj(x) * 2.0


def lazy_from_import(x):
    from lazy_a import SCALE

    return x * SCALE


def lazy_import_attribute(x):
    import lazy_b

    return x * lazy_b.SCALE


def lazy_importlib(x):
    return x * importlib.import_module("lazy_c").SCALE


def module_getattr(x):
    return x * lazyattr.GAIN


def static_dataclass_method(x, cfg):
    return x * cfg.factor()


def static_classvar(x, cfg):
    return x * cfg.scaled()


def lr():
    return 0.1  # lr


def static_function(x, lr):
    return x * lr()


def cb(x):
    return np.asarray(np.asarray(x) * 2.0  # cb
                      , dtype=np.float32)


def static_callback_main(x, cb):
    return jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def pytree_unflatten(p):
    return p.a * 2.0 + p.b


def patched_library_name(x):
    return jnp.cosh(x)


def patched_library_lambda(x):
    return jnp.sinh(x) + 1.0


CELL = """
import jax


def h(x):
    return x * 2.0  # cell h


vh = jax.vmap(h)


def f(x):
    return vh(x) + 1.0
"""
ns = {}
exec(compile(CELL, "<cell>", "exec"), ns)
exec_cell = ns["f"]


def numpy_global_seed(x):
    return x + np.random.randn(3).astype(np.float32)


NAMES = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}


def set_iteration(x):
    out = x
    for i, n in enumerate(NAMES):
        out = out * (i + 1) + len(n)
    return out


ORDER = {"a": 1.0, "b": 2.0}


def dict_order(x):
    return x * list(ORDER.values())[0]


def dataclass_function_field(x):
    return x * gaps.CFG_FN.fn()


def static_dataclass_function_field(x, cfg):
    return x * cfg.fn()


def dataclass_partial_field(x):
    return x * gaps.CFG_P.fn()


def dataclass_class_field(x):
    return x * gaps.CFG_C.fn.K


def enum_partial_value(x):
    return x * gaps.Mode.A.value[1]()


def dunder_getitem(x):
    return x * gaps.TAB[0]


def descriptor_get(x):
    return x * gaps.WithConst.k


def metaclass_property(x):
    return x * gaps.MetaCfg.scale


def function_attribute(x):
    return gaps.helper(x) * gaps.helper.K


def instance_extra_attribute(x):
    return x * gaps.CFG_X.extra


def getattr_literal(x):
    return x * getattr(gaps, "SCALE_G")


def computed_name(x):
    return x * getattr(ops, "fac" + "tor")()


def control_frozenset_constant(x):
    total = x
    for n in ("a", "b", "c"):
        if n in {"a", "c", "q"}:
            total = total + 1.0
    return total


INTS = {3, 1, 2}


def control_int_set(x):
    return x * sorted(INTS)[0] + sum(INTS)


def control_library_calls(x):
    return jnp.tanh(jax.nn.relu(x)) + jnp.mean(x)


pair("optax_sgd_lr", optax_sgd_lr, X)
pair("optax_adam_to_sgd", optax_adam_to_sgd, X)
pair("optax_schedule", optax_schedule, X)
pair("initializer_default", initializer_default, X)
pair("conf_activation", conf_activation, X)
pair("conf_dtype", conf_dtype, X)
pair("default_reduce", default_reduce, X)
pair("closure_factory", closure_factory, X)
pair("eqx_static_field", eqx_static_field, ACT_MODEL, X)
pair("grad_partial", grad_partial, X)
pair("grad_closure", grad_closure, X)
pair("vmap_partial_global", vmap_partial_global, X)
pair("jit_partial_global", jit_partial_global, X)
pair("lazy_from_import", lazy_from_import, X)
pair("lazy_import_attribute", lazy_import_attribute, X)
pair("lazy_importlib", lazy_importlib, X)
pair("module_getattr", module_getattr, X)
pair("static_dataclass_method", static_dataclass_method, X, cfg=Cfg(1.5), static=("cfg",))
pair("static_classvar", static_classvar, X, cfg=CfgVar(1.5), static=("cfg",))
pair("static_function", static_function, X, lr=lr, static=("lr",))
pair("static_callback_main", static_callback_main, X, cb=cb, static=("cb",))
pair("pytree_unflatten", pytree_unflatten, Pair(X, X * 10))
pair("patched_library_name", patched_library_name, X)
pair("patched_library_lambda", patched_library_lambda, X)
pair("exec_cell", exec_cell, X)
pair("numpy_global_seed", numpy_global_seed, X)
pair("set_iteration", set_iteration, X)
pair("dict_order", dict_order, X)
pair("dataclass_function_field", dataclass_function_field, X)
pair("static_dataclass_function_field", static_dataclass_function_field, X,
     cfg=gaps.Cfg(gaps.static_scale), static=("cfg",))
pair("dataclass_partial_field", dataclass_partial_field, X)
pair("dataclass_class_field", dataclass_class_field, X)
pair("enum_partial_value", enum_partial_value, X)
pair("dunder_getitem", dunder_getitem, X)
pair("descriptor_get", descriptor_get, X)
pair("metaclass_property", metaclass_property, X)
pair("function_attribute", function_attribute, X)
pair("instance_extra_attribute", instance_extra_attribute, X)
pair("getattr_literal", getattr_literal, X)
pair("computed_name", computed_name, X)
pair("control_frozenset_constant", control_frozenset_constant, X)
pair("control_int_set", control_int_set, X)
pair("control_library_calls", control_library_calls, X)

for name, fn, args, kwargs, static in PAIRS:
    state = np.random.get_state()  # trace-time draws: both calls see the same generator
    call(name, kiln.jit(fn, static_argnames=static), *args, **kwargs)
    np.random.set_state(state)
    call(name + ":jax", jax.jit(fn, static_argnames=static), *args, **kwargs)
report()
'''

GAPS = '''import dataclasses
import enum
import functools


@dataclasses.dataclass(frozen=True)
class Cfg:
    fn: object


def scale():
    return 2.0  # scale


def static_scale():
    return 2.0  # static scale


def mul(k):
    return 2.0 * k


class Act:
    K = 2.0  # act


CFG_FN = Cfg(scale)
CFG_P = Cfg(functools.partial(mul, k=1.0))
CFG_C = Cfg(Act)


def enum_c():
    return 2.0  # enum


class Mode(enum.Enum):
    A = (1, functools.partial(enum_c))


@dataclasses.dataclass(frozen=True)
class Table:
    vals: tuple

    def __getitem__(self, i):
        return self.vals[i] * 2


TAB = Table((1.0, 2.0))


@dataclasses.dataclass(frozen=True)
class Const:
    v: float

    def __get__(self, obj, typ=None):
        return self.v * 2


class WithConst:
    k = Const(1.0)


class Meta(type):
    @property
    def scale(cls):
        return 2.0  # meta


class MetaCfg(metaclass=Meta):
    pass


def helper(x):
    return x + 1.0


helper.K = 2.0


@dataclasses.dataclass
class Plain:
    n: int = 1


CFG_X = Plain()
CFG_X.extra = 2.0
SCALE_G = 2.0
'''

FILES = {
    "conf.py": "import jax\nimport jax.numpy as jnp\n\nACT = jax.nn.relu\n"
               "COMPUTE_DTYPE = jnp.float32\n",
    "lazy_a.py": "SCALE = 2.0\n",
    "ops.py": "def factor():\n    return 2.0\n",
    "gaps.py": GAPS,
    "lazy_b.py": "SCALE = 2.0\n",
    "lazy_c.py": "SCALE = 2.0\n",
    "lazyattr.py": "def __getattr__(name):\n    if name == 'GAIN':\n        return 2.0\n"
                   "    raise AttributeError(name)\n",
    "cfgs.py": (
        "from dataclasses import dataclass\nfrom typing import ClassVar\n\n\n"
        "@dataclass(frozen=True)\nclass Cfg:\n    base: float\n\n"
        "    def factor(self):\n        return self.base * 2\n\n\n"
        "@dataclass(frozen=True)\nclass CfgVar:\n    base: float\n"
        "    SCALE: ClassVar[float] = 2.0\n\n"
        "    def scaled(self):\n        return self.base * self.SCALE\n"
    ),
    "pairs.py": (
        "import jax\n\n\nclass Pair:\n    def __init__(self, a, b):\n"
        "        self.a, self.b = a, b\n\n\n"
        "def flatten(p):\n    return (p.a, p.b), None\n\n\n"
        "def unflatten(aux, children):\n    return Pair(children[0], children[1])\n\n\n"
        "jax.tree_util.register_pytree_node(Pair, flatten, unflatten)\n"
    ),
    "patch_a.py": (
        "import jax.numpy as jnp\n\n\ndef fake_a(x):\n    return x * 0.5\n\n\n"
        "def fake_b(x):\n    return x * 0.25\n\n\njnp.cosh = fake_a\n"
    ),
    "patch_b.py": "import jax.numpy as jnp\n\n# no patch\n",
}

SEED_A, SEED_C = "0", "1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    """A (cold), B (warm), Bv (warm, KILN_VERIFY=1), C (edits, another hash seed), D (undone)."""
    prog = xp.Program(tmp_path_factory.mktemp("values"))
    prog.base_env = {"PYTHONHASHSEED": SEED_A}
    prog.write("prog.py", PROG)
    for name, text in FILES.items():
        prog.write(name, text)
    out = {"A": prog.run(), "B": prog.run(), "Bv": prog.run(env={"KILN_VERIFY": "1"})}
    for s in SCENARIOS:
        for file, old, new in s.edits:
            prog.edit(file, old, new)
    out["C"] = prog.run(env={"PYTHONHASHSEED": SEED_C})
    for s in SCENARIOS:
        for file, old, new in s.edits:
            prog.edit(file, new, old)
    out["D"] = prog.run()
    return out


def _same_as_jax(run: Any, name: str) -> list[Any]:
    rec, ref = run[name], run[name + ":jax"]
    assert "error" not in rec, rec["error"]
    assert "error" not in ref, ref["error"]
    assert rec["dtypes"] == ref["dtypes"], (rec, ref)
    for got, want in zip(rec["leaves"], ref["leaves"], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return list(ref["leaves"])


def _cold(rec: dict[str, Any]) -> None:
    assert rec["misses"] == 1 and rec["hits"] == 0, rec
    assert rec["traces"] >= 1 and rec["compiles"] == 1 and rec["xla_compiles"] >= 1, rec


def _warm(rec: dict[str, Any]) -> None:
    """Loaded with no trace, lowering or compile (kiln's counters and jax's own events)."""
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["traces"] == 0 and rec["jax_traces"] == 0 and rec["jax_lowerings"] == 0, rec
    assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec


def _warm_verified(rec: dict[str, Any]) -> None:
    """A hit that traced and lowered (verify path, audit mode) and compiled nothing."""
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["traces"] >= 1 and rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_edit_gives_the_edited_programs_value(runs: dict[str, Any], s: Scenario) -> None:
    """Every run returns plain jax.jit's value; after the edit that value changed, and kiln
    did not serve the old program: it traced and missed (or, on the verify path, traced and
    found the lowered module it now builds)."""
    _cold(runs["A"][s.name])
    before = _same_as_jax(runs["A"], s.name)
    for k in ("B", "Bv", "D"):
        assert _same_as_jax(runs[k], s.name) == before, k
    if sys.version_info < s.python:
        pytest.skip(f"kiln sees this edit on Python {s.python} and later (docs/never-stale.md: "
                    "what kiln cannot see)")
    after = _same_as_jax(runs["C"], s.name)
    if s.name != "set_iteration":  # another seed may happen to keep the iteration order
        assert after != before, "the edit does not change the program: a useless scenario"
    if after != before:
        c = runs["C"][s.name]
        assert c["traces"] >= 1, c
        if s.warm != "verify":
            _cold(c)


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_unchanged_program_warm_starts(runs: dict[str, Any], s: Scenario) -> None:
    """Nothing changed: B (and D, edits undone) load with no trace and no compile."""
    for k in ("B", "D") if s.warm != "manifest" else ("B",):
        (_warm if s.warm != "verify" else _warm_verified)(runs[k][s.name])
    _warm_verified(runs["Bv"][s.name])


@pytest.mark.parametrize("name", CONTROLS)
def test_controls_hit_with_another_hash_seed(runs: dict[str, Any], name: str) -> None:
    """Unedited functions hit in every run, C included (another PYTHONHASHSEED): no key part
    depends on the hash seed (frozenset constants in bytecode, sets of ints). C's edits to the
    program's modules are inputs of every guard (kiln._keys._guard): verified once there, never
    compiled; B and D (the edits undone) load with no trace."""
    _cold(runs["A"][name])
    for k in "BCD":
        if k == "C":
            rec = runs[k][name]
            assert rec["hits"] == 1 and rec["misses"] == 0 and rec["compiles"] == 0, rec
            assert rec["traces"] == rec["verifies"] <= 1, rec
        else:
            _warm(runs[k][name])
        assert _same_as_jax(runs[k], name) == _same_as_jax(runs["A"], name)


def test_no_kiln_warnings(runs: dict[str, Any]) -> None:
    for name, run in runs.items():
        assert "KilnWarning" not in run.stderr and "StoreWarning" not in run.stderr, name
        assert run.stats["bad_entries"] == 0, (name, run.stats)


def test_program_text_lists_every_scenario() -> None:
    listed = [s.name for s in SCENARIOS] + CONTROLS
    called = [line.split('"')[1] for line in PROG.splitlines() if line.startswith('pair("')]
    assert called == listed, json.dumps([called, listed])
