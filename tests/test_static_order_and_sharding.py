"""Static values kiln._keys._hashing keys by meaning, end to end through kiln.jit / kiln.filter_jit:

1. mappings in INSERTION ORDER (``[x * v for v in cfg.values()]`` is another program for another
   order), in one process (hot path included) and across processes;
2. devices, meshes and shardings by value (a used global ``Mesh`` is read by a ``shard_map``
   body; a ``NamedSharding``, ``PartitionSpec``, ``Device`` or ``AxisType`` may be static), with
   one digest for one mesh in every process. Programs that need 4 devices run in a subprocess
   with ``--xla_force_host_platform_device_count=4`` (the test process has 1 device).
"""

from __future__ import annotations

import collections
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import FrozenDict
from flax.nnx.graph import HashableMapping
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from kiln_test_children import child_env, run_child

import kiln
from kiln._keys._hashing import static_digest

AB = {"a": 1.0, "b": 2.0}
BA = {"b": 2.0, "a": 1.0}


def _values(x: Any, cfg: Any) -> Any:
    return jnp.stack([x * v for v in cfg.values()])


def counted(body: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``body`` with the same signature (static_argnames maps to positions through it),
    counting its traces."""
    traces: list[int] = []

    @functools.wraps(body)
    def f(*args: Any, **kwargs: Any) -> Any:
        traces.append(1)
        return body(*args, **kwargs)

    return f, traces


def _run(tmp_path: Path, program: str, *argv: str, devices: int = 1, seed: str = "0") -> Any:
    """Run ``program`` in a fresh Python process sharing the store under ``tmp_path``; its last
    stdout line is JSON."""
    env = child_env(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        KILN_CACHE_DIR=str(tmp_path / "cache"),
        KILN_JAX_CACHE="0",
        PYTHONHASHSEED=seed,
    )
    proc = run_child([sys.executable, "-c", program, *argv], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


# --------------------------------------------------------------------------------------------
# 1. Mappings in insertion order


class Cfg(dict):  # type: ignore[type-arg]
    """A dict subclass that is no registered pytree: a static leaf under kiln.filter_jit."""


def test_static_dict_in_insertion_order_and_the_hot_path() -> None:
    body, traces = counted(_values)
    f = kiln.jit(body, static_argnames="cfg")
    want = {"ab": [1.0, 2.0], "ba": [2.0, 1.0]}
    assert [_values(1.0, AB).tolist(), _values(1.0, BA).tolist()] == list(want.values())
    for cfg, key in [(AB, "ab"), (BA, "ba"), (AB, "ab"), (BA, "ba"), (dict(BA), "ba")]:
        assert f(1.0, cfg).tolist() == want[key]
        assert f(1.0, cfg=cfg).tolist() == want[key]
    assert len(traces) == 2  # one program per order; repeats are hot
    kiln.reset_stats()
    for _ in range(3):
        assert f(1.0, AB).tolist() == want["ab"]
        assert f(1.0, BA).tolist() == want["ba"]
    # served by jax's C++ dispatcher, keyed by the digest of the dict: no kiln Python
    assert (kiln.stats().calls_hot, kiln.stats().traces, len(traces)) == (0, 0, 2)


_MAKERS = {
    "OrderedDict": collections.OrderedDict,
    "defaultdict": lambda d: collections.defaultdict(float, d),
    "dict-subclass": Cfg,
    "FrozenDict": FrozenDict,
    "HashableMapping": HashableMapping,
}
@pytest.mark.parametrize(
    "make, argnums",
    [pytest.param(m, -1, id=f"{name}-python") for name, m in _MAKERS.items()]
    + [
        pytest.param(m, 1, id=f"{name}-cpp")
        for name, m in _MAKERS.items()
    ],
)
def test_static_mapping_classes_in_insertion_order(make: Any, argnums: int) -> None:
    """OrderedDict, defaultdict, a dict subclass, flax's FrozenDict (whose pytree flatten sorts
    its keys) and HashableMapping (nnx GraphDef): each order its own program. argnums -1 runs
    kiln's Python dispatch (keyed by digest), 1 jax's C++ dispatcher."""
    body, traces = counted(_values)
    f = kiln.jit(body, static_argnums=argnums)
    ab, ba = make(AB), make(BA)
    assert list(ab) == ["a", "b"] and list(ba) == ["b", "a"]
    for _ in range(2):
        assert f(1.0, ab).tolist() == [1.0, 2.0]
        assert f(1.0, ba).tolist() == [2.0, 1.0]
    assert len(traces) == 2


def test_filter_jit_static_mappings_in_order_as_equinox() -> None:
    """Under kiln.filter_jit a dict is a pytree node: jax's flatten sorts its keys, so the
    function gets the sorted dict back, as under equinox.filter_jit (and jax.jit). A mapping
    whose structure keeps the order (OrderedDict) or that is itself a static leaf (an
    unregistered dict subclass) is seen in its own order, and each order is its own program."""
    x = jnp.float32(1.0)
    for make in (dict, collections.OrderedDict, FrozenDict):
        ours, theirs = kiln.filter_jit(_values), eqx.filter_jit(_values)
        for cfg in (make(AB), make(BA), make(AB)):
            assert ours(x, cfg).tolist() == theirs(x, cfg).tolist()
    body, traces = counted(_values)
    g = kiln.filter_jit(body)
    for _ in range(2):
        assert g(x, Cfg(AB)).tolist() == [1.0, 2.0]
        assert g(x, Cfg(BA)).tolist() == [2.0, 1.0]
        assert g(x, collections.OrderedDict(BA)).tolist() == [2.0, 1.0]
    assert len(traces) == 3


ORDER_PROGRAM = r"""
import collections, json, sys
import equinox as eqx, jax, jax.numpy as jnp, kiln
from flax.core import FrozenDict

