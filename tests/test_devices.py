"""Several devices (XLA's host platform split into 4), sharded inputs, typed PRNG keys."""

from __future__ import annotations

import json
import sys

import pytest
from kiln_test_children import child_env, run_child

PROG = r'''
import json
import jax, jax.numpy as jnp, numpy as np, kiln
from jax.sharding import NamedSharding, PartitionSpec as P

f = kiln.jit(lambda x: x * 2 + 1)
x = jnp.arange(8.0)
mesh = jax.make_mesh((4,), ("i",))
out = {
    "plain": f(x).tolist(),
    "sharded": f(jax.device_put(x, NamedSharding(mesh, P("i")))).tolist(),
    "device1": f(jax.device_put(x, jax.devices()[1])).tolist(),
    "sharded_spec": str(f(jax.device_put(x, NamedSharding(mesh, P("i")))).sharding.spec),
}
sample = kiln.jit(lambda k: jax.random.normal(k, (2,)))
out["key"] = sample(jax.random.key(0)).tolist()
out["key_ref"] = jax.random.normal(jax.random.key(0), (2,)).tolist()
s = kiln.stats()
out["hits"], out["misses"], out["traces"] = s.hits, s.misses, s.traces
print(json.dumps(out))
'''


def _run(tmp_path):
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4",
                    KILN_CACHE_DIR=str(tmp_path / "cache"))
    proc = run_child([sys.executable, "-c", PROG], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_and_committed_inputs_and_prng_keys_round_trip(tmp_path):
    want = [1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]
    cold, warm = _run(tmp_path), _run(tmp_path)
    for run in (cold, warm):
        assert run["plain"] == run["sharded"] == run["device1"] == want
        assert run["sharded_spec"] == "P('i',)"  # output keeps the input's sharding
        assert run["key"] == run["key_ref"]
    # plain, sharded, device 1 and the PRNG-key function are four executables
    assert (cold["misses"], cold["hits"]) == (4, 0)
    assert (warm["misses"], warm["hits"], warm["traces"]) == (0, 4, 0)


SHARDED = r'''
import json, os
import jax, jax.numpy as jnp, kiln
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((4, 2), ("i", "j"))
row, rep = NamedSharding(mesh, P("i")), NamedSharding(mesh, P())
out_y = {"row": row, "col": NamedSharding(mesh, P("j"))}[os.environ["OUT_Y"]]


def body(x, tree):
    return (x * 2 + tree["b"]).sum(), x + tree["a"]


def describe(outs):
    return [[o.tolist(), str(o.sharding.spec), sorted(d.id for d in o.sharding.device_set)]
            for o in outs]


out = {}
for name, jit in (("jax", jax.jit), ("kiln", kiln.jit)):
    f = jit(body, in_shardings=(row, {"a": row, "b": rep}), out_shardings=(rep, out_y))
    out[name] = describe(f(jnp.arange(8.0), {"a": jnp.ones(8), "b": jnp.ones(8)}))
    try:
        f(jnp.arange(8.0), tree={"a": jnp.ones(8), "b": jnp.ones(8)})
    except ValueError as e:
        out[name + "_kwargs_error"] = str(e)
s = kiln.stats()
out["hits"], out["misses"], out["traces"] = s.hits, s.misses, s.traces
print(json.dumps(out))
'''


def _run_sharded(tmp_path, out_y):
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8",
                    KILN_CACHE_DIR=str(tmp_path / "cache"), OUT_Y=out_y)
    proc = run_child([sys.executable, "-c", SHARDED], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_in_and_out_shardings_as_jax_jit_cold_warm_and_keyed(tmp_path):
    cold, warm, col = (_run_sharded(tmp_path, "row"), _run_sharded(tmp_path, "row"),
                       _run_sharded(tmp_path, "col"))
    for run in (cold, warm, col):
        assert run["kiln"] == run["jax"]  # values, output specs, devices
        assert run["kiln_kwargs_error"] == run["jax_kwargs_error"]
    assert cold["kiln"][1][1] == "P('i',)" and len(cold["kiln"][1][2]) == 8
    assert col["kiln"][1][1] == "P('j',)"
    assert (cold["misses"], cold["hits"]) == (1, 0)
    assert (warm["misses"], warm["hits"], warm["traces"]) == (0, 1, 0)
    # another out_shardings is another executable, never the stored one
    assert (col["misses"], col["hits"]) == (1, 0)


SWAPPED = r'''
import json
from functools import partial

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
w = jax.device_put(jnp.ones((8, 4)) * 0.5, NamedSharding(mesh, P("model", None)))


@jax.jit
def layer(x, w):
    return jnp.tanh(x @ w / 8.0).sum(axis=1)


@partial(jax.jit, out_shardings=NamedSharding(mesh, P("data")))
def step(x, w):
    return layer(x, w) * 2.0


out = step(x, w)
report = {"out": np.asarray(out).tolist(), "spec": str(out.sharding.spec),
          "devices": len(out.sharding.device_set)}
try:
    import kiln
    s = kiln.stats()
    report.update(hits=s.hits, misses=s.misses, traces=s.traces, compiles=s.compiles)
except ImportError:
    pass
print(json.dumps(report))
'''


@pytest.mark.slow
def test_a_sharded_program_under_the_jax_jit_swap_is_jax_jits_cold_and_warm(tmp_path):
    """An unchanged program on a 2 x 2 mesh (sharded inputs, ``out_shardings``, a jit called
    inside another) under ``kiln run --jit``: the values and output sharding of plain
    ``jax.jit``, compiled once cold, loaded with no trace warm."""
    script = tmp_path / "prog.py"
    script.write_text(SWAPPED)
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4",
                    KILN_CACHE_DIR=str(tmp_path / "cache"))

    def run(*argv: str) -> dict:
        proc = run_child([sys.executable, *argv, str(script)], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    plain = run()
    cold, warm = run("-m", "kiln", "run", "--jit"), run("-m", "kiln", "run", "--jit")
    for got in (cold, warm):
        assert (got["out"], got["spec"], got["devices"]) == (
            plain["out"], plain["spec"], plain["devices"]) == (plain["out"], "P('data',)", 4)
    assert (cold["misses"], cold["compiles"]) == (1, 1)  # layer is traced inside step
    assert (warm["hits"], warm["misses"], warm["traces"], warm["compiles"]) == (1, 0, 0, 0)
