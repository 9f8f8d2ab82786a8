"""kiln.jit in one process: drop-in behaviour, counts, static arrays, bad entries, explanations."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_helpers import error_of

import kiln
from kiln._base import FORMAT_VERSION, MAGIC


def _entry_files(cache):
    return sorted((cache / "entries").glob("*/*.kiln"))


class TraceLog(list):
    """A list that grows by one on every trace; its __kiln_digest__ keeps it out of keys."""

    def __kiln_digest__(self):
        return b"trace-log"

    __hash__ = object.__hash__


def audit_traces() -> int:
    """Extra traces per warm hit: KILN_VERIFY traces and lowers every hit to audit it."""
    return 1 if kiln.get_config().verify else 0


def make_counted(fun, **jit_kwargs):
    """kiln.jit(fun) plus a list that grows by one on every trace."""
    traces = TraceLog()

    @functools.wraps(fun)
    def body(*args, **kwargs):
        traces.append(1)
        return fun(*args, **kwargs)

    return kiln.jit(body, **jit_kwargs), traces


# --------------------------------------------------------------------------- drop-in behaviour
def test_decorator_forms_keep_metadata():
    @kiln.jit
    def add(x, y):
        """Adds."""
        return x + y

    @kiln.jit(static_argnames="n")
    def power(x, n):
        return x**n

    assert add.__name__ == "add" and add.__doc__ == "Adds."
    assert add.__wrapped__.__name__ == "add"
    assert float(add(1.0, 2.0)) == 3.0
    assert power(jnp.arange(3.0), n=3).tolist() == [0.0, 1.0, 8.0]
    assert power(jnp.arange(3.0), 2).tolist() == [0.0, 1.0, 4.0]


@dataclasses.dataclass
class Params:
    w: jax.Array
    b: jax.Array


jax.tree_util.register_dataclass(Params, data_fields=["w", "b"], meta_fields=[])


def _model(params, x, *, scale=1.0, extras=None):
    y = (params.w @ x + params.b) * scale
    out = {"y": y, "pair": (y.sum(), [x, 2 * x])}
    if extras is not None:
        out["extras"] = jax.tree_util.tree_map(lambda e: e + 1, extras)
    return out


def test_same_results_as_jax_jit_for_pytrees_and_kwargs():
    p = Params(jnp.eye(3), jnp.arange(3.0))
    x = jnp.array([1.0, 2.0, 3.0])
    extras = {"a": jnp.ones(2), "b": (jnp.zeros(1),)}
    want = jax.jit(_model)(p, x, scale=2.0, extras=extras)
    got = kiln.jit(_model)(p, x, scale=2.0, extras=extras)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_equinox_module_argument_and_output():
    mlp = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.PRNGKey(0))

    @kiln.filter_jit
    def apply_and_update(model, x):
        new = eqx.tree_at(lambda m: m.layers[0].bias, model, model.layers[0].bias + 1)
        return model(x), new

    y, new = apply_and_update(mlp, jnp.ones(2))
    np.testing.assert_allclose(y, mlp(jnp.ones(2)), rtol=1e-6)
    assert isinstance(new, eqx.nn.MLP)
    np.testing.assert_allclose(new.layers[0].bias, mlp.layers[0].bias + 1)


def test_method_decorator():
    class Scaler:
        def __init__(self, k):
            self.k = k

        @functools.partial(kiln.jit, static_argnums=0)
        def __call__(self, x):
            return x * self.k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Scaler) and other.k == self.k

    assert Scaler(3.0)(jnp.ones(2)).tolist() == [3.0, 3.0]


def test_under_transformations_behaves_like_nested_jit():
    f, traces = make_counted(lambda x: jnp.sin(x) * x)
    x = jnp.linspace(0, 1, 4)
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), jnp.sin(x) + x * jnp.cos(x),
                               rtol=1e-6)
    assert jax.vmap(f)(jnp.ones((3, 4))).shape == (3, 4)
    assert float(jax.jit(lambda x: f(x).sum())(x)) == pytest.approx(float((jnp.sin(x) * x).sum()))
    with jax.disable_jit():
        np.testing.assert_allclose(f(x), jnp.sin(x) * x)


def test_unused_arguments_on_the_fast_path():
    """Values stay right when XLA prunes an argument. (The fast-path bug with pruned arguments,
    counting them from in_avals, showed only in tests/test_noinline.py's grad under jit.)"""
    f = kiln.jit(lambda x, z, unused: x + z)  # XLA prunes `unused` from the executable
    for _ in range(3):  # the second and third calls take the C++ fast path
        assert f(jnp.ones(2), jnp.ones(2), jnp.zeros(2)).tolist() == [2.0, 2.0]


def test_a_cached_signature_runs_no_python_code_of_kiln():
    """After the first call, calls with that signature go straight to the C++ dispatcher, as
    jax.jit's do: no kiln frame (a Python __call__ in between cost 2.4-5 us per call)."""
    import os
    import sys

    kiln_dir = os.path.dirname(kiln.__file__)
    f = kiln.jit(lambda x, y: x * y + 1)
    x = jnp.ones(3)
    f(x, x)  # compiles and fills the C++ cache
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(kiln_dir):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = f(x, x)
    finally:
        sys.setprofile(None)
    assert seen == []
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert isinstance(f, kiln.JitFunction) and f.__name__ == "<lambda>"
    # a new signature still reaches kiln's Python (and the profile hook sees it)
    sys.setprofile(profile)
    try:
        f(jnp.ones(4), jnp.ones(4))
    finally:
        sys.setprofile(None)
    assert "_python_call" in seen


def test_pickled_by_reference_like_functions():
    import pickle
    import types

    mod = types.ModuleType("kiln_pickle_probe")
    sys.modules[mod.__name__] = mod
    try:
        exec("import kiln\n@kiln.jit\ndef f(x):\n    return x + 1\n\n"
             "@kiln.jit(static_argnames='n')\ndef g(x, n):\n    return x * n\n", mod.__dict__)
        for fn in (mod.f, mod.g):  # the C++-dispatched class and the plain one alike
            assert pickle.loads(pickle.dumps(fn)) is fn
    finally:
        del sys.modules[mod.__name__]
    local = kiln.jit(lambda x: x)
    # as for a plain local function: an error naming it
    with pytest.raises((pickle.PicklingError, AttributeError), match=r"<locals>\.<lambda>"):
        pickle.dumps(local)


def test_donate_argnums_runs():
    f = kiln.jit(lambda x, y: x + y, donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU may not implement donation
        assert f(jnp.ones(3), jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


# --------------------------------------------------------------------------- counts
def test_hot_path_and_persistent_hit_counts(kiln_store):
    f, traces = make_counted(lambda x: x * 2)
    x = jnp.ones(3)
    f(x)
    f(x)
    s = kiln.stats()
    assert (len(traces), s.misses, s.compiles, s.stores_written) == (1, 1, 1, 1)
    assert len(_entry_files(kiln_store)) == 1
    f.clear_cache()
    np.testing.assert_array_equal(f(x), 2 * x)
    s = kiln.stats()
    assert (len(traces), s.hits, s.compiles) == (1 + audit_traces(), 1, 1)
    # the entry records its compile's seconds; the hit counts them, less its load, as saved
    # (0 when the load took longer: no timing assertion)
    from kiln._base import decode
    (entry_file,) = _entry_files(kiln_store)
    header = decode(entry_file.read_bytes(), signing_key=None).header
    assert header["compile_seconds"] > 0
    assert s.saved_seconds >= 0


def test_new_shape_dtype_weak_type_and_structure_recompile():
    f, traces = make_counted(lambda x: jax.tree_util.tree_map(lambda a: a + 1, x))
    f(jnp.ones(3))
    f(jnp.ones(4))
    f(jnp.ones(3, jnp.int32))
    f(1.0)  # weak float32
    f(np.float32(1.0))  # strong float32
    f((jnp.ones(3),))
    f([jnp.ones(3)])
    f({"a": jnp.ones(3)})
    f({"b": jnp.ones(3)})
    assert len(traces) == 9
    f(jnp.ones(3))
    f(2.0)
    assert len(traces) == 9


def test_a_module_compiled_before_is_not_compiled_again_for_another_signature(kiln_store,
                                                                              monkeypatch):
    """Weak and strong float32 lower to the same module: XLA compiles it once (JAX's cache would
    give the first executable back too), each signature keeps its own output weak type (as
    jax.jit gives it: promotion with bfloat16 differs), and both are stored and load. A module
    that differs is compiled."""
    from kiln._base._jax_compat import _executables

    kiln.jit(lambda x: x - 1)(1)  # (kiln's hook is in place from its first compile on)
    stored = len(_entry_files(kiln_store))
    xla = []
    original = _executables._ORIGINAL_BACKEND_COMPILE

    def counted(*args, **kwargs):
        xla.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_executables, "_ORIGINAL_BACKEND_COMPILE", counted)
    monkeypatch.setattr(_executables, "_same_module", type(_executables._same_module)())

    def body(s):
        return s * 2.0

    f, traces = make_counted(body)
    one = jnp.bfloat16(1)
    want = [jax.jit(body)(3.0), jax.jit(body)(np.float32(3.0))]
    xla.clear()  # (the hook counts every compile: jax.jit's above too)
    before = kiln.stats()
    got = [f(3.0), f(np.float32(3.0))]
    assert (len(traces), kiln.stats().compiles - before.compiles, len(xla)) == (2, 2, 1)
    for g, w in zip(got, want, strict=True):
        assert (float(g), g.dtype, g.weak_type, (g + one).dtype) == \
            (float(w), w.dtype, w.weak_type, (w + one).dtype)
    assert [g.weak_type for g in got] == [True, False]
    assert len(_entry_files(kiln_store)) == stored + 2
    f.clear_cache()  # from the store: each entry with its own signature's avals
    xla.clear()  # (the eager additions above compiled too)
    again = [f(3.0), f(np.float32(3.0))]
    assert (kiln.stats().hits - before.hits, len(xla)) == (2, 0)
    assert [(a.weak_type, (a + one).dtype) for a in again] == \
        [(w.weak_type, (w + one).dtype) for w in want]
    x = jnp.ones(3)
    xla.clear()
    f(x)  # another module: compiled
    assert len(xla) == 1


def test_precompile_with_shape_dtype_struct():
    f, traces = make_counted(lambda x, n: x * n, static_argnames="n")
    f.precompile(jax.ShapeDtypeStruct((3,), jnp.float32), n=2)
    assert len(traces) == 1 and kiln.stats().compiles == 1
    assert f(jnp.ones(3), n=2).tolist() == [2.0, 2.0, 2.0]
    assert len(traces) == 1
    f.clear_cache()
    read_before = kiln.stats().read_seconds
    f.precompile(jax.ShapeDtypeStruct((3,), jnp.float32), n=2)  # from the store
    assert len(traces) == 1 + audit_traces() and kiln.stats().hits == 1
    # the read and the load of that entry are timed (benchmarks/warm_breakdown.py)
    assert kiln.stats().read_seconds > read_before and kiln.stats().load_seconds > 0


# --------------------------------------------------------------------------- static arrays
def test_static_numpy_array_by_value():
    f, traces = make_counted(lambda x, table: x + table.sum(), static_argnames="table")
    x = jnp.ones(2)
    t = np.arange(4.0)
    assert f(x, table=t).tolist() == [7.0, 7.0]
    assert f(x, table=t.copy()).tolist() == [7.0, 7.0]
    assert len(traces) == 1  # equal content: no retrace
    assert kiln.stats().calls_hot == 0  # served by the C++ dispatcher, keyed by the digest
    t[0] = 10.0  # mutated in place: never reuses the old executable
    assert f(x, table=t).tolist() == [17.0, 17.0]
    assert len(traces) == 2


@pytest.mark.parametrize(
    "a, b, same",
    [
        (np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), True),
        (np.array([0.0]), np.array([-0.0]), False),
        (np.zeros((2, 2), np.float32), np.zeros((4,), np.float32), False),
        (np.zeros(3, np.int32), np.zeros(3, np.float32), False),
        (np.arange(8.0)[::2], np.array([0.0, 2.0, 4.0, 6.0]), True),
        (jnp.arange(3.0), np.arange(3.0, dtype=np.float32), True),
    ],
)
def test_static_array_equality_is_bitwise(a, b, same):
    f, traces = make_counted(lambda x, s: x + jnp.asarray(s).size, static_argnums=1)
    f(jnp.ones(1), a)
    f(jnp.ones(1), b)
    assert len(traces) == (1 if same else 2)


def test_static_pytree_of_arrays():
    f, traces = make_counted(lambda x, cfg: x * cfg["k"][0], static_argnames="cfg")
    assert float(f(jnp.ones(()), cfg={"k": np.array([3.0])})) == 3.0
    assert float(f(jnp.ones(()), cfg={"k": np.array([4.0])})) == 4.0
    assert float(f(jnp.ones(()), cfg={"k": np.array([3.0])})) == 3.0
    assert len(traces) == 2


def test_object_array_static_error_names_argument_and_path():
    f = kiln.jit(lambda x, cfg: x, static_argnames="cfg")
    with pytest.raises(kiln.StaticArgumentError) as e:
        f(jnp.ones(1), cfg={"w": np.array([object()], dtype=object)})
    msg = str(e.value)
    assert "'cfg'" in msg and "['w']" in msg and "object array" in msg
    assert "dynamic" in msg


def test_unhashable_static_error():
    f = kiln.jit(lambda x, opts: x, static_argnames="opts")

    class Opts:
        __hash__ = None

    with pytest.raises(kiln.StaticArgumentError, match="opts"):
        f(jnp.ones(1), opts=Opts())


def test_an_object_static_is_keyed_by_class_and_state(kiln_store):
    """An object hashed by identity, with no ``__kiln_digest__`` and not a
    dataclass, is keyed by its class's code and the fields its trace read (it used to take
    the verify path); one holding what has no value (a lock) hits when the trace does not
    read it, and takes the verify path, the reason naming the field, when it does."""
    class Local:  # hashable by identity, no canonical digest
        def __init__(self, k, lock=None):
            self.k = k
            self.lock = lock

    f, traces = make_counted(lambda x, o: x * o.k, static_argnums=1)
    o = Local(3.0)
    assert f(jnp.ones(1), o).tolist() == [3.0]
    assert f(jnp.ones(1), o).tolist() == [3.0]
    assert len(traces) == 1
    assert kiln.stats().reasons["verify-path"] == 0 and kiln.stats().stores_written == 1
    assert f(jnp.ones(1), Local(3.0, threading.Lock())).tolist() == [3.0]  # (unread)
    assert kiln.stats().hits == 1 and len(traces) == 1 + audit_traces()
    g, _ = make_counted(lambda x, o: x * o.k if o.lock else x, static_argnums=1)
    kiln.configure(explain=True)
    with warnings.catch_warnings(record=True):
        assert g(jnp.ones(1), Local(3.0, threading.Lock())).tolist() == [3.0]
    assert kiln.stats().reasons["verify-path"] == 1


def test_static_holding_functions_is_keyed_by_their_code():
    """A static tuple holding local functions and a local class (equinox's filter_jit statics
    under the jax.jit swap) is keyed by value with those by code, not the verify path: another
    closure or another code at the same place is another program, the same ones (new objects)
    the stored one."""
    f, traces = make_counted(lambda x, fs: fs[0](x) + fs[1], static_argnums=1)

    def make(k):
        return (lambda x: x * k, 1.0)

    assert f(jnp.ones(1), make(2.0)).tolist() == [3.0]
    assert f(jnp.ones(1), make(3.0)).tolist() == [4.0]  # another closure
    assert f(jnp.ones(1), (lambda x: x - 1, 1.0)).tolist() == [1.0]  # another code
    assert f(jnp.ones(1), (lambda x: x - 1, 2.0)).tolist() == [2.0]  # another value
    assert len(traces) == 4
    assert kiln.stats().hits == 0
    assert f(jnp.ones(1), make(2.0)).tolist() == [3.0]  # a new lambda, same code and closure
    assert len(traces) == 4 + audit_traces() and kiln.stats().hits == 1
    assert kiln.stats().reasons.get("verify-path", 0) == 0

    def local(scale):
        class Local:  # a local class: by its code and class variables
            SCALE = scale

        return Local

    g, g_traces = make_counted(lambda x, s: x * s[0].SCALE, static_argnums=1)
    assert g(jnp.ones(1), (local(4.0),)).tolist() == [4.0]
    assert g(jnp.ones(1), (local(5.0),)).tolist() == [5.0]
    assert g(jnp.ones(1), (local(4.0),)).tolist() == [4.0]
    assert len(g_traces) == 2 + audit_traces() and kiln.stats().hits == 2
    assert kiln.stats().reasons.get("verify-path", 0) == 0
    h, _ = make_counted(lambda x, s: x, static_argnums=1)
    assert h(jnp.ones(1), (len, object())).tolist() == [1.0]  # an object: no digest
    assert kiln.stats().reasons["verify-path"] == 1


# --------------------------------------------------------------------------- bad entries
@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b"",  # zero length
        lambda b: b"garbage" * 50,  # garbage
        lambda b: MAGIC + (FORMAT_VERSION + 1).to_bytes(4, "little") + b[12:],  # other version
        lambda b: b[:-40] + bytes([b[-40] ^ 1]) + b[-39:],  # one flipped byte
    ],
    ids=["truncated", "empty", "garbage", "other-version", "flipped-byte"],
)
def test_bad_entry_warns_once_recompiles_and_is_replaced(kiln_store, damage):
    f, traces = make_counted(lambda x: x + 1)
    x = jnp.arange(3.0)
    f(x)
    (path,) = _entry_files(kiln_store)
    good = path.read_bytes()
    path.write_bytes(damage(good))
    f.clear_cache()
    with pytest.warns(kiln.StoreWarning, match="recompiling and replacing") as rec:
        np.testing.assert_array_equal(f(x), x + 1)
    assert len(rec) == 1
    assert rec[0].filename == __file__  # points at the user's call, not into kiln
    assert len(traces) == 2 and kiln.stats().bad_entries == 1
    assert path.read_bytes() != damage(good)  # replaced by a good entry
    f.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(f(x), x + 1)
    assert len(traces) == 2 + audit_traces() and kiln.stats().hits == 1