@kiln.jit(static_argnames="cfg")
def f(x, cfg):
    return jnp.stack([x * v for v in cfg.values()])

@kiln.filter_jit
def g(x, cfg):
    return jnp.stack([x * v for v in cfg.values()])

class Cfg(dict):
    pass

class Model(eqx.Module):
    w: jax.Array
    cfg: FrozenDict = eqx.field(static=True)

@kiln.filter_jit
def m(model):
    return jnp.stack([model.w * v for v in model.cfg.values()])

ab, ba = {"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}
first, second = (ab, ba) if sys.argv[1] == "ab" else (ba, ab)
print(f(1.0, first), f(1.0, second))  # the report's snippet
one = jnp.float32(1.0)
out = {
    "dict": [f(1.0, c).tolist() for c in (first, second, first, second)],
    "frozendict": f(1.0, FrozenDict(first)).tolist(),  # the first FrozenDict of this process
    "leaf": [g(one, Cfg(c)).tolist() for c in (first, second, first)],
    "ordered": [g(one, collections.OrderedDict(c)).tolist() for c in (first, second)],
    "module_static": m(Model(one, FrozenDict(first))).tolist(),
}
s = kiln.stats()
out["compiles"], out["hits"], out["traces"] = s.compiles, s.hits, s.traces
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def order_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """Process A fills a store calling with {"a", "b"} first; process B, on the same store,
    calls with {"b", "a"} first."""
    tmp = tmp_path_factory.mktemp("order")
    return _run(tmp, ORDER_PROGRAM, "ab", seed="1"), _run(tmp, ORDER_PROGRAM, "ba", seed="2")


@pytest.mark.slow
def test_static_dict_order_across_processes(order_runs: tuple[list[str], list[str]]) -> None:
    (a_line, a_json), (b_line, b_json) = order_runs
    assert a_line == "[1. 2.] [2. 1.]"
    assert b_line == "[2. 1.] [1. 2.]"
    a, b = json.loads(a_json), json.loads(b_json)
    assert a["dict"] == [[1.0, 2.0], [2.0, 1.0]] * 2
    assert b["dict"] == [[2.0, 1.0], [1.0, 2.0]] * 2
    # B's first FrozenDict is {"b", "a"}: its own entry, never A's {"a", "b"} program
    assert (a["frozendict"], b["frozendict"]) == ([1.0, 2.0], [2.0, 1.0])
    assert a["leaf"] == [[1.0, 2.0], [2.0, 1.0], [1.0, 2.0]]
    assert b["leaf"] == [[2.0, 1.0], [1.0, 2.0], [2.0, 1.0]]
    assert (a["ordered"], b["ordered"]) == ([[1.0, 2.0], [2.0, 1.0]], [[2.0, 1.0], [1.0, 2.0]])
    # A: f twice, f(FrozenDict), g four times, m; B loads A's dict and leaf programs (6) and
    # compiles its own FrozenDict one and its Model's (a FrozenDict in a static field)
    assert (a["compiles"], a["hits"]) == (8, 0)
    assert (b["compiles"], b["hits"]) == (2, 6)


@pytest.mark.slow
def test_module_static_frozendict_order_across_processes(
    order_runs: tuple[list[str], list[str]],
) -> None:
    a, b = json.loads(order_runs[0][1]), json.loads(order_runs[1][1])
    assert (a["module_static"], b["module_static"]) == ([1.0, 2.0], [2.0, 1.0])


# --------------------------------------------------------------------------------------------
# 2. Devices, meshes and shardings by value


def d(value: Any) -> str:
    return static_digest(value, argname="v")


def test_sharding_objects_as_static_arguments() -> None:
    """NamedSharding, PartitionSpec, Device, AxisType, Mesh, a list and an object array of
    devices: static arguments of kiln.jit with results equal to jax.jit's, one trace each."""
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("d",), axis_types=(AxisType.Auto,))

    def body(x: Any, sharding: Any, spec: Any, device: Any, axis_type: Any, m: Any) -> Any:
        y = jax.lax.with_sharding_constraint(x, sharding)
        y = jax.lax.with_sharding_constraint(y, NamedSharding(m, spec))
        return y * (device.id + 1) * (2.0 if axis_type is AxisType.Explicit else 3.0) + m.size

    counting, traces = counted(body)
    f = kiln.jit(counting, static_argnums=(1, 2, 3, 4, 5))
    args = (jnp.arange(4.0), NamedSharding(mesh, P("d")), P(None), dev, AxisType.Explicit, mesh)
    want = jax.jit(body, static_argnums=(1, 2, 3, 4, 5))(*args)
    for _ in range(3):
        assert f(*args).tolist() == want.tolist()
    assert f(*args[:4], AxisType.Auto, mesh).tolist() == (jnp.arange(4.0) * 3 + 1).tolist()
    assert len(traces) == 2
    for value in args[1:]:
        d(value)  # a canonical digest: never Unpersistable, never by identity

    def on_devices(x: Any, devices: Any) -> Any:
        return x * len(list(np.asarray(devices).flat)) + devices[-1].id

    g = kiln.jit(on_devices, static_argnums=1)
    for devices in ([dev], [dev, dev], np.array([dev], dtype=object)):
        assert g(jnp.ones(2), devices).tolist() == on_devices(jnp.ones(2), devices).tolist()
    assert d(SingleDeviceSharding(dev)) == d(SingleDeviceSharding(dev))
    assert d([dev]) != d(np.array([dev], dtype=object)) != d(dev)


