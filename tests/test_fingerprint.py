"""The static walk's rule, in process: library objects by name and by what they hold, values by
value, and what cannot be keyed sends the call down the verify path (never a guess).

Cross-process edits of the same kinds are in ``test_staleness.py`` and
``test_staleness_values.py``; here each property is checked directly on fingerprints.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from kiln_test_children import child_env, run_child

from kiln._keys._code import code_digest
from kiln._keys._fingerprint import fingerprint
from kiln._keys._manifest import check_manifest
from kiln._keys._rngs import RngWatch

SCALE = 2.0


def _digest(fn, **extra):
    fp = fingerprint(fn, extra=list(extra.items()))
    assert fp.sound, fp.reason
    return fp.digest


def _apply(act):
    def f(x):
        return act(x)

    return f


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (jax.nn.relu, jax.nn.relu6),  # custom_jvp objects of one module
        (jnp.tanh, jnp.sin),  # jitted library functions
        (jnp.mean, jnp.sum),  # plain library functions
        (jnp.float32, jnp.bfloat16),  # library classes
        (np.sin, np.cos),  # ufuncs
    ],
)
def test_library_objects_are_identified_by_name(a, b):
    assert _digest(_apply(a)) == _digest(_apply(a))
    assert _digest(_apply(a)) != _digest(_apply(b))


def test_library_closures_count_by_value():
    """optax transformations, schedules and jax.grad / jax.vmap of partials hold their
    parameters in closure cells (or partial keywords): each is part of the key."""
    def loss(x, reg):
        return jnp.sum(x**2) * reg

    pairs = [
        (optax.sgd(0.1), optax.sgd(0.5)),
        (optax.sgd(0.1), optax.adam(0.1)),
        (optax.linear_schedule(1.0, 0.0, 10), optax.linear_schedule(2.0, 0.0, 10)),
        (jax.grad(functools.partial(loss, reg=0.5)), jax.grad(functools.partial(loss, reg=2.0))),
        (jax.vmap(functools.partial(loss, reg=0.5)), jax.vmap(functools.partial(loss, reg=2.0))),
        (jax.nn.initializers.constant(2.0), jax.nn.initializers.constant(3.0)),
    ]
    for a, b in pairs:
        assert _digest(_apply(a)) == _digest(_apply(a))
        assert _digest(_apply(a)) != _digest(_apply(b)), (a, b)
    # the same parameters built twice: equal (no identity in the key)
    assert _digest(_apply(optax.adam(0.1))) == _digest(_apply(optax.adam(0.1)))


def test_static_callables_are_walked_by_code():
    def lr_a():
        return 0.1

    def lr_b():
        return 0.2

    def f(x, lr):
        return x * lr()

    assert _digest(f, **{"static:lr": lr_a}) != _digest(f, **{"static:lr": lr_b})


def test_dict_order_counts():
    """Code iterating a dict sees insertion order, so the order is part of the value."""
    d1, d2 = {"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}

    def g1(x):
        return x * list(d1.values())[0]

    def g2(x):
        return x * list(d2.values())[0]

    assert _digest(g1) != _digest(g2)


def test_a_global_generator_s_state_counts_where_the_trace_draws_from_it():
    """numpy's global generator is reached by name (``np.random.randn``) but keyed by what
    the trace does: the static walk names it, the trace's RngWatch keys its state when the
    trace draws from it, and a warm lookup checks that state."""
    def f(x):
        return x + np.random.randn(3)

    np.random.seed(0)
    a = _digest(f)
    np.random.seed(1)
    assert _digest(f) == a  # the walk alone keys no state
    np.random.seed(0)
    with RngWatch() as watch:
        jax.jit(f).trace(np.zeros(3))
    assert watch.items and watch.items[0][:2] == ["numpy.random.mtrand._rand", "<rng>"]
    np.random.seed(0)
    assert check_manifest(watch.items) is None
    np.random.seed(1)
    assert "numpy.random.mtrand._rand" in str(check_manifest(watch.items))


def test_a_global_generator_reached_by_name_but_not_drawn_from_is_not_keyed():
    """``np.pi`` beside ``jax.random.normal``: the walk reaches ``np.random.normal`` by name;
    the trace never draws from numpy's generator, so no state is keyed."""
    def f(key):
        return jax.random.normal(key, (3,)) * np.pi

    np.random.seed(0)
    a = _digest(f)
    np.random.seed(1)
    assert _digest(f) == a
    with RngWatch() as watch:
        jax.jit(f).trace(jax.random.key(0))
    assert watch.items == []


