"""Two contracts: ``kiln.jit`` is ``jax.jit``'s, ``kiln.filter_jit`` is ``equinox.filter_jit``'s.

Each test runs the same code through kiln and through the library it stands in for, in the
same process, and compares results, errors and trace counts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _error_of(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with jax's below
        call()
    return info.value


def counted(body: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``body`` plus a list that grows by one each time it runs (each trace)."""
    traces: list[int] = []

    def f(*args: Any, **kwargs: Any) -> Any:
        traces.append(1)
        return body(*args, **kwargs)

    f.__name__ = f.__qualname__ = getattr(body, "__name__", "f")
    return f, traces


# ------------------------------------------------------------------ kiln.jit: jax.jit's contract
@pytest.mark.parametrize("arg", ["foo", len, object()])
def test_jit_refuses_a_non_jax_argument_as_jax_jit_does(arg: Any) -> None:
    def ident(x):
        return x

    ours, theirs = _error_of(lambda: kiln.jit(ident)(arg)), _error_of(lambda: jax.jit(ident)(arg))
    assert type(ours) is type(theirs) is TypeError
    assert _no_addresses(str(ours)) == _no_addresses(str(theirs))
    assert "passed to the function at path x" in str(ours)


def test_jit_refuses_a_non_jax_output_as_jax_jit_does() -> None:
    def tagged(x):
        return x, "tag"

    ours = _error_of(lambda: kiln.jit(tagged)(jnp.ones(2)))
    theirs = _error_of(lambda: jax.jit(tagged)(jnp.ones(2)))
    assert type(ours) is type(theirs) is TypeError
    assert "not a valid JAX type" in str(ours) and "not a valid JAX type" in str(theirs)
    assert kiln.stats().stores_written == 0


def test_jit_names_the_module_field_jax_jit_names() -> None:
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))

    def apply(model, x):
        return model(x)

    ours = _error_of(lambda: kiln.jit(apply)(mlp, jnp.ones(2)))
    theirs = _error_of(lambda: jax.jit(apply)(mlp, jnp.ones(2)))
    assert _no_addresses(str(ours)) == _no_addresses(str(theirs))
    assert "model.activation" in str(ours)


def test_jit_traces_python_scalars() -> None:
    f, traces = counted(lambda x, n: x * n)
    jf = kiln.jit(f)
    assert [float(jf(jnp.float32(1.0), n)) for n in (2, 3, 4)] == [2.0, 3.0, 4.0]
    assert len(traces) == 1  # one program for every int, as jax.jit


# --------------------------------------------------------- kiln.filter_jit: equinox's contract
def _both(body: Callable[..., Any], **kwargs: Any) -> tuple[Any, list[int], Any, list[int]]:
    ours, our_traces = counted(body)
    theirs, their_traces = counted(body)
    return kiln.filter_jit(ours, **kwargs), our_traces, eqx.filter_jit(theirs, **kwargs), \
        their_traces


def test_filter_jit_keeps_non_arrays_static_and_counts_traces_as_equinox() -> None:
    def body(x, n, name, act=jax.nn.relu):
        return act(x * n - 1.0), n + 1, name.upper()

    ours, our_traces, theirs, their_traces = _both(body)
    x = jnp.arange(3.0)
    calls = [(x, 1, "a"), (x, 2, "a"), (x, 1, "a"), (x, 1, "b"), (np.arange(3.0), 1, "a")]
    for args in calls:
        got, want = ours(*args), theirs(*args)
        np.testing.assert_allclose(got[0], want[0])
        assert got[1:] == want[1:] and type(got[1]) is int  # non-array outputs pass as they are
    ours(x, n=2, name="a")  # bound to the signature: the same program as ours(x, 2, "a")
    theirs(x, n=2, name="a")
    ours(x, 1, "a", act=jnp.tanh)
    theirs(x, 1, "a", act=jnp.tanh)
    assert len(our_traces) == len(their_traces) == 5