def test_entry_under_another_key_is_refused(kiln_store):
    f, f_traces = make_counted(lambda x: x + 1)
    g, g_traces = make_counted(lambda x: x * 100)
    x = jnp.ones(2)
    f(x)
    g(x)
    paths = _entry_files(kiln_store)
    assert len(paths) == 2
    a, b = (p.read_bytes() for p in paths)
    paths[0].write_bytes(b)  # swap the two valid entries
    paths[1].write_bytes(a)
    f.clear_cache()
    g.clear_cache()
    with pytest.warns(kiln.StoreWarning, match="written for key"):
        assert f(x).tolist() == [2.0, 2.0]
    with pytest.warns(kiln.StoreWarning, match="written for key"):
        assert g(x).tolist() == [100.0, 100.0]


def test_strict_mode_raises_on_bad_entry(kiln_store):
    f = kiln.jit(lambda x: x + 1)
    f(jnp.ones(2))
    (path,) = _entry_files(kiln_store)
    path.write_bytes(b"nonsense")
    f.clear_cache()
    kiln.configure(strict=True)
    with pytest.raises(kiln.StoreError) as raised:
        f(jnp.ones(2))
    # (the message itself; the traceback note jax adds to errors raised in a call, as to
    # jax.jit's, is apart)
    assert re.search(r"unusable.*\(KILN_STRICT=1 makes this an error; unset it to warn and "
                     r"recompile\)$", str(raised.value))