def test_a_generator_the_user_holds_counts_by_its_state():
    rng = np.random.RandomState(0)

    def f(x):
        return x + rng.randn(3)

    a = _digest(f)
    rng.seed(1)
    assert _digest(f) != a
    rng.seed(0)
    assert _digest(f) == a


WORDS = {"alpha", "beta", "gamma"}


def _iterate_words(x):
    for w in WORDS:
        x = x * len(w)
    return x


def _iterate_literal(x):
    for w in {"alpha", "beta"}:
        x = x * len(w)
    return x


def _membership(x, mode="a"):
    return x * 2 if mode in {"a", "b"} else x


@pytest.mark.parametrize("fn", [_iterate_words, _iterate_literal])
def test_sets_of_strings_take_the_verify_path_without_a_fixed_hash_seed(monkeypatch, fn):
    """The order a set of strings iterates in changes with PYTHONHASHSEED: never keyed by a
    guess. With a fixed seed the iteration order itself is keyed."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fp = fingerprint(fn)
    assert not fp.sound and "PYTHONHASHSEED" in str(fp.reason)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert fingerprint(fn).sound


def test_membership_tests_stay_on_the_fast_path(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert fingerprint(_membership).sound


def test_code_digests_do_not_depend_on_the_hash_seed():
    """A frozenset constant (``x in {"a", "b"}``) was hashed by repr, whose order follows the
    hash seed: every process recompiled. Now two seeds give one digest."""
    prog = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from kiln._keys._code import code_digest\n"
        "def f(x, mode='a'):\n"
        "    return x if mode in {'alpha', 'beta', 'gamma', 'delta', 'epsilon'} else -x\n"
        "print(code_digest(f.__code__))\n"
    )
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/src"
    out = {
        run_child([sys.executable, "-c", prog, src],
                  env=child_env(PYTHONHASHSEED=seed, KILN_JAX_CACHE="0"), check=True).stdout
        for seed in ("1", "2", "3", "4")
    }
    assert len(out) == 1, out
    assert code_digest(_membership.__code__) == code_digest(_membership.__code__)


def test_a_global_without_value_digest_is_unsound():
    lock = threading.Lock()

    def f(x):
        lock.locked()
        return x

    fp = fingerprint(f)
    assert not fp.sound and "lock" in str(fp.reason)


def test_patched_library_name_counts(monkeypatch):
    def f(x):
        return jnp.cosh(x)

    a = _digest(f)
    monkeypatch.setattr(jnp, "cosh", lambda x: x)
    b = _digest(f)
    monkeypatch.setattr(jnp, "cosh", lambda x: x * 2)
    c = _digest(f)
    assert len({a, b, c}) == 3


def test_manifest_module_items_import_and_compare(tmp_path, monkeypatch):
    (tmp_path / "kiln_fp_lazy.py").write_text("SCALE = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kiln_fp_lazy  # noqa: F401

    from kiln._keys._manifest import _module_digest

    item = ["kiln_fp_lazy", "<module>", _module_digest(sys.modules["kiln_fp_lazy"], ["SCALE"]),
            "SCALE"]
    assert check_manifest([item]) is None
    del sys.modules["kiln_fp_lazy"]  # a fresh process: the check imports it again
    (tmp_path / "kiln_fp_lazy.py").write_text("SCALE = 3.0\n")
    assert "kiln_fp_lazy" in str(check_manifest([item]))
    del sys.modules["kiln_fp_lazy"]


def test_python_s_global_generator_counts_where_the_trace_draws_from_it():
    import random

    def f(x):
        return x * random.random()

    random.seed(0)
    a = _digest(f)
    random.seed(1)
    assert _digest(f) == a
    random.seed(0)
    with RngWatch() as watch:
        jax.jit(f).trace(np.zeros(3))
    assert [i[0] for i in watch.items] == ["random._inst"]
    random.seed(0)
    assert check_manifest(watch.items) is None
    random.seed(1)
    assert "random._inst" in str(check_manifest(watch.items))



@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _StaticCfg:
    scale: float


def test_register_static_pytree_is_keyed_by_its_fields() -> None:
    """jax.tree_util.register_static (an nnx GraphDef): the node is its own aux data; it was
    keyed by class only, so a closed-over config with another value served a stale program."""

    def make(cfg):
        def f(x):
            return x * cfg.scale

        return f

    assert _digest(make(_StaticCfg(1.0))) != _digest(make(_StaticCfg(2.0)))
    assert _digest(make(_StaticCfg(1.0))) == _digest(make(_StaticCfg(1.0)))


# --------------------------------------------------------------------------------------------
# what a trace reaches besides names (cross-process: test_staleness_walk.py)
# --------------------------------------------------------------------------------------------
def _rule_registries():
    from jax.interpreters import ad, batching, mlir

    def lowering(p, rule):
        mlir.register_lowering(p, rule)

    def cpu_lowering(p, rule):
        mlir.register_lowering(p, rule, platform="cpu")

    def jvp(p, rule):
        ad.primitive_jvps[p] = rule

    def transpose(p, rule):
        ad.primitive_transposes[p] = rule

    def batcher(p, rule):
        batching.primitive_batchers[p] = rule

    return {"lowering": lowering, "cpu_lowering": cpu_lowering, "jvp": jvp,
            "transpose": transpose, "batching": batcher}


@pytest.mark.parametrize("registry", sorted(_rule_registries()))
def test_a_primitive_counts_with_every_rule_registered_for_it(registry):
    from jax.extend.core import Primitive

    p = Primitive(f"kiln_fp_test_{registry}")
    p.def_abstract_eval(lambda x: x)
    register = _rule_registries()[registry]

    def f(x):
        return p.bind(x)

    def rule_a(*args, **kwargs):
        return 1.0

    def rule_b(*args, **kwargs):
        return 2.0

    register(p, rule_a)
    before = _digest(f)
    register(p, rule_b)
    assert _digest(f) != before
    register(p, rule_a)
    assert _digest(f) == before


def test_a_lowering_rule_counts_when_its_table_is_rebound_after_the_first_scan(monkeypatch):
    # kiln's eager route makes mlir's tables versioned copies (_eager._watch_rule_tables) after
    # traces may have run: a rule registered in the new table must still count
    from jax._src.interpreters import mlir
    from jax.extend.core import Primitive

    p = Primitive("kiln_fp_test_rebound")
    p.def_abstract_eval(lambda x: x)

    def f(x):
        return p.bind(x)

    _digest(f)  # (the registries found with the table as it is)
    monkeypatch.setattr(mlir, "_lowerings", dict(mlir._lowerings))
    mlir.register_lowering(p, lambda ctx, x: [x])
    before = _digest(f)
    mlir.register_lowering(p, lambda ctx, x: [x, x][:1])
    assert _digest(f) != before


@dataclasses.dataclass
class _WithMeta:
    a: float = dataclasses.field(default=1.0, metadata={"scale": 2.0})


def test_dataclass_field_metadata_counts():
    cfg = _WithMeta()

    def f(x):
        return x * dataclasses.fields(cfg)[0].metadata["scale"]

    before = _digest(f)
    field = _WithMeta.__dataclass_fields__["a"]
    old = field.metadata
    field.metadata = {"scale": 3.0}  # (a mappingproxy in real dataclasses; a dict here)
    try:
        assert _digest(f) != before
    finally:
        field.metadata = old
    assert _digest(f) == before


def test_frompyfunc_counts_by_its_python_function():
    def f_of(k):
        uf = np.frompyfunc(lambda a: a * k, 1, 1)

        def f(x):
            return x * np.float32(uf(1.0))

        return f

    assert _digest(f_of(2.0)) != _digest(f_of(3.0))
    assert _digest(f_of(2.0)) == _digest(f_of(2.0))
    assert _digest(np.add) == _digest(np.add)  # numpy's own: by name and version


def test_library_config_objects_count_by_value():
    import flax
    import flax.linen as nn

    def f(x):
        return nn.Dense(3).init(jax.random.key(0), x)

    before = _digest(f)
    old = flax.config.flax_fix_rng_separator
    flax.config.update("flax_fix_rng_separator", not old)
    try:
        assert _digest(f) != before
    finally:
        flax.config.update("flax_fix_rng_separator", old)
    assert _digest(f) == before


class _Documented:
    """_Documented(x=<object object at 0x7f00aa>)"""

    def scale(self, x):
        return x * 2.0


def _uses_documented(x):
    return _Documented().scale(x)


def test_a_class_docstring_counts_without_the_addresses_of_reprs():
    """A generated docstring (a dataclass's signature, a flax Module's) shows its defaults'
    reprs, whose addresses differ in every process: they change no key; other text does."""
    from kiln._keys import fingerprint

    first = fingerprint(_uses_documented).digest
    try:
        _Documented.__doc__ = "_Documented(x=<object object at 0x55bb01>)"
        assert fingerprint(_uses_documented).digest == first
        _Documented.__doc__ = "_Documented(x=<object object at 0x55bb01>, y=1)"
        assert fingerprint(_uses_documented).digest != first
    finally:
        _Documented.__doc__ = "_Documented(x=<object object at 0x7f00aa>)"


class _EnvLike:
    """A library-style environment as static ``self``: ``__hash__``/``__eq__``, plain fields,
    no ``__kiln_digest__``, not a dataclass (as in gymnax and evosax)."""

    def __init__(self, n, lock=None):
        self.n = n
        self.shape = (n,)
        if lock is not None:
            self.lock = lock

    def __hash__(self):
        return hash(self.n)

    def __eq__(self, other):
        return isinstance(other, _EnvLike) and other.n == self.n

    def step(self, x):
        return x * self.n


def test_a_static_object_is_keyed_by_class_and_state():
    a = _digest(_EnvLike.step, **{"static:self": _EnvLike(2)})
    assert _digest(_EnvLike.step, **{"static:self": _EnvLike(2)}) == a  # another instance
    assert _digest(_EnvLike.step, **{"static:self": _EnvLike(3)}) != a  # another value


def test_a_static_object_holding_what_has_no_value_names_the_field():
    fp = fingerprint(_EnvLike.step, extra=[("static:self", _EnvLike(2, threading.Lock()))])
    assert not fp.sound
    assert "static:self.lock" in fp.reason


def test_a_logger_is_keyed_by_name_and_levels_not_by_what_logging_keeps():
    import logging

    log = logging.getLogger("kiln_test_fp_logger")

    def f(x):
        log.info("tracing")
        return x

    a = _digest(f)
    log.isEnabledFor(logging.INFO)  # fills the logger's level cache
    logging.getLogger("kiln_test_fp_logger.child")  # another logger in its manager
    assert _digest(f) == a
    log.setLevel(logging.ERROR)
    try:
        assert _digest(f) != a
    finally:
        log.setLevel(logging.NOTSET)


def test_a_library_setting_is_keyed_by_its_values_not_its_lock_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """zarr's config (a donfig ``Config``) holds a ``SerializableLock`` whose token is a uuid
    made in each process, and ``os.environ``: keyed by what they are, so an unchanged program
    warm-starts (tests/test_c_readers.py across processes); a changed setting is another key."""
    donfig = pytest.importorskip("donfig")
    from kiln._keys._walk import Walker

    def digest(cfg: Any) -> str:
        w = Walker()
        w.value("lib.config", cfg, lenient=True)
        return w.sound_digest()

    a, b = donfig.Config("kilntest", defaults=[{"x": 1}]), donfig.Config("kilntest",
                                                                         defaults=[{"x": 1}])
    assert a.config_lock.token != b.config_lock.token and a.env is os.environ
    assert digest(a) == digest(b)
    monkeypatch.setenv("KILN_TEST_UNREAD", "1")  # not read by any trace
    assert digest(a) == digest(b)
    b.set({"x": 2})
    assert digest(a) != digest(b)
    user_lock = threading.Lock()
    w = Walker()
    w.value("user_lock", user_lock)  # the user's own lock: its state is not seen, unsound
    assert w.reason is not None and "user_lock" in w.reason


RUN_ID = "run-1"


def test_a_global_only_a_host_callback_reads_is_not_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jax.debug.callback(lambda v: print(RUN_ID, v), y)``: the lambda runs with the program,
    not while tracing, and a warm start binds it to the module's live globals, so RUN_ID is
    not keyed; a name the function's own code reads too, or one in a default (evaluated while
    tracing), still is."""
    from kiln._keys._callback_roots import callback_only_names

    def only_callback(x):
        jax.debug.callback(lambda v: print(RUN_ID, v), x)
        return x * 2.0

    def also_traced(x):
        jax.debug.callback(lambda v: print(RUN_ID, v), x)
        return x * len(RUN_ID)

    def in_default(x):
        jax.debug.callback(lambda v, r=RUN_ID: print(r, v), x)
        return x

    assert callback_only_names(only_callback) == {"RUN_ID", "print"}
    assert callback_only_names(also_traced) == {"print"}
    assert callback_only_names(in_default) == set()
    before = [fingerprint(f).digest for f in (only_callback, also_traced, in_default)]
    monkeypatch.setattr(sys.modules[__name__], "RUN_ID", "run-2")
    after = [fingerprint(f).digest for f in (only_callback, also_traced, in_default)]
    assert before[0] == after[0]
    assert before[1] != after[1] and before[2] != after[2]


