"""Outputs come back as the running process's own classes and objects.

An output's structure (its pytree node types, non-array leaves such as an equinox Module's
activation function) is stored with the entry. Classes and functions of the script itself
(``__main__``) were pickled by value: a warm process got copies, so a NamedTuple failed
``isinstance``, and a Module holding ``jax.nn.relu`` missed on every later call (its digest was
that of a copy). Now whatever imports back by name is stored by reference.
"""

from __future__ import annotations

from typing import Any

import pytest
from kiln_test_children import child_env, run_child

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


def test_an_output_structure_that_cannot_be_stored_warns_once_and_is_listed(
    kiln_store, capsys
) -> None:
    """Never silent: the program runs, compiled; one KilnWarning per function with
    the reason and what to do; `kiln stats` lists it under "not stored"."""
    import threading

    import jax
    import jax.numpy as jnp

    import kiln

    class Locked:
        def __init__(self, x, lock):
            self.x, self.lock = x, lock

    jax.tree_util.register_pytree_node(
        Locked, lambda b: ((b.x,), b.lock), lambda lock, ch: Locked(ch[0], lock))
    f = kiln.jit(lambda x: Locked(x * 2, threading.Lock()))
    with pytest.warns(kiln.KilnWarning, match=r"not stored \(the output's tree structure "
                      r"cannot be pickled.*_thread.lock.*\), so every process compiles it again"):
        assert float(f(jnp.float32(1.0)).x) == 2.0
    assert float(f(jnp.arange(2.0)).x[1]) == 2.0  # another signature: no second warning
    assert kiln.stats().stores_written == 0 and kiln.stats().reasons["unstorable"] == 2
    import json

    from kiln import _cli

    capsys.readouterr()
    assert _cli.main(["stats", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [f.rpartition(".")[2] for f in summary["not_stored"]] == ["<lambda>"]
    assert "_thread.lock" in next(iter(summary["not_stored"].values()))


def _cold_then_warm(tmp_path: Any, script_text: str, *kiln_run: str) -> list[dict[str, Any]]:
    """Run ``script_text`` in two fresh processes on one empty store (with ``kiln_run``, e.g.
    ``"-m", "kiln", "run"``, before the script); their last JSON lines."""
    import json
    import sys

    script = tmp_path / "script.py"
    script.write_text(script_text)
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"))
    runs = []
    for _ in range(2):
        proc = run_child([sys.executable, *kiln_run, script], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-5000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


LOCAL_MODULE = r'''
import json, equinox as eqx, jax, jax.numpy as jnp, kiln


def main():
    class Scale(eqx.Module):  # a class defined inside a function: no name to import it by
        w: jax.Array
        label: str = eqx.field(static=True)

    @kiln.filter_jit
    def step(m, x):
        return Scale(m.w * x, m.label), m.label

    m = Scale(jnp.ones(3), "s")
    for _ in range(3):  # the output passed back in
        m, label = step(m, jnp.full(3, 2.0))
    s = kiln.stats()
    print(json.dumps({"w": m.w.tolist(), "own_class": type(m) is Scale, "label": label,
                      "compiles": s.compiles, "hits": s.hits, "traces": s.traces}))


main()
'''


def test_a_module_class_defined_in_a_function_comes_back_as_the_caller_s(tmp_path) -> None:
    """An output of a Module class defined inside a function (examples/eqx_transformer.py):
    the stored structure refers to the inputs' class, so a warm result is of the caller's own
    class (a cloudpickled copy of an equinox Module class lost its fields: the next call
    failed with "'Transformer' object has no attribute 'embed'")."""
    cold, warm = runs = _cold_then_warm(tmp_path, LOCAL_MODULE)
    assert cold["compiles"] == 1 and (warm["compiles"], warm["traces"], warm["hits"]) == (0, 0, 1)
    for run in runs:
        assert run["w"] == [8.0] * 3 and run["own_class"] and run["label"] == "s"


LAMBDA_LEAF = r'''
import json, equinox as eqx, jax, jax.numpy as jnp, kiln

mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))  # final_activation: equinox's own lambda


@kiln.filter_jit
def step(m, x):
    return jax.tree.map(lambda p: p * 0.5 if eqx.is_array(p) else p, m), m(x)


x = jnp.ones(2)
for _ in range(3):  # the output Module (with the lambda) passed back in
    mlp, y = step(mlp, x)
s = kiln.stats()
print(json.dumps({"y": y.tolist(), "compiles": s.compiles, "hits": s.hits,
                  "misses": s.misses}))
'''


def test_a_function_leaf_an_output_shares_with_the_inputs_is_the_caller_s(tmp_path) -> None:
    """A function leaf (static under filter_jit) that the output holds because the input did
    (an equinox MLP's final_activation, a lambda in equinox's module): a warm result holds the
    caller's object, so passing it back in is the same program (a copy made a new static
    value: every later call recompiled; examples/eqx_transformer.py)."""
    cold, warm = _cold_then_warm(tmp_path, LAMBDA_LEAF)
    assert (cold["compiles"], cold["misses"]) == (1, 1)
    assert (warm["compiles"], warm["misses"], warm["hits"]) == (0, 0, 1)
    assert warm["y"] == cold["y"]


NNX_OPTIMIZER = r'''
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import kiln


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


model = MLP(nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
tx = opt.tx


@nnx.jit
def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    opt.update(model, grads)
    return loss


x, y = jnp.linspace(-1, 1, 64).reshape(16, 4), jnp.ones((16, 1))
losses = [float(step(model, opt, x, y)) for _ in range(12)]
s = kiln.stats()
print(json.dumps({"losses": losses, "tx_is_callers": opt.tx is tx, "compiles": s.compiles,
                  "hits": s.hits, "misses": s.misses, "traces": s.traces,
                  "hot": s.calls_hot}))
'''


def test_an_nnx_optimizer_s_tx_comes_back_as_the_caller_s(tmp_path) -> None:
    """flax NNX keeps an optimizer's ``tx`` (optax closures) in a ``Static`` inside the
    ``GraphDef`` its jitted step takes and returns: a warm result must hold the caller's
    ``tx``, as a cold one does. A copy made the next call's tree differ from the first's:
    the warm step missed the process's table again, and traced or loaded the entry again
    (with ``optax.sgd``, one store load per step)."""
    cold, warm = _cold_then_warm(tmp_path, NNX_OPTIMIZER, "-m", "kiln", "run")
    assert (cold["compiles"], cold["misses"], cold["traces"]) == (1, 1, 1)
    assert (warm["compiles"], warm["misses"], warm["hits"], warm["traces"]) == (0, 0, 1, 0)
    assert cold["tx_is_callers"] and warm["tx_is_callers"]
    assert warm["losses"] == cold["losses"] and cold["losses"][-1] < cold["losses"][0]
    # never stale: another learning rate (in tx's closures) is another program, whose losses
    # are a plain run's
    import json
    import sys

    (tmp_path / "script.py").write_text(NNX_OPTIMIZER.replace("adam(1e-2)", "adam(5e-2)"))
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"))
    runs = [run_child([sys.executable, *how, tmp_path / "script.py"], env=env, timeout=300)
            for how in (("-m", "kiln", "run"), ())]
    changed, plain = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert changed["compiles"] == 1 and changed["tx_is_callers"]
    assert changed["losses"] == plain["losses"] != cold["losses"]
