"""Static objects keyed by the fields their trace read (``kiln._keys._static_reads``).

A static ``self`` that holds what its jitted methods never read (the time it was made, a run
id, a lock, a progress bar) hits on a warm start; one whose read fields changed misses; the
read set may depend on the values (``if self.use_bias``), and a trace that reads the whole
state at once (``vars``, ``copy``), hashes the object, or changes it is keyed by its whole
state or takes the verify path. The reference is plain ``jax.jit`` in the same process.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln
from kiln._keys import StaticReadWatch, watchable


class Trainer:
    def __init__(self, lr: float, use_bias: bool = False) -> None:
        self.lr = lr
        self.use_bias = use_bias
        self.bias = 10.0
        self.created = time.time()
        self.lock = threading.Lock()

    def __hash__(self) -> int:
        return hash((self.lr, self.use_bias, self.bias))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trainer) and (self.lr, self.use_bias, self.bias) == (
            other.lr, other.use_bias, other.bias)


class Slotted:
    __slots__ = ("lr",)

    def __init__(self) -> None:
        self.lr = 1.0


def _watch(body: Any, obj: Any) -> StaticReadWatch:
    runs = [0]
    watch = StaticReadWatch([("static:self", obj)], lambda: runs[0])
    with watch:
        runs[0] += 1
        body(obj)
    return watch


def test_watch_records_the_fields_read_and_restores_the_class() -> None:
    t = Trainer(0.5)
    own = dict(vars(Trainer))
    watch = _watch(lambda s: s.lr * 2 + getattr(s, "missing", 0), t)
    assert watch.reads == {"static:self": ("lr", "missing")}  # an absent field read counts
    assert watch.changed is None
    assert dict(vars(Trainer)) == own  # hooks removed, the class's own dunders back


def test_watch_keys_the_whole_state_when_a_read_cannot_be_seen_by_name() -> None:
    t = Trainer(0.5)
    for body in (vars, copy.copy, hash, lambda s: s == Trainer(0.5), lambda s: s.__dict__):
        assert _watch(body, t).reads == {"static:self": None}, body
    # the function body never ran (jax reused a trace): nothing was seen
    watch = StaticReadWatch([("static:self", t)], lambda: 0)
    with watch:
        t.lr  # noqa: B018
    assert watch.reads == {"static:self": None}


def test_watch_says_when_the_trace_changed_the_object() -> None:
    t = Trainer(0.5)

    def bump(s: Trainer) -> None:
        s.lr += 1

    assert _watch(bump, t).changed == "the trace changed self.lr (a field of a static argument)"
    t2 = Trainer(0.5)
    t2.history = []  # type: ignore[attr-defined]
    assert "self.history" in (_watch(lambda s: s.history.append(1), t2).changed or "")


def test_watchable() -> None:
    assert watchable(Trainer(0.5))
    for v in (Slotted(), (1, 2), {"a": 1}, np.float32(1), len, Trainer, threading.Lock()):
        assert not watchable(v), v
    # digested by meaning: a used mesh's caches (``_name_to_type``, filled by a shard_map's
    # trace) are not fields to watch; a global mesh was traced again on every warm start
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("u",))
    assert not watchable(mesh) and not watchable(jax.devices()[0])
    assert not watchable(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def test_an_unread_field_is_not_in_the_key_and_a_read_one_is(kiln_store: Any) -> None:
    calls = {"n": 0}

    def step(self: Trainer, x: Any) -> Any:
        calls["n"] += 1
        return x * self.lr + (self.bias if self.use_bias else 0.0)

    f = kiln.jit(step, static_argnums=0)
    x = jnp.arange(3.0)
    np.testing.assert_allclose(f(Trainer(0.5), x), x * 0.5)
    f.clear_cache()
    np.testing.assert_allclose(f(Trainer(0.5), x), x * 0.5)  # another lock, another time
    s = kiln.stats()
    assert (s.misses, s.hits, s.traces) == (1, 1, 1)
    # a field the trace read changed: a miss, and the right value
    np.testing.assert_allclose(f(Trainer(0.25), x), x * 0.25)
    # the read set follows the values: use_bias reads bias too
    t = Trainer(0.5, use_bias=True)
    np.testing.assert_allclose(f(t, x), x * 0.5 + 10.0)
    t2 = Trainer(0.5, use_bias=True)
    t2.bias = 20.0
    np.testing.assert_allclose(f(t2, x), x * 0.5 + 20.0)
    assert kiln.stats().misses == 4


# ----------------------------------------------------------------------------------------------
# Across processes: each run makes its objects anew (another time, another lock, another bar)
# ----------------------------------------------------------------------------------------------
MODEL = '''\
import functools
import threading
import time
import uuid

import jax
import tqdm

import kiln


class Trainer:
    def __init__(self, lr, use_bias=False):
        self.lr = lr
        self.use_bias = use_bias
        self.bias = 10.0
        self.calls = 0
        self.created = time.time()
        self.run_id = uuid.uuid4().hex
        self.lock = threading.Lock()
        self.bar = tqdm.tqdm(total=1, disable=True)

    def __hash__(self):
        return hash((self.lr, self.use_bias))

    def __eq__(self, other):
        return isinstance(other, Trainer) and (self.lr, self.use_bias) == (other.lr,
                                                                          other.use_bias)

    def step(self, x):
        TRACE()
        return x * self.lr + (self.bias if self.use_bias else 0.0)

    def counted(self, x):  # changes the object while tracing: the verify path
        TRACE()
        self.calls += 1
        return x * self.lr

    def nested(self, x):  # an inner jax.jit keyed by the object: its whole state
        TRACE()
        return jax.jit(Trainer.step, static_argnums=0)(self, x) + 1.0
'''

PROG = '''\
import sys

import jax
import jax.numpy as jnp

import kiln
import model
from model import Trainer

model.TRACE = TRACE
lr, use_bias = float(sys.argv[1]), sys.argv[2] == "bias"
x = jnp.arange(3.0)
for name in ("step", "counted", "nested"):
    fn = getattr(Trainer, name)
    call(name, kiln.jit(fn, static_argnums=0), Trainer(lr, use_bias), x)
    call(name + ":jax", jax.jit(fn, static_argnums=0), Trainer(lr, use_bias), x)
report()
'''


@pytest.mark.slow
def test_static_self_across_processes(tmp_path: Any, xp: Any) -> None:
    prog = xp.Program(tmp_path)
    prog.write("model.py", MODEL)
    prog.write("prog.py", PROG)

    def run(*args: str) -> Any:
        r = prog.run(*args)
        for name in ("step", "counted", "nested"):
            assert xp.value(r[name]) == xp.value(r[name + ":jax"]), (args, name)
        return r

    xp.assert_cold(run("0.5", "plain")["step"])
    warm = run("0.5", "plain")
    xp.assert_warm(warm["step"])  # another time, run id, lock and bar: the same key
    xp.assert_warm_verified(warm["counted"])  # (its trace changed self.calls)
    # hashed while tracing (by the inner jax.jit's cache): keyed by its whole state, which
    # holds a lock: the verify path
    xp.assert_warm_verified(warm["nested"])
    xp.assert_cold(run("0.25", "plain")["step"])  # a field the trace read changed
    xp.assert_cold(run("0.5", "bias")["step"])  # another read set (use_bias reads bias)
    xp.assert_warm(run("0.5", "bias")["step"])
    xp.assert_warm(run("0.5", "plain")["step"])


GLOBALS_PROG = '''\
import argparse
import dataclasses
import sys
import time
import uuid

import jax
import jax.numpy as jnp

import kiln

lr, scale, use_bias = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "bias"
# a config global: the trace reads lr; started and run differ in every process
ARGS = argparse.Namespace(lr=lr, started=time.time(), run=str(uuid.uuid4()))


@dataclasses.dataclass
class Settings:
    scale: float
    use_bias: bool
    bias: float = 1.0
    created: float = dataclasses.field(default_factory=time.time)


SETTINGS = Settings(scale, use_bias)


class Trainer:
    def __init__(self):
        self.scale = scale
        self.started = time.time()
        self.step = kiln.jit(self._step)  # a jitted bound method: self is not static
        self.step_jax = jax.jit(self._step)

    def _step(self, x):
        TRACE()
        return x * self.scale


def by_args(x):
    TRACE()
    return x * ARGS.lr


def by_settings(x):
    TRACE()
    y = x * SETTINGS.scale
    return y + SETTINGS.bias if SETTINGS.use_bias else y


x = jnp.arange(3.0)
for name, fn in (("args", by_args), ("settings", by_settings)):
    call(name, kiln.jit(fn), x)
    call(name + ":jax", jax.jit(fn), x)
t = Trainer()
call("method", t.step, x)
call("method:jax", t.step_jax, x)
report()
'''


@pytest.mark.slow
def test_globals_and_a_bound_methods_self_across_processes(tmp_path: Any, xp: Any) -> None:
    """A global config object (``argparse.Namespace``, a dataclass instance) and the ``self``
    of a jitted bound method are keyed by the fields the trace read: another start
    time or run id hits; a read field changed, or another read set (``use_bias`` reads
    ``bias``), traces again with plain jax.jit's value."""
    prog = xp.Program(tmp_path)
    prog.write("prog.py", GLOBALS_PROG)
    names = ("args", "settings", "method")

    def run(*args: str) -> Any:
        r = prog.run(*args)
        for name in names:
            assert xp.value(r[name]) == xp.value(r[name + ":jax"]), (args, name)
        return r

    cold = run("0.5", "3.0", "plain")
    for name in names:
        xp.assert_cold(cold[name])
    warm = run("0.5", "3.0", "plain")
    for name in names:
        xp.assert_warm(warm[name])
    changed = run("0.25", "4.0", "plain")
    for name in names:
        xp.assert_cold(changed[name])
    bias = run("0.25", "4.0", "bias")
    xp.assert_cold(bias["settings"])  # another read set
    xp.assert_warm(bias["args"])
    xp.assert_warm(run("0.25", "4.0", "bias")["settings"])
    back = run("0.5", "3.0", "plain")
    for name in names:
        xp.assert_warm(back[name])