def test_signing_key_refuses_unsigned_and_foreign_entries(kiln_store):
    f, traces = make_counted(lambda x: x - 1)
    f(jnp.ones(2))  # unsigned entry
    f.clear_cache()
    kiln.configure(signing_key="secret-1")
    with pytest.warns(kiln.StoreWarning, match="not signed"):
        f(jnp.ones(2))
    f.clear_cache()
    kiln.configure(signing_key="secret-2")
    with pytest.warns(kiln.StoreWarning, match="digest mismatch"):
        f(jnp.ones(2))
    f.clear_cache()
    f(jnp.ones(2))  # signed with secret-2 now: a clean hit
    assert len(traces) == 3 + audit_traces() and kiln.stats().hits == 1


def test_unwritable_store_warns_and_still_runs(tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    kiln.configure(cache_dir=blocker / "sub")
    f = kiln.jit(lambda x: x * 3)
    with pytest.warns(kiln.StoreWarning):
        assert f(jnp.ones(1)).tolist() == [3.0]


def test_null_and_memory_stores():
    kiln.configure(store="null")
    f, traces = make_counted(lambda x: x)
    f(jnp.ones(1))
    f.clear_cache()
    f(jnp.ones(1))
    assert len(traces) == 2 and kiln.stats().hits == 0
    kiln.configure(store="memory")
    g, traces = make_counted(lambda x: x + 0.5)
    g(jnp.ones(1))
    g.clear_cache()
    assert g(jnp.ones(1)).tolist() == [1.5]
    assert len(traces) == 1 + audit_traces() and kiln.stats().hits == 1


# --------------------------------------------------------------------------- explanations
def test_explain_names_changed_argument(caplog):
    kiln.configure(explain=True)
    f = kiln.jit(lambda x, y: x.sum() + y.sum())
    with caplog.at_level(logging.WARNING, logger="kiln"):
        f(jnp.ones(3), jnp.ones(3))
        f(jnp.ones(4), jnp.ones(3))
    text = caplog.text
    assert "first call in this process" in text
    assert "recompiling because argument x: float32[3] -> float32[4]" in text


def test_explain_hints_recreated_function(caplog):
    kiln.configure(explain=True)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        for _ in range(4):
            kiln.jit(lambda x: x + 7)(jnp.ones(1))
    assert "re-created on every call" in caplog.text


def test_explain_names_changed_global_for_persistent_miss(caplog, monkeypatch, tmp_path):
    (tmp_path / "kiln_explain_mod.py").write_text(
        "import jax.numpy as jnp\nSCALE = 2.0\ndef f(x):\n    return x * SCALE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import kiln_explain_mod as mod

    kiln.configure(explain=True)
    f = kiln.jit(mod.f)
    assert f(jnp.ones(1)).tolist() == [2.0]
    monkeypatch.setattr(mod, "SCALE", 5.0)
    f.clear_cache()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert f(jnp.ones(1)).tolist() == [5.0]
    assert "closest stored entry differs in: value:kiln_explain_mod.SCALE" in caplog.text


def test_explain_a_changed_static_value_is_not_called_an_argument_type_change(caplog):
    kiln.configure(explain=True)
    f = kiln.jit(lambda x, table: x * table.sum(), static_argnames="table")
    x = jnp.ones(3)
    f(x, table=np.arange(4.0))
    f.clear_cache()  # a persistent miss: the closest stored entry is compared
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert f(x, table=np.arange(5.0)).tolist() == [10.0] * 3
    line = next(r.getMessage() for r in caplog.records if "closest stored entry" in r.getMessage())
    assert "static:table:" in line and "argument types" not in line, line


# --------------------------------------------------------------------------- arguments
def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="Expected a callable value, got 3"):  # jax.jit's
        kiln.jit(3)
    with pytest.raises(ValueError, match="has no parameter 'nope'"):
        kiln.jit(lambda x: x, static_argnames="nope")
    with pytest.raises(ValueError, match=r"\['x', 'table'\]. Did you mean 'table'\?"):
        kiln.jit(lambda x, table: x, static_argnames="tabel")
    with pytest.raises(TypeError, match="static_argnums"):
        kiln.jit(lambda x: x, static_argnums="x")


@pytest.mark.parametrize("first", ["nan", "finite"])
def test_debug_nans_raises_floating_point_error_as_jax_jit(first):
    """Under jax_debug_nans, jax.jit raises FloatingPointError naming the operation (after
    re-running op by op), never jax's internal InternalFloatingPointError; on the first call
    and on a signature the C++ dispatcher already caches."""
    def f(x):
        return jnp.log(x) * 2

    for fn in (jax.jit(f), kiln.jit(f)):
        with jax.debug_nans(True):
            if first == "finite":
                assert float(fn(jnp.array(1.0))) == 0.0
            with pytest.raises(FloatingPointError,
                               match=r"invalid value \(nan\) encountered in log"):
                fn(jnp.array(-1.0))


def test_a_function_closing_over_a_tracer_runs_as_a_nested_jit_and_is_never_stored():
    """Created inside a transformation, it closes over a tracer while its arguments are plain
    numbers: before, 'Computation compiled for 2 inputs but called with 1'."""
    want = jax.jvp(lambda x: jax.jit(lambda y: y * x)(4.0), (5.0,), (1.0,))
    got = jax.jvp(lambda x: kiln.jit(lambda y: y * x)(4.0), (5.0,), (1.0,))
    assert [float(v) for v in got] == [float(v) for v in want] == [20.0, 4.0]
    assert kiln.stats().compiles == 0 and kiln.stats().stores_written == 0


def test_a_leaked_tracer_raises_jax_jit_s_error_and_nothing_is_stored():
    """A function whose trace reads a tracer leaked from an earlier trace: jax.jit raises
    UnexpectedTracerError at the call (the trace takes the tracer as an extra input); before,
    kiln.jit ran its executable without it: 'Computation compiled for 1 inputs but called
    with 0' (JAX's api_test.py test_escaped_tracer_omnistaging under kiln run --jit)."""
    leaked = []

    def leak():
        leaked.append(jnp.add(1, 1))

    def body(_, __):
        jnp.add(leaked[0], 1)
        return None, None

    def g():
        jax.lax.scan(body, None, None, length=2)

    for jit in (jax.jit, kiln.jit):
        leaked.clear()
        jax.jit(leak)()
        with pytest.raises(jax.errors.UnexpectedTracerError, match="was created on line"):
            jit(g)()
    assert kiln.stats().stores_written == 0 and kiln.stats().compiles == 0


@pytest.mark.parametrize("options, call", [
    ({}, lambda f: f(1.0, {"a": 2.0})),
    ({"static_argnums": 0}, lambda f: f(1.0, {"a": 2.0})),
    ({}, lambda f: f(1.0, y={"a": 2.0})),
])
def test_an_error_while_tracing_names_the_function_and_argument_as_jax_jit(options, call):
    """jax names the function (file and line) and the argument's path where a traced value
    meets Python control flow; before, kiln.jit's errors named kiln's wrapper
    ('_wrappers.py:116') and its flat leaves ('dyn_leaves[1]')."""
    def f(x, y):
        if y["a"] > 0:
            return x
        return -x

    want = error_of(lambda: call(jax.jit(f, **options)))
    got = error_of(lambda: call(kiln.jit(f, **options)))
    assert type(got) is type(want) is jax.errors.TracerBoolConversionError
    assert "argument y['a']" in str(want) and f"{__file__}:" in str(want)
    assert str(got) == str(want)


def test_the_traceback_of_an_error_while_tracing_is_jax_jit_s():
    """jax removes its own frames (and now kiln's) from the traceback of an error raised while
    tracing: the user sees the frames a jax.jit call shows, not a dozen of kiln's."""
    import traceback

    def f(x):
        return jnp.dot(x, jnp.ones(3))

    def frames(jit):
        e = error_of(lambda: jit(f)(jnp.ones(2)))
        assert isinstance(e, TypeError)
        return [(fr.filename, fr.name) for fr in traceback.extract_tb(e.__traceback__)]

    want, got = frames(jax.jit), frames(kiln.jit)
    assert got == want
    # kiln's package folder, wherever the checkout is (a clone named ``kiln`` has ``/kiln/`` in
    # every test's path too)
    package = os.path.dirname(kiln.__file__) + os.sep
    assert not [name for name, _ in got if name.startswith(package)]


def test_jax_clear_caches_clears_kiln_s_executables_of_this_process(kiln_store):
    """jax.clear_caches() frees jax.jit's executables; kiln.jit's in-process ones too (the
    store is untouched: the next call loads its entry, with no trace)."""
    f, traces = make_counted(lambda x: x * 2)
    x = jnp.arange(3)
    assert f(x).tolist() == [0, 2, 4] and f._cache_size() == 1
    jax.clear_caches()
    assert f._cache_size() == 0
    assert f(x).tolist() == [0, 2, 4] and f._cache_size() == 1
    assert len(traces) == 1 + audit_traces() and kiln.stats().hits == 1


def test_eval_shape_evaluates_abstractly():
    inner = kiln.jit(lambda x: x * 2)
    out = jax.eval_shape(lambda: inner(jax.ShapeDtypeStruct((), jnp.float32)))
    assert (out.shape, out.dtype) == ((), jnp.float32)
    assert kiln.stats().compiles == 0 and kiln.stats().stores_written == 0


def test_token_arguments_and_results_as_jax_jit():
    a, t = kiln.jit(lambda a, t: (a, t))(jnp.ones(3), jax.lax.create_token())
    assert np.asarray(a).tolist() == [1.0] * 3 and type(t) is type(jax.lax.create_token())
    y, t2 = kiln.jit(lambda a: (a * 2, jax.lax.create_token()))(jnp.ones(3))
    assert np.asarray(y).tolist() == [2.0] * 3 and type(t2) is type(t)


def test_deleting_a_function_frees_what_it_closes_over_at_once():
    """As with jax.jit: no reference cycle keeps the closure alive until the collector runs."""
    import gc
    import weakref

    class Held:
        v = 2.0

    def make(o):
        return kiln.jit(lambda x: x * o.v)

    gc.disable()
    try:
        o = Held()
        ref = weakref.ref(o)
        f = make(o)
        assert np.asarray(f(jnp.ones(3))).tolist() == [2.0] * 3
        del o, f
        assert ref() is None
    finally:
        gc.enable()


def _two(x, y):
    return x + y


def _posonly(x, /, y):
    return x + y


def _gen(x):
    yield x


@pytest.mark.parametrize(
    ("fun", "options"),
    [
        (_two, dict(static_argnums=5)),
        (_two, dict(donate_argnums=5)),
        (_posonly, dict(static_argnames="x")),
        (_two, dict(static_argnums=0, donate_argnums=0)),
        (_gen, {}),
        (staticmethod(_two), {}),
        (classmethod(_two), {}),
        (3, {}),
    ],
    ids=["static_argnums-range", "donate_argnums-range", "posonly-argname", "static-and-donated",
         "generator", "staticmethod", "classmethod", "not-callable"],
)
def test_decoration_errors_are_jax_jits(fun, options):
    """The same exception type and text as jax.jit, raised at decoration like jax.jit."""
    with pytest.raises(Exception) as want:
        jax.jit(fun, **options)
    with pytest.raises(type(want.value)) as got:
        kiln.jit(fun, **options)
    assert str(got.value) == str(want.value)


def test_explicit_static_argnums_and_argnames_are_used_as_given():
    """jax.jit(f, static_argnums=1, static_argnames=()) traces ``y`` passed by keyword."""
    seen = []

    def f(x, y):
        seen.append(isinstance(y, jax.core.Tracer))
        return x + y

    for mk in (jax.jit, kiln.jit):
        seen.clear()
        g = mk(f, static_argnums=1, static_argnames=())
        assert np.asarray(g(1.0, y=jnp.ones(2))).tolist() == [2.0, 2.0]
        assert seen == [True]
    seen.clear()
    g = kiln.jit(f, static_argnums=1)  # names inferred: y static by keyword too
    assert float(g(1.0, y=2.0)) == 3.0 and seen == [False]


@pytest.mark.parametrize(
    "options",
    [dict(keep_unused=True), dict(inline=True),
     dict(compiler_options={"xla_cpu_enable_fast_math": False})],
    ids=["keep_unused", "inline", "compiler_options"],
)
def test_jax_jit_options_are_accepted_and_part_of_the_key(options):
    def f(x, unused):
        return jnp.sin(x) * 2

    x = jnp.arange(3.0)
    want = jax.jit(f, **options)(x, 1.0)
    plain = kiln.jit(f)
    assert np.asarray(plain(x, 1.0)).tolist() == np.asarray(want).tolist()
    with_options = kiln.jit(f, **options)
    assert np.asarray(with_options(x, 1.0)).tolist() == np.asarray(want).tolist()
    assert (kiln.stats().misses, kiln.stats().stores_written) == (2, 2)  # two entries
    with_options.clear_cache()  # this process forgets: the next call reads the store
    again = kiln.jit(f, **options)
    assert np.asarray(again(x, 1.0)).tolist() == np.asarray(want).tolist()
    assert (kiln.stats().hits, kiln.stats().compiles) == (1, 2)


def test_device_and_backend_as_jax_jit():
    """Deprecated in jax (a DeprecationWarning, as jax.jit gives), accepted and keyed."""
    x = jnp.arange(3.0)
    for options in (dict(device=jax.devices()[0]), dict(backend="cpu")):
        with pytest.warns(DeprecationWarning, match="backend and device argument on jit"):
            f = kiln.jit(lambda x: x + 1, **options)
        assert np.asarray(f(x)).tolist() == [1.0, 2.0, 3.0]
    assert kiln.stats().misses == 2


def test_jit_made_again_around_the_same_function_reuses_its_executables():
    """As jax.jit (whose caches hang off the function): no retrace, no store read."""
    traces = []

    def f(x):
        traces.append(1)
        return x * 3

    x = jnp.arange(3.0)
    for _ in range(3):
        assert np.asarray(kiln.jit(f)(x)).tolist() == [0.0, 3.0, 6.0]
    assert len(traces) == 1  # no hit to audit either: the store is never read again
    assert (kiln.stats().misses, kiln.stats().hits, kiln.stats().compiles) == (1, 0, 1)
    g = kiln.jit(f, static_argnums=())  # other options, same meaning: shares too
    g(x)
    h = kiln.jit(f, donate_argnums=0)  # other options: its own executables
    h(jnp.arange(3.0))
    assert kiln.stats().misses == 2


def test_a_python_scalar_and_the_weak_array_a_step_returns_are_one_program(kiln_store) -> None:
    """As jax.jit: a Python int is a weak int32[] (a TrainState's step=0, then the
    step the function returned), so there is one trace and one compile; the result dtypes
    are jax.jit's."""
    traces = []

    def step(n, x):
        traces.append(1)
        return n + 1, x * 2

    f = kiln.jit(step)
    n, x = 0, jnp.ones(3)
    for _ in range(3):
        n, x = f(n, x)
    assert len(traces) == 1
    want_n, _ = jax.jit(step)(jax.jit(step)(0, jnp.ones(3))[0], jnp.ones(3))
    assert int(n) == 3 and n.dtype == want_n.dtype and n.weak_type == want_n.weak_type
    assert kiln.stats().compiles == 1 and kiln.stats().misses == 1


def test_jax_jit_s_keywords_are_typed_once_and_shown_as_jax_jit_shows_them() -> None:
    """kiln.jit's keyword options are one record (``JitKeywords``, with jax.jit's defaults):
    its signature shows each, keyword-only, with jax.jit's default; an unknown keyword is
    jax.jit's TypeError, at decoration."""
    import inspect

    from kiln._jit._options import JIT_DEFAULTS, JitKeywords

    assert set(JIT_DEFAULTS) == set(JitKeywords.__annotations__)
    ours = inspect.signature(kiln.jit).parameters
    theirs = inspect.signature(jax.jit).parameters
    assert list(ours) == ["fun", *JIT_DEFAULTS]
    for name, default in JIT_DEFAULTS.items():
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert ours[name].default == default
        if name in theirs and name not in ("in_shardings", "out_shardings"):
            assert theirs[name].default == default, name  # (shardings: jax's UNSPECIFIED)
    for make in (lambda: jax.jit(lambda x: x, statc_argnums=1),
                 lambda: kiln.jit(lambda x: x, statc_argnums=1),
                 lambda: kiln.jit(statc_argnums=1)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'statc_argnums'"):
            make()
