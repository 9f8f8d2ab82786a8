"""What a global config container and a trace-time log line put into the key.

- A global ``types.SimpleNamespace`` or ``dict`` is keyed by the fields the walked code reads by
  constant name (``CFG.lr``, ``CONFIG["lr"]``, ``CONFIG.get("k", d)``): a run name that
  changes from run to run and that the program never reads does not make a warm start miss; a
  use of the container other than such a read (``vars(CFG)``, passed to a function, iterated)
  keys it whole (kiln._keys._constant_fields).
- A global only handed to a log line or ``print`` while tracing (``logger.info("... %s",
  RUN_ID)``) is not part of the program and is not keyed; a value computed from it, or the
  global used elsewhere in the function, is (kiln._keys._callback_roots.log_only_names).

Each has a staleness test (a read field changed gives the new value) and a hit test (what was
not read changed: the second call traces nothing).
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln
from kiln._keys._callback_roots import log_only_names
from kiln._keys._constant_fields import constant_fields
from kiln._keys._fingerprint import fingerprint

logger = logging.getLogger(__name__)

CFG = types.SimpleNamespace(lr=0.5, depth=2, run_name="run-1")
CONFIG = {"scale": 2.0, "run_id": "a1"}
RUN_ID = "run-1"
OTHER = 3.0


def f_fields(x: Any) -> Any:
    for _ in range(CFG.depth):
        x = x * CFG.lr
    return x * CONFIG["scale"] + CONFIG.get("shift", 0.0)


def f_whole(x: Any) -> Any:
    return x * len(vars(CFG))


def f_logged(x: Any) -> Any:
    logger.info("tracing f_logged in run %s (%s)", RUN_ID, OTHER)
    print("tracing in", RUN_ID, file=sys.stderr)
    return x * OTHER


def f_logged_and_read(x: Any) -> Any:
    logger.info("tracing in run %s", RUN_ID)
    return x * len(RUN_ID)


def f_computed_in_the_log(x: Any) -> Any:
    logger.info("tracing in run %s", RUN_ID.upper())
    return x


def _digest(fn: Any) -> str:
    fp = fingerprint(fn)
    assert fp.sound, fp.reason
    return fp.digest


def test_constant_fields_reads_the_code() -> None:
    codes = [f_fields.__code__]
    assert constant_fields(codes, "CFG", mapping=False) == {"lr", "depth"}
    assert constant_fields(codes, "CONFIG", mapping=True) == {"scale", "shift"}
    assert constant_fields([f_whole.__code__], "CFG", mapping=False) is None

    def stored(x: Any) -> Any:
        CONFIG["scale"] = x  # a store: keyed whole
        return x

    def passed(x: Any) -> Any:
        return x * float(np.sum(list(CONFIG.values())))

    def membership(x: Any) -> Any:
        return x if "scale" in CONFIG else -x

    for fn in (stored, passed, membership):
        assert constant_fields([fn.__code__], "CONFIG", mapping=True) is None, fn.__name__


def test_a_config_container_is_keyed_by_the_fields_read(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _digest(f_fields)
    monkeypatch.setattr(CFG, "run_name", "run-2")  # never read
    monkeypatch.setitem(CONFIG, "run_id", "b2")
    assert _digest(f_fields) == before
    monkeypatch.setattr(CFG, "lr", 0.25)  # read
    assert _digest(f_fields) != before
    monkeypatch.setattr(CFG, "lr", 0.5)
    assert _digest(f_fields) == before
    monkeypatch.setitem(CONFIG, "shift", 1.0)  # read with .get, absent before
    assert _digest(f_fields) != before


ACTS = {name: getattr(jax.nn, name) for name in ("relu", "tanh", "gelu", "silu")}


def f_activation(x: Any) -> Any:
    return ACTS["relu"](x) * 2  # a call of an entry read by a constant name


def test_a_dict_of_functions_is_keyed_by_the_entry_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dict built from a set of names (its order follows the hash seed: another in every
    process) and called through one constant name: keyed by that entry alone, so its order
    and the other entries do not count, and that entry does."""
    assert constant_fields([f_activation.__code__], "ACTS", mapping=True) == {"relu"}
    before = _digest(f_activation)
    monkeypatch.setattr(sys.modules[__name__], "ACTS", dict(reversed(list(ACTS.items()))))
    assert _digest(f_activation) == before
    monkeypatch.setitem(ACTS, "tanh", jax.nn.sigmoid)  # never called
    assert _digest(f_activation) == before
    monkeypatch.setitem(ACTS, "relu", jax.nn.relu6)
    assert _digest(f_activation) != before


def test_a_config_container_used_whole_is_keyed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _digest(f_whole)
    monkeypatch.setattr(CFG, "run_name", "run-2")
    assert _digest(f_whole) != before


