"""Pickled kiln functions carry their compiled executables.

A kiln function that cannot be found again by module and name (a lambda, a closure, anything
in ``__main__`` under another name) pickles by value with cloudpickle and carries the entries
of the signatures it compiled; the receiving process runs them with no trace and no compile,
even with an empty store of its own (jax-ml/jax #4572, #476). Each test runs real processes.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
from kiln_test_children import child_env, run_child

import kiln

pytestmark = pytest.mark.slow

PARENT = r'''
import os, sys, json
import cloudpickle
import jax, jax.numpy as jnp
import kiln

SCALE = 3.0


def body(x):
    return jnp.sin(x) * SCALE


def make(offset):
    # a closure, found by no name, whose own lambdas run while tracing (in the manifest they
    # would be named after `make`, which does not travel; its code covers them)
    return kiln.jit(lambda x: jax.lax.cond(x.sum() > -1.0, lambda v: body(v) + offset,
                                           lambda v: v, x))


f = make(1.0)
out = f(jnp.arange(3.0)).tolist()
with open(sys.argv[1], "wb") as fh:
    fh.write(cloudpickle.dumps(f))
print(json.dumps({"out": out, "compiles": kiln.stats().compiles}))
'''

CHILD = r'''
import sys, json, pickle
import jax.numpy as jnp
import kiln

with open(sys.argv[1], "rb") as fh:
    g = pickle.load(fh)
out = g(jnp.arange(3.0)).tolist()
s = kiln.stats()
print(json.dumps({"out": out, "traces": s.traces, "compiles": s.compiles, "hits": s.hits}))
'''

POOL = r'''
import os, sys, json
import jax, jax.numpy as jnp
import kiln
from joblib import Parallel, delayed


def body(x):
    return jnp.cos(x) * 2.0


def make(k):
    return kiln.jit(lambda x: body(x) * k)


def work(fn, n):
    import kiln, jax.numpy as jnp
    out = fn(jnp.arange(3.0) + n).tolist()
    s = kiln.stats()
    return {"out": out, "traces": s.traces, "compiles": s.compiles, "pid": os.getpid()}


if __name__ == "__main__":
    g = make(3.0)
    want = [g(jnp.arange(3.0) + n).tolist() for n in range(4)]  # compiled here: one program
    os.environ["KILN_CACHE_DIR"] = sys.argv[1]  # the workers' store is empty
    got = Parallel(n_jobs=2, backend="loky")(delayed(work)(g, n) for n in range(4))
    print(json.dumps({"want": want, "got": got}))
'''


SPAWN = r'''
import json, multiprocessing, os
from concurrent.futures import ProcessPoolExecutor
import jax.numpy as jnp
import kiln


@kiln.jit
def f(x):
    return jnp.tanh(x) * 4.0


def work(fn, n):
    out = fn(jnp.arange(3.0) + n).tolist()
    s = kiln.stats()
    return {"out": out, "traces": s.traces, "compiles": s.compiles}


if __name__ == "__main__":
    want = [f(jnp.arange(3.0) + n).tolist() for n in range(3)]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = list(pool.map(work, [f] * 3, range(3)))  # f pickles by reference
    print(json.dumps({"want": want, "got": got}))
'''


def _env(cache: Path, **extra: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu", **extra)


def _run(tmp_path: Path, source: str, args: list[str], cache: Path, **extra: str) -> Any:
    script = tmp_path / "prog.py"
    script.write_text(source)
    proc = run_child([sys.executable, script, *args], env=_env(cache, **extra), cwd=tmp_path,
                     timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cloudpickled_closure_runs_with_no_trace_and_no_compile(tmp_path: Path) -> None:
    pkl = tmp_path / "f.pkl"
    parent = _run(tmp_path, PARENT, [str(pkl)], tmp_path / "parent-store")
    assert parent["compiles"] == 1
    child = _run(tmp_path, CHILD, [str(pkl)], tmp_path / "child-store")  # an empty store
    assert child["out"] == parent["out"]
    # another program, whose inputs differ from the parent's (its code, its command line):
    # the carried executable is verified once (kiln._keys._guard: traced, its module the
    # same), never compiled
    assert (child["traces"], child["compiles"], child["hits"]) == (1, 0, 1)
    # the carried entry now lives in the child's own store
    assert any((tmp_path / "child-store").rglob("*.kiln"))


def test_carrying_can_be_turned_off(tmp_path: Path) -> None:
    pkl = tmp_path / "f.pkl"
    _run(tmp_path, PARENT, [str(pkl)], tmp_path / "parent-store", KILN_PICKLE_MAX_SIZE="0")
    child = _run(tmp_path, CHILD, [str(pkl)], tmp_path / "child-store")
    assert (child["traces"], child["compiles"]) == (1, 1)  # compiled where it runs
    assert pkl.stat().st_size < 8000  # the function alone


def test_tampered_carried_entry_is_refused_and_compiled(tmp_path: Path) -> None:
    pkl = tmp_path / "f.pkl"
    _run(tmp_path, PARENT, [str(pkl)], tmp_path / "parent-store")
    data = bytearray(pkl.read_bytes())
    marker = data.find(b"KILN")  # the carried entry's bytes start with the format's magic
    assert marker > 0
    data[marker + 200] ^= 0xFF
    pkl.write_bytes(bytes(data))
    child = _run(tmp_path, CHILD, [str(pkl)], tmp_path / "child-store")
    assert child["out"] == [1.0, 3.5244128704071045, 3.7278921604156494]
    assert child["compiles"] == 1


def test_joblib_loky_workers_run_the_parents_executable(tmp_path: Path) -> None:
    pytest.importorskip("joblib")
    res = _run(tmp_path, POOL, [str(tmp_path / "workers-store")], tmp_path / "parent-store")
    assert [r["out"] for r in res["got"]] == res["want"]
    for r in res["got"]:
        assert (r["traces"], r["compiles"]) == (0, 0), r


def test_spawned_workers_load_a_module_level_function_from_the_store(tmp_path: Path) -> None:
    res = _run(tmp_path, SPAWN, [], tmp_path / "store")
    assert [r["out"] for r in res["got"]] == res["want"]
    for r in res["got"]:
        assert (r["traces"], r["compiles"]) == (0, 0), r


def test_module_level_function_pickles_by_reference() -> None:
    f = kiln.jit(_module_level)
    globals()["_module_level_jit"] = f
    f.__qualname__ = "_module_level_jit"
    data = pickle.dumps(f)
    assert pickle.loads(data) is f
    assert len(data) < 200


def _module_level(x):
    return x + 1


def test_plain_pickle_of_a_lambda_fails_as_for_any_lambda() -> None:
    f = kiln.jit(lambda x: x + 1)
    f(jnp.ones(2))
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(f)


NOINLINE_PARENT = r'''
import sys, json
import cloudpickle
import jax.numpy as jnp
import kiln


def make(k):
    return kiln.noinline(lambda x: jnp.sin(x) * k)   # found by no name: pickled by value


g = make(2.0)
x = jnp.arange(4.0)
out = g(x).tolist()                                  # compiles g's executable at float32[4]
with open(sys.argv[1], "wb") as fh:
    fh.write(cloudpickle.dumps(g))
print(json.dumps({"out": out, "compiles": kiln.stats().compiles}))
'''

NOINLINE_CHILD = r'''
import sys, json, pickle
import jax.numpy as jnp
import kiln

with open(sys.argv[1], "rb") as fh:
    g = pickle.load(fh)
out = g(jnp.arange(4.0)).tolist()
twice = kiln.jit(lambda x: g(x) + g(x + 1.0))(jnp.arange(4.0)).tolist()  # called by a program
s = kiln.stats()
print(json.dumps({"out": out, "twice": twice, "compiles": s.compiles, "hits": s.hits,
                  "repr": repr(g)}))
'''


def test_cloudpickled_noinline_function_carries_its_executables(tmp_path: Path) -> None:
    pkl = tmp_path / "g.pkl"
    parent = _run(tmp_path, NOINLINE_PARENT, [str(pkl)], tmp_path / "parent-store",
                  KILN_TIER_UP="0")
    assert parent["compiles"] == 1
    child = _run(tmp_path, NOINLINE_CHILD, [str(pkl)], tmp_path / "child-store",
                 KILN_TIER_UP="0")
    assert child["out"] == parent["out"]
    assert "<kiln.noinline" in child["repr"]
    # g's own executable came with it (a hit, no compile); the new outer program compiles once
    assert child["hits"] == 1 and child["compiles"] == 1
    want = (jnp.sin(jnp.arange(4.0)) * 2 + jnp.sin(jnp.arange(4.0) + 1) * 2).tolist()
    assert child["twice"] == pytest.approx(want, rel=1e-6)


def test_module_level_noinline_pickles_by_reference() -> None:
    g = kiln.noinline(_module_level)
    globals()["_module_level_noinline"] = g
    g.__qualname__ = "_module_level_noinline"
    assert pickle.loads(pickle.dumps(g)) is g


SCRIPT_LEVEL = r'''
import json, sys
import jax.numpy as jnp
import kiln
from joblib import Parallel, delayed


@kiln.jit
def tripled(x):                       # module level in a script: __main__
    return jnp.sin(x) * 3.0


@kiln.noinline
def halved(x):
    return x / 2.0


def work(f, g, n):
    import kiln, jax.numpy as jnp
    out = [f(jnp.arange(3.0) + n).tolist(), g(jnp.arange(3.0) + n).tolist()]
    s = kiln.stats()
    return {"out": out, "traces": s.traces, "compiles": s.compiles}


if __name__ == "__main__":
    want = [[tripled(jnp.arange(3.0) + n).tolist(), halved(jnp.arange(3.0) + n).tolist()]
            for n in range(2)]
    import os
    os.environ["KILN_CACHE_DIR"] = sys.argv[1]      # the workers' store is empty
    got = Parallel(n_jobs=2, backend="loky")(delayed(work)(tripled, halved, n) for n in range(2))
    print(json.dumps({"want": want, "got": got}))
'''


def test_a_script_level_function_reaches_loky_workers_with_its_executables(tmp_path: Path) -> None:
    """A module-level kiln function of a script lives in ``__main__``: a worker has another
    ``__main__``, so it pickles by value (as cloudpickle pickles a script's functions)."""
    pytest.importorskip("joblib")
    res = _run(tmp_path, SCRIPT_LEVEL, [str(tmp_path / "workers-store")], tmp_path / "parent")
    assert [r["out"] for r in res["got"]] == res["want"]
    for r in res["got"]:
        assert (r["traces"], r["compiles"]) == (0, 0), r
