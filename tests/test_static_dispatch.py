"""Static arguments on jax's C++ dispatcher: a cached signature with static
values runs with no kiln Python beyond giving unhashable values (arrays by value) a digest, and
is never stale: equal-but-different-type values, arrays changed in place, and values kiln
cannot digest each take the path they must."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln


def counted(body):
    traces: list[int] = []

    def f(*args, **kwargs):
        traces.append(1)
        return body(*args, **kwargs)

    return f, traces


def test_cached_static_calls_bypass_python_and_types_stay_apart() -> None:
    body, traces = counted(lambda x, n: x * n)
    f = kiln.jit(body, static_argnums=1)
    x = jnp.float32(2.0)
    for n in (1, 1.0, True, 1, 1.0, True):
        assert float(f(x, n)) == 2.0 * n
    assert len(traces) == 3  # 1, 1.0 and True are three programs, as with jax.jit
    kiln.reset_stats()
    for _ in range(5):
        f(x, 1)
    assert kiln.stats().calls_hot == 0  # served by the C++ dispatcher


def test_numpy_static_by_value_on_the_cpp_path_and_in_place_edits() -> None:
    body, traces = counted(lambda x, table: x + table.sum())
    f = kiln.jit(body, static_argnames="table")
    x = jnp.float32(0.0)
    table = np.arange(4.0, dtype=np.float32)
    assert float(f(x, table=table)) == 6.0
    kiln.reset_stats()
    assert float(f(x, table=np.arange(4.0, dtype=np.float32))) == 6.0  # equal bytes: a hit
    assert kiln.stats().calls_hot == 0 and len(traces) == 1
    table[0] = 10.0  # changed in place: never the old executable
    assert float(f(x, table=table)) == 16.0
    assert len(traces) == 2
    assert float(f(x, table=jnp.arange(4.0))) == 6.0  # a jax Array by value


def test_tuple_of_arrays_and_positional_or_keyword_static() -> None:
    traces = []

    def body(x, cfg):
        traces.append(1)
        return x + cfg[0].sum() + cfg[1]

    f = kiln.jit(body, static_argnums=1)
    x = jnp.float32(1.0)
    cfg = (np.ones(3, np.float32), 2.0)
    assert float(f(x, cfg)) == 6.0
    assert float(f(x, cfg=cfg)) == 6.0  # by name: the same program
    assert float(f(x, (np.ones(3, np.float32), 2.0))) == 6.0
    assert len(traces) == 1


def test_undigestable_static_raises_kiln_error_from_the_cpp_path() -> None:
    f = kiln.jit(lambda x, t: x, static_argnums=1)
    with pytest.raises(kiln.StaticArgumentError, match="unhashable"):
        f(jnp.ones(2), [object()])
    with pytest.raises(kiln.StaticArgumentError, match="object array"):
        f(jnp.ones(2), np.array([object()], dtype=object))


def test_negative_static_argnums_stay_correct() -> None:
    body, traces = counted(lambda x, n: x * n)
    f = kiln.jit(body, static_argnums=-1)
    assert float(f(jnp.float32(2.0), 3)) == 6.0
    assert float(f(jnp.float32(2.0), 3)) == 6.0
    assert float(f(jnp.float32(2.0), 4)) == 8.0
    assert len(traces) == 2


def test_static_results_match_jax_jit() -> None:
    def body(x, shape, scale):
        return jnp.broadcast_to(x, shape) * scale

    ours = kiln.jit(body, static_argnums=(1, 2))
    theirs = jax.jit(body, static_argnums=(1, 2))
    for shape, scale in [((2,), 1.5), ((3, 2), 2), ((2,), 1.5)]:
        np.testing.assert_array_equal(ours(jnp.ones(()), shape, scale),
                                      theirs(jnp.ones(()), shape, scale))


def test_reused_digest_object_always_carries_this_calls_array() -> None:
    """Small arrays share one hashable key object per digest; a miss must still see the array
    of its own call, never an earlier array with that digest that was changed since."""
    f = kiln.jit(lambda x, table: x + table.sum(), static_argnames="table")
    t1 = np.arange(4.0, dtype=np.float32)  # sum 6
    assert f(jnp.zeros(2), table=t1).tolist() == [6.0, 6.0]
    t1[:] = 1.0  # sum 4: t1 now has another digest
    assert f(jnp.zeros(2), table=t1).tolist() == [4.0, 4.0]
    t2 = np.arange(4.0, dtype=np.float32)  # the first digest again
    # another x shape: the C++ cache misses and the Python path reads the key's array
    assert f(jnp.zeros(3), table=t2).tolist() == [6.0, 6.0, 6.0]


def test_nested_call_with_a_static_array_changed_in_place() -> None:
    """A wrong result before this change: the nested jax.jit kept per static digest bound the
    array object itself, so an array changed in place was traced with its new content under
    the old digest."""
    f = kiln.jit(lambda x, table: x + table.sum(), static_argnames="table")

    def g(x, t):
        return jax.jit(lambda x: f(x, table=t))(x)

    t1 = np.arange(4.0, dtype=np.float32)
    assert g(jnp.zeros(2), t1).tolist() == [6.0, 6.0]
    t1[:] = 1.0
    assert g(jnp.zeros(2), t1).tolist() == [4.0, 4.0]
    assert g(jnp.zeros(3), np.arange(4.0, dtype=np.float32)).tolist() == [6.0, 6.0, 6.0]