def _host_square(v):
    return v * v


def _host_cube(v):
    return v * v * v


class _Ops:
    transform = staticmethod(_host_square)


transform = _host_square
late = _host_cube


def test_swapping_which_function_two_names_bind_changes_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A function's code is a part where it is first met; which name binds it must count too:
    ``transform`` and ``late`` swapping two functions (one also a class's staticmethod, met
    first) was the same walk, a stale hit (found by the staleness fuzzer)."""
    me = sys.modules[__name__]

    def f(x):
        return _Ops.transform(x) + transform(x) * late(x)

    before = fingerprint(f).digest
    monkeypatch.setattr(me, "transform", _host_cube)
    monkeypatch.setattr(me, "late", _host_square)
    assert fingerprint(f).digest != before
    monkeypatch.setattr(_Ops, "transform", staticmethod(_host_cube))
    swapped = fingerprint(f).digest
    monkeypatch.setattr(_Ops, "transform", staticmethod(_host_square))
    assert fingerprint(f).digest != swapped
    monkeypatch.setattr(me, "transform", _host_square)
    monkeypatch.setattr(me, "late", _host_cube)
    assert fingerprint(f).digest == before


class _Plugin:
    SCALE = 1.0


class _Double(_Plugin):
    SCALE = 2.0


def test_code_that_walks_subclasses_keys_the_subclass_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plugins found by ``cls.__subclasses__()`` (no name reaches them): a subclass added, or a
    class attribute of one changed, is another key; code that does not walk
    subclasses is not keyed by them."""

    def total(x):
        return sum(c.SCALE for c in _Plugin.__subclasses__()) * x

    def plain(x):
        return _Plugin.SCALE * x

    before, plain_before = fingerprint(total).digest, fingerprint(plain).digest
    monkeypatch.setattr(_Double, "SCALE", 3.0)
    assert fingerprint(total).digest != before
    monkeypatch.setattr(_Double, "SCALE", 2.0)
    assert fingerprint(total).digest == before

    class _Triple(_Plugin):  # added (kept alive until the end of the test)
        SCALE = 3.0

    assert fingerprint(total).digest != before
    assert fingerprint(plain).digest == plain_before
    del _Triple


class _ArrayKey:  # as mujoco.mjx's _NumPyArrayHashWrapper: slots, a hash key holding a dtype
    __slots__ = ("_hash_key", "array")

    def __init__(self, arr: np.ndarray) -> None:
        self._hash_key = (int(arr.sum()), arr.dtype, arr.shape)
        self.array = arr


_MANY_KEYS = tuple(_ArrayKey(np.full(2, i, np.float32)) for i in range(300))


def test_a_value_met_again_costs_no_part_but_a_function_does() -> None:
    """One dtype object in 300 static fields (an MJX model's pytree aux) is walked once: a
    repeat costs no part, so the walk stays under its limit of 5000 parts (mjx_humanoid went to
    the verify path in CI); a function met again still does (which name binds it counts)."""

    def f(x):
        return x + len(_MANY_KEYS)

    fp = fingerprint(f)
    assert fp.sound, fp.reason
    same = [k for k, _ in fp.parts if k.startswith("same:")]
    assert not any("_hash_key" in k for k in same), same[:5]
    assert len(fp.parts) < 5000