def test_a_used_mesh_keeps_its_digest() -> None:
    """Using a mesh fills private caches on it (``_flat_devices_set``, a set of devices): its
    digest is by meaning, so it does not change, and those caches are never read."""
    mesh = Mesh(np.array(jax.devices()), ("u",))
    before = d(mesh)
    unused = set(vars(mesh))
    jax.device_put(jnp.arange(2.0), NamedSharding(mesh, P()))
    assert set(vars(mesh)) > unused  # it has been used
    assert d(mesh) == before
    assert d(NamedSharding(mesh, P())) == d(
        NamedSharding(Mesh(np.array(jax.devices()), ("u",)), P())
    )


def test_an_object_array_that_is_not_all_devices_is_refused() -> None:
    with pytest.raises(kiln.StaticArgumentError, match="object array"):
        d(np.array([jax.devices()[0], None], dtype=object))
    with pytest.raises(kiln.StaticArgumentError, match="object array"):
        d(np.array([], dtype=object))


MESH_PROGRAM = r"""
import json
import numpy as np, jax, jax.numpy as jnp, kiln
from jax.sharding import (AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P,
                          SingleDeviceSharding)
from kiln._keys._hashing import static_digest

def d(v):
    return static_digest(v, argname="v")

mesh = jax.make_mesh((4,), ("d",))
unused = {"mesh_unused": d(mesh), "attrs_unused": sorted(vars(mesh))}
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))

@kiln.jit
def f(x):
    return jax.shard_map(lambda b: jax.lax.psum(b.sum(), "d") * jnp.ones_like(b),
                         mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)

print(f(x))  # the report's snippet
out = {"kiln": f(x).tolist(), "jax": jax.jit(f.__wrapped__)(x).tolist(), **unused}
out["attrs_used"] = sorted(vars(mesh))
flat = list(mesh.devices.flat)
devs = jax.devices()
amesh = Mesh(np.array(flat), ("d",), axis_types=(AxisType.Auto,))
digests = {
    "mesh_used": mesh,
    "mesh_again": Mesh(np.array(flat), ("d",), axis_types=mesh.axis_types),
    "mesh_names": Mesh(np.array(flat), ("e",), axis_types=mesh.axis_types),
    "mesh_order": Mesh(np.array(flat[::-1]), ("d",), axis_types=mesh.axis_types),
    "mesh_2x2": Mesh(np.array(flat).reshape(2, 2), ("d", "e")),
    "mesh_4x1": Mesh(np.array(flat).reshape(4, 1), ("d", "e")),
    "mesh_auto": amesh,
    "abstract": mesh.abstract_mesh,
    "abstract_2x2": AbstractMesh((2, 2), ("d", "e")),
    "ns_d": NamedSharding(mesh, P("d")),
    "ns_rep": NamedSharding(mesh, P()),
    "ns_pinned": NamedSharding(mesh, P("d"), memory_kind="pinned_host"),
    "ns_abstract": NamedSharding(mesh.abstract_mesh, P("d")),
    "ns_other_mesh": NamedSharding(amesh, P("d")),
    "p_d": P("d"),
    "p_e": P("e"),
    "p_de": P(("d", "e")),
    "p_d_none": P("d", None),
    "single0": SingleDeviceSharding(devs[0]),
    "single1": SingleDeviceSharding(devs[1]),
    "device0": devs[0],
    "device1": devs[1],
    "device_list": devs,
    "device_array": np.array(devs, dtype=object),
    "explicit": AxisType.Explicit,
    "auto": AxisType.Auto,
}
out["digests"] = {k: d(v) for k, v in digests.items()}

@kiln.jit(static_argnums=(1, 2, 3, 4))
def h(x, sharding, spec, device, axis_type):
    y = jax.lax.with_sharding_constraint(x, sharding)
    y = jax.lax.with_sharding_constraint(y, NamedSharding(sharding.mesh, spec))
    return y * (device.id + 1) * (2.0 if axis_type is AxisType.Explicit else 3.0)

args = (jnp.arange(8.0), NamedSharding(amesh, P("d")), P(None), devs[1], AxisType.Explicit)
out["static"] = [h(*args).tolist(), h(*args).tolist()]
out["static_jax"] = jax.jit(h.__wrapped__, static_argnums=(1, 2, 3, 4))(*args).tolist()

@kiln.filter_jit
def g(x, m):  # a mesh as a static leaf
    return x * m.size
out["leaf"] = g(jnp.ones(2), mesh).tolist()
s = kiln.stats()
out["compiles"], out["hits"], out["traces"] = s.compiles, s.hits, s.traces
print(json.dumps(out))
"""


