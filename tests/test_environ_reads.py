"""Environment variables a trace reads, and settings a library keeps in module globals
(kiln._keys._environ): recorded, keyed, re-checked.

The in-process tests pin the recorder's rules; the cross-process ones (``slow``) run one
program in fresh processes sharing a store, each function through ``kiln.jit`` and through
plain ``jax.jit`` in the same process (the reference):

- A (cold store); B (the same settings, an unrelated variable changed): kiln equals jax, and B
  hits with no trace;
- C (every variable and setting changed): kiln equals jax, whose value differs from A's;
- D (C's settings, a library setting changed by a function at run time).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln
from kiln._base import _jax_compat
from kiln._keys._environ import (
    ENV,
    LIBGLOBALS,
    EnvWatch,
    check_env,
    check_library_globals,
    library_globals,
)
from kiln._keys._recorder import TraceRecorder
from kiln._miss import _compile

_Environ = type(os.environ)


def test_variables_read_are_keyed_by_value_or_absence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_SCALE", "2")
    monkeypatch.setenv("KT_MUL", "5")
    monkeypatch.setenv("KT_UNREAD", "x")
    monkeypatch.delenv("KT_MISSING", raising=False)
    monkeypatch.delenv("KT_FLAG", raising=False)
    with EnvWatch() as w:
        os.environ.get("KT_SCALE")
        os.getenv("KT_MISSING", "1")
        _ = os.environ["KT_MUL"]
        _ = "KT_FLAG" in os.environ
        _ = os.environb.get(b"KT_SCALE")  # the same variable, as bytes
    assert w.unkeyable is None
    assert [i[0] for i in w.items] == ["KT_FLAG", "KT_MISSING", "KT_MUL", "KT_SCALE"]
    assert all(i[1] == ENV and len(i) == 3 for i in w.items)
    by_name = {i[0]: i for i in w.items}
    assert by_name["KT_MISSING"][2] == by_name["KT_FLAG"][2] == "absent"
    assert len(by_name["KT_SCALE"][2]) == 32  # a digest: values (secrets) are not stored
    assert all(check_env(i[0], i[2], False) is None for i in w.items)
    monkeypatch.setenv("KT_UNREAD", "y")  # never read: does not matter
    assert all(check_env(i[0], i[2], False) is None for i in w.items)
    monkeypatch.setenv("KT_SCALE", "3")
    assert check_env(*by_name["KT_SCALE"][::2], False) == "environment variable KT_SCALE changed"
    monkeypatch.setenv("KT_FLAG", "1")
    assert check_env(*by_name["KT_FLAG"][::2], False) == (
        "environment variable KT_FLAG is set now (unset when the entry was made)")
    monkeypatch.delenv("KT_MUL")
    assert check_env(*by_name["KT_MUL"][::2], False) == "environment variable KT_MUL is unset now"


@pytest.mark.parametrize("how", ["dict", "items", "copy", "len", "repr", "loop"])
def test_iterating_the_whole_environment_keys_all_of_it(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("KT_A", "1")
    env = os.environ  # (read here, never handed to a process: tests/test_children.py)
    reads = {"dict": lambda: dict(env), "items": lambda: list(env.items()),
             "copy": lambda: env.copy(), "len": lambda: len(env), "repr": lambda: repr(env),
             "loop": lambda: [k for k in env if k.startswith("KT_")]}
    with EnvWatch() as w:
        os.environ.get("KT_A")
        reads[how]()
    assert w.unkeyable is None
    (item,) = w.items  # the whole environment covers the single reads
    assert item[1] == ENV and item[3] == "all"
    assert check_env(item[0], item[2], True) is None
    monkeypatch.setenv("KT_UNRELATED", "1")  # any change: a miss, never stale
    assert check_env(item[0], item[2], True) is not None


def test_a_variable_the_trace_sets_is_unkeyable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KT_SET", raising=False)
    with EnvWatch() as w:
        os.environ.setdefault("KT_SET", "1")  # read absent, then set: a warm start would differ
    assert w.items == [] and w.unkeyable is not None and "KT_SET" in w.unkeyable
    with EnvWatch() as w:
        os.environ["KT_WRITTEN_ONLY"] = "1"  # written, never read: not an input
    assert w.items == [] and w.unkeyable is None


def test_other_threads_nesting_and_the_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_MINE", "1")
    monkeypatch.setenv("KT_THEIRS", "1")
    originals = {n: _Environ.__dict__[n] for n in ("__getitem__", "__iter__", "__len__")}
    started, done = threading.Event(), threading.Event()

    def elsewhere() -> None:
        started.wait()
        os.environ.get("KT_THEIRS")
        len(os.environ)
        done.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with EnvWatch() as outer:
        assert _Environ.__dict__["__getitem__"] is not originals["__getitem__"]
        with EnvWatch() as inner:
            os.environ.get("KT_MINE")
        started.set()
        done.wait()
    t.join()
    assert [i[0] for i in outer.items] == [i[0] for i in inner.items] == ["KT_MINE"]
    assert {n: _Environ.__dict__[n] for n in originals} == originals


def _traced_codes(fn: Any, *args: Any) -> tuple[TraceRecorder, set[Any]]:
    """Trace ``jax.jit(fn)`` as kiln does: the recorder, and the code the trace ran (as
    :attr:`kiln._miss._program.Program.calls` makes it)."""
    with TraceRecorder() as r:
        traced = jax.jit(fn).trace(*args)
    return r, (_jax_compat.codes_in_jaxpr(traced.jaxpr) - r.callers) | r.codes


def test_kiln_s_and_jax_s_own_reads_are_not_the_trace_s() -> None:
    """Tracing a plain jnp function records no variable and no library setting (pytest's code
    below the trace is not the trace's), nor does jax's compile of an eager operation while
    tracing, which reads XLA_FLAGS for jax's own cache key."""
    r, codes = _traced_codes(lambda x: jnp.sin(x) * 2, jnp.ones(3))
    assert r.reads == [] and r.read_reason is None
    assert library_globals(codes) == []
    with TraceRecorder() as r:
        jax.jit(lambda x: x + jnp.asarray(np.arange(3.0)).sum()).lower(1.0).compile()
    assert r.reads == []


class _Cycle:
    """A reference cycle with a finalizer: collected, not freed by its count."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Cycle.finalized += 1

    finalized = 0


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="Python 3.12+")
def test_a_collection_during_the_trace_is_not_the_trace_s() -> None:
    """A garbage collection that happens while tracing runs the gc callbacks of whatever library
    installed one (hypothesis times collections in module globals) and the finalizers of
    unreachable objects: neither is code the trace ran, so neither is keyed (else a run whose
    collection falls elsewhere misses; CI saw hypothesis's ``_gc_start`` keyed)."""
    from hypothesis.internal.conjecture.junkdrawer import gc_cumulative_time

    gc_cumulative_time()  # installs hypothesis's callback (first in gc.callbacks)
    _Cycle()
    before = _Cycle.finalized

    def f(x: jax.Array) -> jax.Array:
        gc.collect()
        return jnp.sin(x) * 2

    r, codes = _traced_codes(f, jnp.ones(3))
    assert _Cycle.finalized == before + 1  # the collection ran inside the trace
    assert library_globals(codes) == []
    assert _Cycle.__del__.__code__ not in r.codes
    assert f.__code__ in r.codes
    assert not any(getattr(cb, "__module__", "").startswith("kiln") for cb in gc.callbacks)


def test_kiln_jit_keys_what_the_trace_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_JIT_SCALE", "2")
    seen: list[Any] = []
    real = _compile.manifest_for

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(_compile, "manifest_for", spy)

    @kiln.jit
    def f(x: jax.Array) -> jax.Array:
        return x * float(os.environ.get("KT_JIT_SCALE", "1"))

    np.testing.assert_allclose(f(jnp.ones(3)), 2.0)
    items, reason = seen[-1]
    assert reason is None
    assert [i[0] for i in items if i[1] == ENV] == ["KT_JIT_SCALE"]


def test_a_library_s_plain_module_globals_are_keyed_by_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import equinox._errors as errors

    codes = [errors.branched_error_if_impl.__code__]
    (item,) = library_globals(codes)
    module, kind, digest, names = item
    assert (module, kind) == ("equinox._errors", LIBGLOBALS)
    assert "EQX_ON_ERROR" in names.split(",")
    assert "jnp" not in names.split(",")  # modules, functions, classes: not plain values
    assert check_library_globals(module, digest, names) is None
    monkeypatch.setattr(errors, "EQX_ON_ERROR", "nan" if errors.EQX_ON_ERROR != "nan" else "raise")
    assert check_library_globals(module, digest, names) == (
        f"settings of library module equinox._errors changed ({names})")
    # the stdlib, jax and user code are left out
    assert library_globals([os.getenv.__code__, jnp.reshape.__code__,
                            test_variables_read_are_keyed_by_value_or_absence.__code__]) == []


def test_a_trace_of_equinox_keys_eqx_on_error() -> None:
    _, codes = _traced_codes(lambda x: eqx.error_if(x, x > 10, "too big") * 2, jnp.ones(3))
    modules = {i[0]: i[3].split(",") for i in library_globals(codes)}
    assert "EQX_ON_ERROR" in modules["equinox._errors"]
    assert not any(m.startswith(("_pytest", "pluggy")) for m in modules)


# -- across processes ------------------------------------------------------------------------

FAKELIB = '''\
import enum
import os


class Mode(enum.Enum):
    DOUBLE = 2
    TRIPLE = 3


MODE = Mode[os.environ.get("FAKELIB_MODE", "DOUBLE")]  # read once, at import
FACTOR = 1.0


def set_factor(v):
    global FACTOR
    FACTOR = v


def apply(x):
    return x * MODE.value * FACTOR
'''

PROG = '''\
import os
import sys

import equinox as eqx
import fakelib
import jax
import jax.numpy as jnp
import numpy as np

import kiln

if "--factor" in sys.argv:
    fakelib.set_factor(5.0)


def reads_env(x):
    TRACE()
    scale = float(os.environ.get("MYAPP_SCALE", "1"))
    shift = float(os.getenv("MYAPP_SHIFT", "0"))
    mul = float(os.environ["MYAPP_MUL"]) if "MYAPP_MUL" in os.environ else 1.0
    return x * scale * mul + shift


def whole_env(x):
    TRACE()
    return x + sum(1 for k in os.environ if k.startswith("MYAPP_"))


def plain(x):
    TRACE()
    return jnp.sin(x) * 2


def eqx_check(x):
    TRACE()
    return eqx.error_if(x, x > 10, "too big") * 2


def lib_setting(x):
    TRACE()
    return fakelib.apply(x)


x = np.array([1.0, 2.0, 30.0], dtype=np.float32)
for fn in (reads_env, whole_env, plain, eqx_check, lib_setting):
    call(fn.__name__, kiln.jit(fn), x)
    call(fn.__name__ + "_jax", jax.jit(fn), x)
report()
'''

FUNCS = ["reads_env", "whole_env", "plain", "eqx_check", "lib_setting"]
ENV_A = {"MYAPP_SCALE": "2", "EQX_ON_ERROR": "raise", "FAKELIB_MODE": "DOUBLE",
         "UNRELATED_VAR": "1"}
ENV_B = {**ENV_A, "UNRELATED_VAR": "2"}
ENV_C = {"MYAPP_SCALE": "3", "MYAPP_MUL": "5", "EQX_ON_ERROR": "nan", "FAKELIB_MODE": "TRIPLE",
         "UNRELATED_VAR": "2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    prog = xp.Program(tmp_path_factory.mktemp("environ"))
    site = prog.dir / "site-packages"  # a library as installed: kiln counts it by version
    prog.base_env = {"PYTHONPATH": str(site)}
    prog.write("site-packages/fakelib/__init__.py", FAKELIB)
    prog.write("site-packages/fakelib-1.0.dist-info/METADATA",
               "Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
    prog.write("site-packages/fakelib-1.0.dist-info/top_level.txt", "fakelib\n")
    prog.write("site-packages/fakelib-1.0.dist-info/RECORD", "")
    prog.write("prog.py", PROG)
    return {"A": prog.run(env=ENV_A), "B": prog.run(env=ENV_B), "C": prog.run(env=ENV_C),
            "D": prog.run("--factor", env=ENV_C)}


def _counts(rec: dict[str, Any]) -> dict[str, Any]:
    """A record's counts (``eqx_check`` raises where ``EQX_ON_ERROR=raise``, as jax.jit does)."""
    return {k: v for k, v in rec.items() if k != "error"}


def _same(kiln_rec: dict[str, Any], jax_rec: dict[str, Any]) -> Any:
    """kiln's result is jax.jit's (both raised, or equal leaves, NaN equal to NaN)."""
    if "error" in jax_rec:
        assert "error" in kiln_rec, (kiln_rec, jax_rec)
        return "error"
    assert "error" not in kiln_rec, kiln_rec["error"]
    np.testing.assert_array_equal(kiln_rec["leaves"][0], jax_rec["leaves"][0])
    return kiln_rec["leaves"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", FUNCS)
def test_kiln_follows_jax_when_a_variable_or_setting_changes(
    runs: dict[str, Any], xp: Any, name: str
) -> None:
    values = {r: _same(runs[r][name], runs[r][name + "_jax"]) for r in "ABCD"}
    xp.assert_cold(_counts(runs["A"][name]))
    if name != "plain":  # C changed what the function reads: jax's value moved too
        assert repr(values["C"]) != repr(values["A"]), values
    if name == "lib_setting":  # D: the setting changed at run time, by a library function
        assert repr(values["D"]) != repr(values["C"]), values
        assert values["D"] == [15.0, 30.0, 450.0], values


@pytest.mark.slow
@pytest.mark.parametrize("name", FUNCS)
def test_an_unchanged_program_hits(runs: dict[str, Any], xp: Any, name: str) -> None:
    """B: the same settings, an unrelated variable changed: no trace, unless the trace read the
    whole environment (documented: any variable then counts). ``plain`` reads nothing: its key
    holds in C and D too, and jax's own reads (its flags, its cache key) never count."""
    if name == "whole_env":
        assert runs["B"][name]["hits"] == 0, runs["B"][name]
        return
    xp.assert_warm(_counts(runs["B"][name]))
    if name == "plain":  # (C: variables an earlier trace read changed, inputs of its guard:
        # verified once, never compiled; D, C's settings again: remembered)
        xp.assert_same_key(runs["C"][name])
        xp.assert_warm(runs["D"][name])
    if name in ("reads_env", "whole_env", "eqx_check"):  # D: C's settings again
        xp.assert_warm(runs["D"][name])


@pytest.mark.slow
def test_no_kiln_warnings_and_no_bad_entries(runs: dict[str, Any]) -> None:
    for run in runs.values():
        assert run.stats["bad_entries"] == 0, run.stats
        assert "KilnWarning" not in run.stderr, run.stderr[-4000:]
