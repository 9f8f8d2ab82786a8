"""Outputs come back as the running process's own classes and objects (issue 10, item 11).

An output's structure (its pytree node types, non-array leaves such as an equinox Module's
activation function) is stored with the entry. Classes and functions of the script itself
(``__main__``) were pickled by value: a warm process got copies, so a NamedTuple failed
``isinstance``, and a Module holding ``jax.nn.relu`` missed on every later call (its digest was
that of a copy). Now whatever imports back by name is stored by reference.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

PROG = '''\
import typing

import equinox as eqx
import jax
import jax.numpy as jnp

import kiln


class Model(eqx.Module):
    w: jax.Array
    act: typing.Callable = eqx.field(static=True)


class Pair(typing.NamedTuple):
    a: jax.Array
    b: str


@kiln.jit
def make_model(x):
    return Model(x * 2, jax.nn.relu)


class Net(eqx.Module):
    w: jax.Array
    act: typing.Callable  # a function leaf: static under filter_jit only


@kiln.filter_jit
def make_net(x):
    return Net(x * 2, jax.nn.relu)


@kiln.filter_jit
def use_net(n, x):
    return n.act(n.w * x - 3.0)


@kiln.filter_jit
def make_pair(x):
    return Pair(x, "tag")


@kiln.jit
def use(m, x):
    return m.act(m.w * x - 3.0)


x = jnp.ones(3)
m = call("make_model", make_model, x)
p = call("make_pair", make_pair, x)
call("use", use, m, x)
call("use_again", use, m, x)
n = call("make_net", make_net, x)
call("use_net", use_net, n, x)
call("use_net_again", use_net, n, x)
report(model_is_model=type(m) is Model, act_is_relu=m.act is jax.nn.relu,
       pair_is_pair=isinstance(p, Pair), pair_b=p.b,
       net_is_net=type(n) is Net, net_act_is_relu=n.act is jax.nn.relu)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    prog = xp.Program(tmp_path_factory.mktemp("outputs"))
    prog.write("prog.py", PROG)
    return {"A": prog.run(), "B": prog.run()}


def test_output_classes_are_the_processs_own(runs: dict[str, Any]) -> None:
    for run in runs.values():
        assert run.extra == {"model_is_model": True, "act_is_relu": True,
                             "pair_is_pair": True, "pair_b": "tag",
                             "net_is_net": True, "net_act_is_relu": True}


def test_a_returned_module_hits_when_passed_back(runs: dict[str, Any], xp: Any) -> None:
    for name in ("make_model", "make_pair", "use", "make_net", "use_net"):
        xp.assert_warm(runs["B"][name])
    assert xp.value(runs["B"]["use"]) == [0.0, 0.0, 0.0]  # relu(2 - 3)
    assert xp.value(runs["B"]["use_net"]) == [0.0, 0.0, 0.0]
    for name in ("use_again", "use_net_again"):
        again = runs["B"][name]
        assert again["hits"] == 0 and again["misses"] == 0 and again["compiles"] == 0, again
