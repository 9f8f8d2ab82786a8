"""Ahead-of-time stages as jax.stages: ``f.trace``, ``f.lower(...).as_text() / .compile()``,
``cost_analysis``; ``compile()`` uses and fills the store."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln


def add(x, y):
    return x + y


def scale(x, n):
    return x * n


def test_lower_compile_fills_the_store_then_loads_it() -> None:
    x = jnp.arange(3.0)
    lowered = kiln.jit(add).lower(x, 1.0)
    assert isinstance(lowered, kiln.Lowered)
    assert "stablehlo.add" in lowered.as_text()
    compiled = lowered.compile()
    assert isinstance(compiled, kiln.Compiled)
    s = kiln.stats()
    assert (s.traces, s.compiles, s.stores_written) == (1, 1, 1)
    assert np.asarray(compiled(x, 1.0)).tolist() == [1.0, 2.0, 3.0]
    # a call with that signature runs the same executable: nothing more compiles
    f = kiln.jit(add)
    f.clear_cache()
    kiln.reset_stats()
    again = f.lower(x, 2.0).compile()  # another kiln.jit, its table cleared: from the store
    s = kiln.stats()
    assert (s.hits, s.traces, s.compiles) == (1, 0, 0)
    assert np.asarray(again(x, 5.0)).tolist() == [5.0, 6.0, 7.0]
    assert np.asarray(f(x, 1.0)).tolist() == [1.0, 2.0, 3.0]
    assert kiln.stats().compiles == 0 and kiln.stats().hits == 1


def test_cost_analysis_matches_jax() -> None:
    x = jnp.ones((8, 8))

    def mm(a, b):
        return a @ b

    ours = kiln.jit(mm).lower(x, x)
    theirs = jax.jit(mm).lower(x, x)
    assert ours.cost_analysis()["flops"] == theirs.cost_analysis()["flops"]
    compiled = ours.compile()
    assert compiled.cost_analysis()["flops"] == theirs.compile().cost_analysis()["flops"]
    assert "dot" in compiled.as_text()


@pytest.mark.parametrize("bad", [
    (jnp.ones(4), 1.0),  # another shape
    (jnp.ones(3, jnp.int32), 1.0),  # another dtype
    (jnp.ones(3),),  # another structure
    ((jnp.ones(3),), 1.0),
])
def test_compiled_refuses_other_arguments_with_jax_errors(bad: tuple) -> None:
    x = jnp.ones(3)
    ours = kiln.jit(add).lower(x, 1.0).compile()
    theirs = jax.jit(add).lower(x, 1.0).compile()
    with pytest.raises(TypeError) as got:
        ours(*bad)
    with pytest.raises(TypeError) as want:
        theirs(*bad)
    assert str(got.value) == str(want.value)


def test_compiled_takes_dynamic_arguments_only_as_jax() -> None:
    x = jnp.ones(3)
    ours = kiln.jit(scale, static_argnums=1).lower(x, 4).compile()
    theirs = jax.jit(scale, static_argnums=1).lower(x, 4).compile()
    assert np.asarray(ours(x)).tolist() == np.asarray(theirs(x)).tolist() == [4.0] * 3
    with pytest.raises(TypeError) as got:
        ours(x, 4)
    with pytest.raises(TypeError) as want:
        theirs(x, 4)
    assert str(got.value) == str(want.value)


def test_static_array_by_value_lowers() -> None:
    table = np.arange(3.0)
    f = kiln.jit(lambda x, t: x + t, static_argnums=1)
    compiled = f.lower(jnp.ones(3), table).compile()
    assert np.asarray(compiled(jnp.ones(3))).tolist() == [1.0, 2.0, 3.0]
    assert kiln.stats().compiles == 1


def test_filter_jit_lower_compile() -> None:
    f = kiln.filter_jit(lambda x, n, name: (x * n, name))
    compiled = f.lower(jnp.ones(2), 3, "a").compile()
    out, name = compiled(jnp.ones(2), 3, "a")
    assert np.asarray(out).tolist() == [3.0, 3.0] and name == "a"
    with pytest.raises(TypeError, match="Argument types differ"):
        compiled(jnp.ones(2), 4, "a")


def test_trace_gives_jax_traced() -> None:
    traced = kiln.jit(scale, static_argnums=1).trace(jnp.ones(3), 2)
    assert "mul" in str(traced.jaxpr)
    assert np.asarray(traced.lower().compile()(jnp.ones(3))).tolist() == [2.0] * 3
    assert kiln.stats().stores_written == 0  # trace is jax's: nothing stored


def test_lower_under_a_transformation_is_jax_lower() -> None:
    f = kiln.jit(add)
    seen = []

    def outer(x):
        seen.append(type(f.lower(x, 1.0)))
        return x

    jax.jit(outer)(jnp.ones(2))
    assert seen == [jax.stages.Lowered]
