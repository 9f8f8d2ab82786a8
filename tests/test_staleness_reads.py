"""What a trace reads that a warm start must re-check, across real processes sharing one
store: A (cold), B (warm: zero traces), C (every input changed: the new value, equal to plain
``jax.jit``'s in the same process), D (inputs changed back: the original value).

One program holds every scenario (process starts are the cost on a 2-core machine):

- package data read through the import system's loader (``pkgutil.get_data``) and through
  ``importlib.resources``;
- a SQLite database (a plain path and a ``file:...?mode=ro`` URI; ``:memory:`` keys nothing);
- tables loaded by the threads of a ``ThreadPoolExecutor`` the trace starts;
- override files found by ``os.path.exists``, ``os.path.isfile``, ``pathlib.Path.exists`` and
  ``os.stat`` (nothing opened) and created between runs;
- a library reinstalled into site-packages by pip, not editable, at the same version with
  changed code (counted by its ``RECORD``).
"""

from __future__ import annotations

import base64
import hashlib
import sqlite3
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_test_children import run_child

pytestmark = pytest.mark.slow

UDATA = '''
import importlib.resources
import pkgutil

from kiln_probe import TRACE


def by_get_data(x):
    TRACE()
    return x * float(pkgutil.get_data(__name__, "coeffs.txt"))


def by_resources(x):
    TRACE()
    return x * float(importlib.resources.files(__name__).joinpath("scale.txt").read_text())
'''

PROG = '''
import io
import json
import os
import pathlib
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import kiln
import udata
import ulib


def sqlite_path(x):
    TRACE()
    with sqlite3.connect("params.db") as db:
        (scale,) = db.execute("SELECT value FROM params WHERE name = 'scale'").fetchone()
    return x * scale


def sqlite_uri(x):
    TRACE()
    db = sqlite3.connect("file:params.db?mode=ro", uri=True)
    try:
        (shift,) = db.execute("SELECT value FROM params WHERE name = 'shift'").fetchone()
    finally:
        db.close()
    return x + shift


def sqlite_memory(x):
    TRACE()
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (v REAL)")
    db.execute("INSERT INTO t VALUES (4.0)")
    (v,) = db.execute("SELECT v FROM t").fetchone()
    db.close()
    return x * v


def read_bytes(name):
    with open(name, "rb") as fh:
        return fh.read()


def thread_pool(x):
    TRACE()
    # the pool's threads read the files; np.load parses their headers here (np.load in two
    # threads at once can raise CPython 3.11.7's "AST constructor recursion depth mismatch":
    # ast.literal_eval is not thread-safe there, gh-106905)
    with ThreadPoolExecutor(max_workers=2) as pool:
        a, b = (np.load(io.BytesIO(raw)) for raw in pool.map(read_bytes, ["t1.npy", "t2.npy"]))
    return x * jnp.asarray(a) + jnp.asarray(b)


def _override(name, found):
    if found:
        with open(name) as fh:
            return json.load(fh)["scale"]
    return 1.0


def by_exists(x):
    TRACE()
    return x * _override("ovr_exists.json", os.path.exists("ovr_exists.json"))


def by_isfile(x):
    TRACE()
    return x * _override("ovr_isfile.json", os.path.isfile("ovr_isfile.json"))


def by_path_exists(x):
    TRACE()
    return x * _override("ovr_path.json", pathlib.Path("ovr_path.json").exists())


def by_stat(x):
    TRACE()
    try:
        os.stat("ovr_stat.json")
    except FileNotFoundError:
        return x * 1.0
    return x * _override("ovr_stat.json", True)


def by_library(x):
    TRACE()
    return ulib.scale(x)


FUNCTIONS = {"by_get_data": udata.by_get_data, "by_resources": udata.by_resources,
             "sqlite_path": sqlite_path, "sqlite_uri": sqlite_uri,
             "sqlite_memory": sqlite_memory, "thread_pool": thread_pool,
             "by_exists": by_exists, "by_isfile": by_isfile, "by_path_exists": by_path_exists,
             "by_stat": by_stat, "by_library": by_library}
x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
for name, fn in FUNCTIONS.items():
    call(name, kiln.jit(fn), x)
for name, fn in FUNCTIONS.items():  # after kiln's: a function's jax trace may be cached
    call("jax:" + name, jax.jit(fn), x)
report(ulib=ulib.__file__)
'''

ULIB = "def scale(x):\n    return x * {factor}\n"

# name: (value in A, B and D; value in C, after its inputs changed)
EXPECT = {
    "by_get_data": ([2.0, 4.0, 6.0], [3.0, 6.0, 9.0]),
    "by_resources": ([5.0, 10.0, 15.0], [7.0, 14.0, 21.0]),
    "sqlite_path": ([2.0, 4.0, 6.0], [10.0, 20.0, 30.0]),
    "sqlite_uri": ([2.0, 3.0, 4.0], [102.0, 103.0, 104.0]),
    "thread_pool": ([2.0, 3.0, 4.0], [1.0, 2.0, 3.0]),
    "by_exists": ([1.0, 2.0, 3.0], [4.0, 8.0, 12.0]),
    "by_isfile": ([1.0, 2.0, 3.0], [4.0, 8.0, 12.0]),
    "by_path_exists": ([1.0, 2.0, 3.0], [4.0, 8.0, 12.0]),
    "by_stat": ([1.0, 2.0, 3.0], [4.0, 8.0, 12.0]),
    "by_library": ([2.0, 4.0, 6.0], [3.0, 6.0, 9.0]),
}


