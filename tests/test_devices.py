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