def test_filter_jit_module_with_function_and_int_fields() -> None:
    class RNN(eqx.Module):
        cell: eqx.nn.GRUCell
        hidden_size: int
        act: Callable[..., Any]

        def __call__(self, xs):
            def step(h, x):
                h = self.cell(x, h)
                return h, self.act(h)

            return jax.lax.scan(step, jnp.zeros(self.hidden_size), xs)[1]

    model = RNN(eqx.nn.GRUCell(2, 5, key=jax.random.key(1)), 5, jnp.tanh)
    xs = jnp.ones((4, 2))

    def body(model, xs):
        return model(xs).sum()

    ours, our_traces, theirs, their_traces = _both(body)
    np.testing.assert_allclose(ours(model, xs), theirs(model, xs), rtol=1e-6)
    # grad through a nested filter_jit whose Module holds a function and an int (item 11)
    g = jax.grad(lambda xs: ours(model, xs))(xs)
    np.testing.assert_allclose(g, jax.grad(lambda xs: theirs(model, xs))(xs), rtol=1e-6)
    vals = jax.vmap(lambda xs: ours(model, xs))(jnp.ones((3, 4, 2)))
    assert vals.shape == (3,)
    # and a kiln.jit of it fails as jax.jit does (hidden_size is traced there)
    ours_jit = _error_of(lambda: kiln.jit(body)(model, xs))
    assert type(ours_jit) is type(_error_of(lambda: jax.jit(body)(model, xs)))


@pytest.mark.parametrize(("donate", "deleted"), [
    ("none", (False, False)), ("all", (True, True)), ("all-except-first", (False, True)),
    ("warn", (True, True)), ("warn-except-first", (False, True)),
])
def test_filter_jit_donate_modes_as_equinox(donate: str, deleted: tuple[bool, bool]) -> None:
    def body(a, b):
        return a + 1.0, b * 2.0

    for make in (kiln.filter_jit, eqx.filter_jit):
        a, b = jnp.ones(4), jnp.ones(4)
        out = make(body, donate=donate)(a, b)
        assert (a.is_deleted(), b.is_deleted()) == deleted, make
        assert np.asarray(out[0]).tolist() == [2.0] * 4


def test_filter_jit_refuses_what_equinox_refuses() -> None:
    def body(x):
        return x

    for kwargs in ({"donate": "some"}, {"static_argnums": 0}, {"in_shardings": None}):
        ours, theirs = (_error_of(lambda k=kwargs: kiln.filter_jit(body, **k)),
                        _error_of(lambda k=kwargs: eqx.filter_jit(body, **k)))
        assert type(ours) is type(theirs) is ValueError
        assert str(ours) == str(theirs)


def test_filter_jit_warm_start_from_store() -> None:
    def body(x, n):
        return x * n

    f = kiln.filter_jit(body)
    f(jnp.ones(2), 3)
    f.clear_cache()
    kiln.reset_stats()
    assert np.asarray(kiln.filter_jit(body)(jnp.ones(2), 3)).tolist() == [3.0, 3.0]
    s = kiln.stats()
    assert (s.hits, s.traces, s.compiles) == (1, 0, 0)
    kiln.filter_jit(body)(jnp.ones(2), 4)  # another static int: another program
    assert kiln.stats().compiles == 1


def test_jit_and_filter_jit_are_different_entries() -> None:
    def body(x):
        return x + 1.0

    kiln.jit(body)(jnp.ones(2))
    kiln.filter_jit(body)(jnp.ones(2))
    assert kiln.stats().compiles == 2  # non-array outputs differ between the two contracts


# ----------------------------------------------------------- item 6: nested and top level
@pytest.mark.parametrize("make", [kiln.jit, kiln.filter_jit])
@pytest.mark.parametrize("order", ["top-first", "nested-first"])
def test_nested_and_top_level_trace_once_per_signature(make: Any, order: str) -> None:
    body, traces = counted(lambda x: jnp.sin(x) * 2.0)
    f = make(body)
    outer = jax.jit(lambda x: f(x) + 1.0)
    x = jnp.arange(3.0)
    steps = [lambda: f(x), lambda: outer(x)]
    for step in steps if order == "top-first" else steps[::-1]:
        step()
    np.testing.assert_allclose(outer(x), jnp.sin(x) * 2.0 + 1.0, rtol=1e-6)
    ref_body, ref_traces = counted(lambda x: jnp.sin(x) * 2.0)
    g = jax.jit(ref_body)
    ref_outer = jax.jit(lambda x: g(x) + 1.0)
    ref_steps = [lambda: g(x), lambda: ref_outer(x)]
    for step in ref_steps if order == "top-first" else ref_steps[::-1]:
        step()
    assert len(traces) == len(ref_traces) == 1


