"""kiln relaxes Python's cyclic garbage collector while it traces and lowers (kiln._base._gc), and
puts back exactly what it found."""

from __future__ import annotations

import gc
import threading

import jax.numpy as jnp
import pytest

import kiln
from kiln._base import _gc


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    was_enabled = gc.isenabled()
    yield before
    gc.set_threshold(*before)
    if was_enabled:
        gc.enable()


def _seen_while_tracing(fun_name: str):
    """A kiln.jit function that records gc's thresholds while it is traced."""
    seen: list[tuple[int, ...]] = []

    def f(x):
        seen.append(gc.get_threshold())
        return jnp.sin(x) * 2.0

    f.__name__ = f.__qualname__ = fun_name
    return kiln.jit(f), seen


def test_relaxed_while_tracing_and_restored_after(kiln_store, thresholds):
    gc.set_threshold(700, 10, 10)
    f, seen = _seen_while_tracing("relaxed_probe")
    assert f(jnp.arange(3.0)).tolist() == (jnp.sin(jnp.arange(3.0)) * 2.0).tolist()
    assert seen == [(_gc.THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)
    assert kiln.stats().traces == 1


def test_nested_kiln_functions_restore_once_at_the_outermost(kiln_store, thresholds):
    gc.set_threshold(500, 7, 9)
    inner, seen_inner = _seen_while_tracing("inner_probe")
    seen_outer: list[tuple[int, ...]] = []

    @kiln.jit
    def outer(x):
        y = inner(x)
        seen_outer.append(gc.get_threshold())  # after the inner trace: still relaxed
        return y + 1.0

    assert outer(jnp.ones(2)).tolist() == (jnp.sin(jnp.ones(2)) * 2.0 + 1.0).tolist()
    assert seen_inner == [(_gc.THRESHOLD, 7, 9)]
    assert seen_outer == [(_gc.THRESHOLD, 7, 9)]
    assert gc.get_threshold() == (500, 7, 9)


@pytest.mark.parametrize("setting", ["disabled", "zero", "higher"])
def test_the_user_s_own_collector_settings_are_left_alone(kiln_store, thresholds, setting):
    want = {"disabled": (700, 10, 10), "zero": (0, 10, 10), "higher": (50_000, 20, 20)}[setting]
    gc.set_threshold(*want)
    if setting == "disabled":
        gc.disable()
    f, seen = _seen_while_tracing(f"probe_{setting}")
    f(jnp.arange(2.0))
    assert seen == [want]
    assert gc.get_threshold() == want
    assert gc.isenabled() is (setting != "disabled")


def test_a_change_made_during_the_trace_is_kept(thresholds):
    gc.set_threshold(700, 10, 10)
    with _gc.relaxed():
        gc.set_threshold(1234, 5, 5)  # the user's (another thread's) own change
    assert gc.get_threshold() == (1234, 5, 5)


def test_threads_share_one_relaxation(thresholds):
    gc.set_threshold(700, 10, 10)
    inside = threading.Event()
    release = threading.Event()

    def other():
        with _gc.relaxed():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    with _gc.relaxed():
        assert gc.get_threshold()[0] == _gc.THRESHOLD
    assert gc.get_threshold()[0] == _gc.THRESHOLD  # the other thread is still tracing
    release.set()
    t.join(30)
    assert gc.get_threshold() == (700, 10, 10)