def _wheel(folder: Path, factor: str) -> Path:
    """A wheel of ``ulib`` 1.0 whose ``scale`` multiplies by ``factor`` (always version 1.0)."""
    files = {
        "ulib/__init__.py": ULIB.format(factor=factor),
        "ulib-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ulib\nVersion: 1.0\n",
        "ulib-1.0.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: kiln-tests\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n"),
        "ulib-1.0.dist-info/top_level.txt": "ulib\n",
    }
    rows = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    rows.append("ulib-1.0.dist-info/RECORD,,")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ulib-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("ulib-1.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return path


def _pip_install(wheel: Path, target: Path) -> None:
    """Install ``wheel`` into ``target`` with pip, as a user does (not editable)."""
    run_child(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--disable-pip-version-check", "--upgrade", "--force-reinstall", "--target", target,
         wheel],
        check=True, timeout=120,
    )


def _set_params(db: Path, scale: float, shift: float) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS params (name TEXT PRIMARY KEY, value REAL)")
        conn.execute("INSERT OR REPLACE INTO params VALUES ('scale', ?), ('shift', ?)",
                     (scale, shift))
    conn.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reads33")
    prog = xp.Program(root)
    site = prog.dir / "site" / "site-packages"  # a library folder (its name says so)
    prog.base_env = {"PYTHONPATH": str(site)}
    prog.write("prog.py", PROG)
    prog.write("udata/__init__.py", UDATA)

    def inputs(changed: bool) -> None:
        prog.write("udata/coeffs.txt", "3.0" if changed else "2.0")
        prog.write("udata/scale.txt", "7.0" if changed else "5.0")
        _set_params(prog.dir / "params.db", 10.0 if changed else 2.0,
                    101.0 if changed else 1.0)
        np.save(prog.dir / "t1.npy", np.ones(3, np.float32))
        np.save(prog.dir / "t2.npy", np.full(3, 0.0 if changed else 1.0, np.float32))
        for name in ("ovr_exists", "ovr_isfile", "ovr_path", "ovr_stat"):
            if changed:
                prog.write(f"{name}.json", '{"scale": 4.0}')
            else:
                (prog.dir / f"{name}.json").unlink(missing_ok=True)
        _pip_install(_wheel(root / ("new" if changed else "old"), "3.0" if changed else "2.0"),
                     site)

    inputs(changed=False)
    out = {"A": prog.run(), "B": prog.run()}
    inputs(changed=True)
    out["C"] = prog.run()
    inputs(changed=False)
    out["D"] = prog.run()
    return out


def test_the_library_is_installed_in_site_packages(runs: dict[str, Any]) -> None:
    assert all(Path(runs[k].extra["ulib"]).parts[-3] == "site-packages" for k in "ABCD")


@pytest.mark.parametrize("name", list(EXPECT))
def test_a_changed_input_gives_the_new_value(runs: dict[str, Any], xp: Any, name: str) -> None:
    """A cold, B warm (no trace), C traced and compiled again with the value plain jax.jit
    gives in the same process, D the original value again."""
    before, after = EXPECT[name]
    a, b, c, d = (runs[k][name] for k in "ABCD")
    xp.assert_cold(a)
    xp.assert_warm(b)
    for rec in (a, b, d):
        np.testing.assert_allclose(xp.value(rec), before)
    np.testing.assert_allclose(xp.value(c), after)
    assert xp.value(c) == xp.value(runs["C"]["jax:" + name])
    assert c["py_traces"] >= 1 and c["compiles"] == 1 and c["hits"] == 0, c
    for k in "ABD":
        assert xp.value(runs[k][name]) == xp.value(runs[k]["jax:" + name])


def test_an_in_memory_database_keys_nothing(runs: dict[str, Any], xp: Any) -> None:
    """Its key holds in every run; C and D changed inputs of its guard (files other functions
    read, a library reinstalled: kiln._keys._guard): verified once each, never compiled."""
    xp.assert_cold(runs["A"]["sqlite_memory"])
    xp.assert_warm(runs["B"]["sqlite_memory"])
    for k in "BCD":
        if k != "B":
            xp.assert_same_key(runs[k]["sqlite_memory"])
        assert xp.value(runs[k]["sqlite_memory"]) == [4.0, 8.0, 12.0]


def test_nothing_took_the_verify_path(runs: dict[str, Any]) -> None:
    for k in "ABCD":
        assert runs[k].stats["reasons"].get("verify-path", 0) == 0, runs[k].stats["reasons"]
        assert runs[k].stats["bad_entries"] == 0


STAT_HELPER = '''
from os import stat  # imported while kiln traces: the module keeps os.stat as it was then


def scale(path):
    return 2.0 if stat(path).st_size else 1.0
'''

STAT_PROG = '''
import jax.numpy as jnp

import kiln


@kiln.jit
def f(x):
    TRACE()
    import stat_helper  # first imported here, while tracing (os.stat is kiln's probe then)

    return x * stat_helper.scale("prog.py")


call("f", f, jnp.arange(3.0))
report()
'''


def test_a_module_that_imports_os_stat_while_tracing_still_warm_starts(tmp_path, xp):
    """A module imported while kiln records holds kiln's probe of ``os.stat`` for good
    (``from os import stat``); the walk takes it for ``os.stat``, so the warm start, which
    imports the module outside any recording, finds the same key."""
    prog = xp.Program(tmp_path)
    prog.write("stat_helper.py", STAT_HELPER)
    prog.write("prog.py", STAT_PROG)
    cold, warm = prog.run(), prog.run()
    xp.assert_cold(cold["f"])
    xp.assert_warm(warm["f"])
    assert xp.value(warm["f"]) == xp.value(cold["f"]) == [0.0, 2.0, 4.0]