def test_nested_filter_jit_non_array_outputs_per_signature() -> None:
    """Non-array outputs are kept per traced signature: a cached trace never returns
    another signature's."""
    f = kiln.filter_jit(lambda x: (x * 2, x.shape[0]))
    for n in (2, 3, 2):
        out, size = jax.jit(lambda x: f(x))(jnp.ones(n))  # noqa: B023
        assert size == n and out.shape == (n,)
        top, size = f(jnp.ones(n))
        assert size == n and top.shape == (n,)


def test_donation_is_part_of_the_key() -> None:
    """An executable that donates its input is never served to a function that keeps it."""

    def body(x):
        return x + 1.0

    a = jnp.ones(3)
    kiln.jit(body, donate_argnums=0)(a)
    assert a.is_deleted()
    b = jnp.ones(3)
    assert np.asarray(kiln.jit(body)(b)).tolist() == [2.0] * 3
    assert not b.is_deleted()
    assert kiln.stats().compiles == 2 and kiln.stats().hits == 0


def _module_method(make: Callable[..., Any], **kwargs: Any) -> tuple[Any, list[int]]:
    """A Module whose method is ``make``-jitted (bound ``self``), and its trace counter."""
    traces: list[int] = []

    class Linear(eqx.Module):
        w: jax.Array

        @make(**kwargs)
        def __call__(self, x):
            traces.append(1)
            return self.w * x

    return Linear(jnp.full(3, 2.0)), traces


@pytest.mark.parametrize("how", ["call", "grad-x", "grad-self", "vmap", "outer-jit"])
def test_filter_jit_method_traces_as_equinox(how: str) -> None:
    """A filter_jit method of a Module, called directly and under grad / vmap / an
    outer jit, twice: the same trace count and values as equinox.filter_jit."""
    x = jnp.arange(3.0)
    got = {}
    for make in (kiln.filter_jit, eqx.filter_jit):
        m, traces = _module_method(make)
        call = {
            "call": lambda: m(x),
            "grad-x": lambda: jax.grad(lambda x: m(x).sum())(x),
            "grad-self": lambda: jax.grad(lambda m: m(x).sum())(m).w,
            "vmap": lambda: jax.vmap(m)(jnp.ones((2, 3))),
            "outer-jit": lambda: jax.jit(lambda x: m(x))(x),
        }[how]
        first, second = call(), call()
        np.testing.assert_allclose(first, second)
        got[make] = (len(traces), np.asarray(first).tolist())
    assert got[kiln.filter_jit] == got[eqx.filter_jit]
    assert got[kiln.filter_jit][0] == 1


def test_filter_jit_method_donates_self_s_buffers_as_equinox() -> None:
    for make in (kiln.filter_jit, eqx.filter_jit):
        class State(eqx.Module):
            w: jax.Array

            @make(donate="all")
            def step(self, x):
                return State(self.w + x)

        s = State(jnp.ones(3))
        out = s.step(jnp.ones(3))
        assert s.w.is_deleted(), make
        assert np.asarray(out.w).tolist() == [2.0] * 3


class _Buffered(eqx.Module):
    """A Module called as the function (``filter_jit(instance)``): arrays, a function leaf and
    an int, which equinox partitions as it does an argument's."""

    buffer: jax.Array
    mlp: eqx.nn.MLP
    scale: int = eqx.field(static=True)

    def __call__(self, x):
        return self.mlp(x) * self.scale, eqx.tree_at(lambda s: s.buffer, self,
                                                      self.buffer.at[0].add(1.0))


def _buffered(seed: int) -> _Buffered:
    return _Buffered(jnp.zeros(8), eqx.nn.MLP(3, 3, 4, 1, key=jax.random.key(seed)), 2)