@pytest.mark.slow
def test_meshes_and_shardings_across_processes(tmp_path: Path) -> None:
    """One digest for one mesh in every process (whatever PYTHONHASHSEED, used or not); another
    for other axis names, shape, device order, axis types or spec. The report's shard_map over
    a used global mesh runs as jax.jit does, and a second process loads every program."""
    (a_line, a_json) = _run(tmp_path, MESH_PROGRAM, devices=4, seed="1")
    (b_line, b_json) = _run(tmp_path, MESH_PROGRAM, devices=4, seed="2")
    assert a_line == b_line == "[28. 28. 28. 28. 28. 28. 28. 28.]"
    a, b = json.loads(a_json), json.loads(b_json)
    assert a["digests"] == b["digests"]
    assert a["mesh_unused"] == b["mesh_unused"]
    for run in (a, b):
        assert run["kiln"] == run["jax"] == [28.0] * 8
        assert set(run["attrs_used"]) > set(run["attrs_unused"])  # the mesh has been used
        assert run["static"] == [run["static_jax"]] * 2
        assert run["leaf"] == [4.0, 4.0]
    assert a["static_jax"] == [2.0 * i * 2 for i in range(8)]
    got = a["digests"]
    assert got["mesh_used"] == got["mesh_again"] == a["mesh_unused"]
    distinct = [k for k in got if k != "mesh_again"]
    assert len({got[k] for k in distinct}) == len(distinct), got
    assert (a["compiles"], a["hits"]) == (3, 0)  # f, h, g
    assert (b["compiles"], b["hits"], b["traces"]) == (0, 3, 0)