def test_a_global_only_logged_is_not_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert log_only_names(f_logged) == {"RUN_ID"}
    assert log_only_names(f_logged_and_read) == set()
    assert log_only_names(f_computed_in_the_log) == set()
    me = sys.modules[__name__]
    before = {fn: _digest(fn) for fn in (f_logged, f_logged_and_read, f_computed_in_the_log)}
    monkeypatch.setattr(me, "RUN_ID", "run-22")
    assert _digest(f_logged) == before[f_logged]
    assert _digest(f_logged_and_read) != before[f_logged_and_read]
    assert _digest(f_computed_in_the_log) != before[f_computed_in_the_log]
    monkeypatch.setattr(me, "OTHER", 4.0)  # logged, and read by the program
    assert _digest(f_logged) != before[f_logged]


def test_hits_and_staleness_through_kiln_jit(kiln_store: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    me = sys.modules[__name__]
    x = jnp.arange(3.0)
    fields, logged = kiln.jit(f_fields), kiln.jit(f_logged)
    np.testing.assert_allclose(fields(x), x * 0.25 * 2.0)
    np.testing.assert_allclose(logged(x), x * 3.0)
    assert kiln.stats().traces == 2
    # what no trace read changed: a warm start traces nothing
    monkeypatch.setattr(CFG, "run_name", "run-2")
    monkeypatch.setitem(CONFIG, "run_id", "b2")
    monkeypatch.setattr(me, "RUN_ID", "run-2")
    fields.clear_cache()
    logged.clear_cache()
    np.testing.assert_allclose(fields(x), x * 0.25 * 2.0)
    np.testing.assert_allclose(logged(x), x * 3.0)
    s = kiln.stats()
    assert (s.hits, s.traces) == (2, 2)
    # what a trace read changed: the new value (in a new process; within one, as jax.jit, the
    # traced program stays until the cache is cleared)
    monkeypatch.setattr(CFG, "depth", 1)
    monkeypatch.setitem(CONFIG, "shift", 1.0)
    monkeypatch.setattr(me, "OTHER", 5.0)
    fields.clear_cache()
    logged.clear_cache()
    np.testing.assert_allclose(fields(x), x * 0.5 * 2.0 + 1.0)
    np.testing.assert_allclose(logged(x), x * 5.0)
    assert kiln.stats().traces == 4


# ---- what a breaker found: each was a stale hit, or a walk that failed, before its fix


def test_a_container_named_by_a_string_is_keyed_whole() -> None:
    def by_getattr(x: Any) -> Any:
        return x * getattr(sys.modules[__name__], "CFG").lr

    def by_globals(x: Any) -> Any:
        return x * globals()["CONFIG"]["scale"]

    assert constant_fields([by_getattr.__code__], "CFG", mapping=False) is None
    assert constant_fields([by_globals.__code__], "CONFIG", mapping=True) is None


SINK: list[Any] = []


class _Collecting(logging.Logger):
    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:  # not logging's own
        SINK.append(args)


_collecting = _Collecting("kiln-test-collecting")


def test_only_logging_s_own_log_calls_and_python_s_own_print_drop_a_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def also_by_string(x: Any) -> Any:
        print("scale", OTHER)
        return x * globals()["OTHER"]

    def to_a_sink(x: Any) -> Any:
        print("run", file=SINK)  # type: ignore[arg-type]  # a keyword value is no log text
        return x

    def overridden(x: Any) -> Any:
        _collecting.info("run %s", RUN_ID)
        return x

    def patched(x: Any) -> Any:
        print("run", RUN_ID)
        return x

    assert log_only_names(also_by_string) == set()
    assert log_only_names(to_a_sink) == set()
    assert log_only_names(overridden) == set()
    assert log_only_names(patched) == {"RUN_ID"}
    import builtins

    monkeypatch.setattr(builtins, "print", lambda *a, **k: SINK.append(a))
    from kiln._keys import _callback_roots

    _callback_roots._log_cache.clear()
    assert log_only_names(patched) == set()  # a patched print may do anything with it
    _callback_roots._log_cache.clear()


OPT = types.SimpleNamespace(lr=2.0)


def _act(v: Any) -> Any:
    return v * OPT.lr


CHAIN = types.SimpleNamespace(fn=_act, run="run-1")


def test_a_config_field_leading_to_another_config_is_walked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Walking a field of one config met another (the walk failed: "dictionary changed size
    during iteration", and every run took the verify path)."""

    def f(x: Any) -> Any:
        return CHAIN.fn(x)

    before = _digest(f)
    monkeypatch.setattr(CHAIN, "run", "run-2")
    assert _digest(f) == before
    monkeypatch.setattr(OPT, "lr", 3.0)
    assert _digest(f) != before