def _deleted(tree: Any) -> list[bool]:
    return [x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize(("donate", "fun_deleted", "x_deleted"), [
    ("all", True, True), ("all-except-first", True, False), ("none", False, False),
])
def test_filter_jit_of_a_module_donates_its_buffers_and_traces_once_as_equinox(
    donate: str, fun_deleted: bool, x_deleted: bool,
) -> None:
    """``filter_jit(instance, donate=...)``: the instance's arrays are traced and donated with
    the arguments after the first, as equinox does; a new instance of the same
    structure (new weights, the step's output) is the same program: no new trace."""
    results = {}
    for make in (kiln.filter_jit, eqx.filter_jit):
        kiln.reset_stats()
        m, x = _buffered(0), jnp.ones(3)
        y, m2 = make(m, donate=donate)(x)
        assert _deleted(m) == [fun_deleted] * len(_deleted(m)), make
        assert x.is_deleted() is x_deleted, make
        assert not any(_deleted(m2))
        y2, m3 = make(m2, donate=donate)(jnp.ones(3))  # new buffers: one program still
        assert _deleted(m2) == [fun_deleted] * len(_deleted(m2)), make
        results[make] = (np.asarray(y).tolist(), np.asarray(y2).tolist(),
                         np.asarray(m3.buffer).tolist(), kiln.stats().traces)
    ours, theirs = results[kiln.filter_jit], results[eqx.filter_jit]
    assert ours[:3] == theirs[:3]
    assert ours[2][0] == 2.0
    assert ours[3] == 1 and theirs[3] == 0  # (kiln's counter: equinox's call is jax's)
    assert kiln.stats().compiles == 0  # (reset before equinox's run)


def test_filter_jit_of_a_module_keys_its_weights_as_arguments() -> None:
    """The Module's arrays are arguments, not constants: other weights give other values from
    the one program; its static leaves (the int, the activation) are keyed by value."""
    f0, f1 = kiln.filter_jit(_buffered(0)), kiln.filter_jit(_buffered(1))
    x = jnp.ones(3)
    assert np.asarray(f0(x)[0]).tolist() == np.asarray(eqx.filter_jit(_buffered(0))(x)[0]).tolist()
    assert np.asarray(f1(x)[0]).tolist() == np.asarray(eqx.filter_jit(_buffered(1))(x)[0]).tolist()
    assert kiln.stats().traces == 1 and kiln.stats().compiles == 1
    other = dataclasses.replace(_buffered(0), scale=3)
    y = kiln.filter_jit(other)(x)[0]
    assert np.asarray(y).tolist() == np.asarray(eqx.filter_jit(other)(x)[0]).tolist()
    assert kiln.stats().traces == 2  # a static field changed: another program
    # its arrays are traced: a gradient through them, as equinox's
    grads = [eqx.filter_grad(lambda m, make=make: make(m)(x)[0].sum())(_buffered(0))
             for make in (kiln.filter_jit, eqx.filter_jit)]
    ours, theirs = (np.asarray(g.mlp.layers[0].weight) for g in grads)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert np.abs(ours).sum() > 0


def test_filter_jit_aot_with_compiler_options_as_equinox() -> None:
    def body(x, scale):
        return x * scale

    x = jnp.arange(3.0)
    for make in (kiln.filter_jit, eqx.filter_jit):
        compiled = make(body).lower(x, 2.0).compile(
            compiler_options={"xla_embed_ir_in_executable": False})
        assert np.asarray(compiled(x, 2.0)).tolist() == [0.0, 2.0, 4.0], make
    with pytest.raises(Exception, match="No such compile option"):
        kiln.filter_jit(body).lower(x, 2.0).compile(compiler_options={"invalid_key": "v"})
    assert kiln.stats().compiles == 0  # neither compile was kiln's (nothing stored)


def test_jit_aot_surface_as_jax() -> None:
    def f(x, y):
        return jax.tree.map(lambda i: i * 2, x), y * 2

    x = {"A": jnp.array(1.0), "B": jnp.array(2.0)}
    y = jnp.array(3.0)
    ours = kiln.jit(f, donate_argnums=1).lower(x, y)
    theirs = jax.jit(f, donate_argnums=1).lower(x, y)
    assert ours.in_avals == theirs.in_avals and ours.in_tree == theirs.in_tree
    assert [a.donated for a in jax.tree.leaves(ours.args_info)] == \
        [a.donated for a in jax.tree.leaves(theirs.args_info)] == [False, False, True]
    compiled = ours.compile()
    assert compiled.in_avals == theirs.in_avals
    assert compiled.runtime_executable() is not None
    with_options = kiln.jit(f).lower(x, y).compile(
        compiler_options={"xla_embed_ir_in_executable": True})
    assert np.asarray(with_options(x, y)[1]).tolist() == 6.0
