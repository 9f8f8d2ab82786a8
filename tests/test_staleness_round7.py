"""Never stale, round 7: a host callback reached through an attribute rebound
between runs, and a value a trace got back from a memo (``functools.lru_cache``) filled before
the trace from a file. Each program runs in fresh processes sharing a store. Unchanged, the
second run loads with no trace. In two modes (:data:`MODES`): ``decorated``, ``kiln.jit`` in the
source, the reference plain ``jax.jit`` in the same process; ``kiln run``, ``jax.jit`` in the
source where it has ``kiln.jit``, run as ``python -m kiln run prog.py`` (the default: the swap
makes it a ``kiln.jit``), the reference a fresh plain ``python prog.py`` calling JAX's own
``jax.jit`` (on a store of its own, which it never uses).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

OPS = '''\
import numpy as np


def host_square(x):
    return np.asarray(x) ** 2


def host_cube(x):
    return np.asarray(x) ** 3


transform = host_square
'''

PROG = '''\
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kiln
import ops


class Ops:
    transform = staticmethod(ops.host_square)


class Sim:
    def __init__(self):
        self.handler = ops.host_square


sim = Sim()
if sys.argv[1] == "cube":  # rebound before the call, as a plugin or a config would
    ops.transform = ops.host_cube
    Ops.transform = staticmethod(ops.host_cube)
    sim.handler = ops.host_cube
k = float(sys.argv[2])
lam = lambda x: np.asarray(x) * k  # noqa: E731 - another closure each run


@functools.lru_cache
def load_coeffs():
    with open("coeffs.txt") as f:
        return float(f.read())


print("coefficients", load_coeffs())  # filled before any trace


def shape(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def module_attr(x):
    return jax.pure_callback(ops.transform, shape(x), x)


def class_attr(x):
    return jax.pure_callback(Ops.transform, shape(x), x)


def instance_attr(x):
    return jax.pure_callback(sim.handler, shape(x), x)


def closure(x):
    return jax.pure_callback(lam, shape(x), x)


def memo(x):
    return x * load_coeffs()


x = jnp.arange(1.0, 4.0)
parts = sys.argv[3].split(",")  # "kiln", "jax" or both
for fn in (module_attr, class_attr, instance_attr, closure, memo):
    if "kiln" in parts:
        call(fn.__name__, kiln.jit(fn), x)
    if "jax" in parts:
        call(fn.__name__ + ":jax", jax.jit(fn), x)
report()
'''
NAMES = ("module_attr", "class_attr", "instance_attr", "closure", "memo")
# each mode: its prog.py, and for each process what it calls and what Python runs
MODES: dict[str, tuple[str, list[tuple[str, tuple[str, ...]]]]] = {
    "decorated": (PROG, [("kiln,jax", ("prog.py",))]),
    "kiln run": (PROG.replace("kiln.jit(fn)", "jax.jit(fn)"),
                 [("kiln", ("-m", "kiln", "run", "prog.py")), ("jax", ("prog.py",))]),
}


@pytest.mark.parametrize("mode", list(MODES), ids=[m.replace(" ", "-") for m in MODES])
def test_rebound_callbacks_and_memo_values(tmp_path: Any, xp: Any, mode: str) -> None:
    prog = xp.Program(tmp_path)
    prog.write("ops.py", OPS)
    source, processes = MODES[mode]
    prog.write("prog.py", source)

    def run(how: str, k: str, coeff: str) -> Any:
        (prog.dir / "coeffs.txt").write_text(coeff)
        r: dict[str, Any] = {}
        for parts, main in processes:
            env: dict[str, str | None] = {}
            if main[0] == "-m":  # kiln run as it is by default: JAX's cache in the store too
                env["KILN_JAX_CACHE"] = None
            if "kiln" not in parts:  # the reference: a store of its own, never used
                env["KILN_CACHE_DIR"] = str(tmp_path / "reference")
            r.update(prog.run(how, k, parts, env=env, main=main).results)
        for name in NAMES:
            assert xp.value(r[name]) == xp.value(r[name + ":jax"]), (how, k, coeff, name)
        return r

    cold = run("square", "2.0", "2.0")
    for name in NAMES:
        assert cold[name]["misses"] == 1 and cold[name]["compiles"] == 1, name
    warm = run("square", "2.0", "2.0")
    for name in NAMES:
        xp.assert_warm(warm[name])
    # rebound attributes, another closure value, another file behind the memo: each follows
    changed = run("cube", "3.0", "5.0")
    for name in ("module_attr", "class_attr", "instance_attr", "memo"):
        assert changed[name]["traces"] == 1, name  # another key: traced again
    # the memo's file is an input of the guard (kiln._keys._guard): the same key, verified,
    # another program, compiled (under the guard's own key)
    assert changed["memo"]["verifies"] == 1 and changed["memo"]["misses"] == 1
    for name in ("module_attr", "class_attr", "instance_attr"):
        if mode == "decorated":
            assert changed[name]["misses"] == 1, name
        else:  # the swap's functions look the lowered module up: the same (it does not hold
            # the callback), loaded without compiling; its call runs the callback bound now
            assert changed[name]["hits"] == 1 and changed[name]["compiles"] == 0, name
    # (the live lambda is called: its value follows; coeffs.txt, another input, changed: its
    # guard verified once, kiln._keys._guard)
    xp.assert_same_key(changed["closure"])
    back = run("square", "2.0", "2.0")
    for name in NAMES:  # the first entries again (a rebound callback is another key; the
        # memo's first inputs are its entry's own guard)
        xp.assert_warm(back[name])
