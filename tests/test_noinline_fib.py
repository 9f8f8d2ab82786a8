"""kiln.noinline on a recursive function: each ``fib(k)`` is compiled once, so the number of
compiles grows linearly in ``t``. (A plain ``jax.jit`` of the same recursion, nested ``jax.jit``
with a static ``t``, compiles in time exponential in ``t``: XLA inlines every call,
jax-ml/jax #22385.) Timings are in ``benchmarks/noinline_fib.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln

X = jnp.arange(1.0, 4.0)


def _make_fib():
    """A fresh noinline function per test, so no test reuses another's sub-functions."""

    @kiln.noinline(static_argnames="t", tier_up=False)
    def fib(x, t):
        if t < 2:
            return x
        return fib(x, t=t - 1) + fib(x, t=t - 2)

    return fib


def _reference(t: int) -> int:
    """fib(x, t) / x, in pure Python: 1, 1, 2, 3, 5, ..."""
    a, b = 1, 1
    for _ in range(t - 1):
        a, b = b, a + b
    return b


def _calls(t: int) -> int:
    """fib calls made by one fib(t), each a host round trip: 1, 1, 3, 5, 9, ..."""
    return 2 * _reference(t) - 1


def test_reference():
    assert [_reference(t) for t in range(8)] == [1, 1, 2, 3, 5, 8, 13, 21]
    assert [_calls(t) for t in range(6)] == [1, 1, 3, 5, 9, 15]


@pytest.mark.parametrize("t", [8, 12])
def test_each_fib_k_is_compiled_once(t):
    fib = _make_fib()
    program = jax.jit(lambda x: fib(x, t=t))
    out = program(X)
    np.testing.assert_array_equal(out, _reference(t) * np.arange(1.0, 4.0))
    s = kiln.stats()
    # fib(0), ..., fib(t): each traced and compiled once (the outer jax.jit is not kiln's)
    assert s.compiles == s.misses == s.traces == t + 1
    assert s.stores_written == t + 1
    assert s.noinline_calls == _calls(t)
    assert s.tier_ups == 0

    np.testing.assert_array_equal(program(X), out)
    s2 = kiln.stats()
    assert s2.compiles == t + 1 and s2.traces == t + 1
    assert s2.noinline_calls == 2 * _calls(t)


@pytest.mark.parametrize("t", [8, 12])
def test_second_program_reuses_every_fib_k(t):
    fib = _make_fib()
    jax.jit(lambda x: fib(x, t=t))(X)
    assert kiln.stats().compiles == t + 1

    out = kiln.jit(lambda x: fib(x, t=t) * 2)(X)
    kiln.wait_for_tier_up()
    np.testing.assert_array_equal(out, 2 * _reference(t) * np.arange(1.0, 4.0))
    s = kiln.stats()
    # only the second program's own (kiln.jit) executable; tier_up=False: no inlined form
    assert s.compiles == t + 2
    assert s.tier_ups == 0
    assert s.noinline_calls == 2 * _calls(t)


def test_one_more_level_adds_one_compile():
    t = 8
    fib = _make_fib()
    jax.jit(lambda x: fib(x, t=t))(X)
    assert kiln.stats().compiles == t + 1

    out = jax.jit(lambda x: fib(x, t=t + 1))(X)
    np.testing.assert_array_equal(out, _reference(t + 1) * np.arange(1.0, 4.0))
    assert kiln.stats().compiles == t + 2  # fib(t + 1)

    out = kiln.jit(lambda x: fib(x, t=t + 2) * 2)(X)
    kiln.wait_for_tier_up()
    np.testing.assert_array_equal(out, 2 * _reference(t + 2) * np.arange(1.0, 4.0))
    assert kiln.stats().compiles == t + 4  # fib(t + 2) and the outer kiln.jit program
    assert kiln.stats().tier_ups == 0


def test_other_static_values_and_shapes_are_new_signatures():
    fib = _make_fib()
    jax.jit(lambda x: fib(x, t=5))(X)
    assert kiln.stats().compiles == 6
    # a lower t reuses everything; a new shape is a new abstract signature for every fib(k)
    np.testing.assert_array_equal(jax.jit(lambda x: fib(x, t=3))(X), 3 * np.arange(1.0, 4.0))
    assert kiln.stats().compiles == 6
    np.testing.assert_array_equal(jax.jit(lambda x: fib(x, t=5))(jnp.ones(2)), [8.0, 8.0])
    assert kiln.stats().compiles == 12
