"""Shared fixtures: every test gets its own store directory and zeroed counters."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# kiln turns the kiln:// route (JAX's cache in its store) on at import unless this says no: the
# suite counts kiln's entries and JAX's compiles, and turns the route on where a test means it
os.environ.setdefault("KILN_JAX_CACHE", "0")

import kiln  # noqa: E402

# Audit share of the suite: KILN_TEST_VERIFY=1 (set by .ci/run for one pass over tests/test_jit.py)
# runs every warm hit in KILN_VERIFY mode.
_VERIFY = os.environ.get("KILN_TEST_VERIFY") == "1"

# JAX's own jit tests through kiln run on their own, cold then warm, by .ci/run (their conftest
# and pytest.ini say how), and equinox's test_jit.py by tests/equinox_api/run.py (from an
# equinox source: tests/test_equinox_api.py): not part of this suite
collect_ignore = ["jax_api", "equinox_api"]


def _load(stem: str) -> types.ModuleType:
    """``tests/<stem>.py``, loaded by path as the module ``kiln_test_<stem>``: test modules
    cannot import each other under ``--import-mode=importlib``; they import these by that name
    (``from kiln_test_children import child_env, run_child``)."""
    name = f"kiln_test_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{stem}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_servers = _load("servers")
_children = _load("children")  # every child process's environment, and how it runs
_load("helpers")  # error_of
redis_server, redis_url = _servers.redis_server, _servers.redis_url
s3_server, s3_url = _servers.s3_server, _servers.s3_url


@pytest.fixture(scope="session")
def servers() -> types.ModuleType:
    """``tests/servers.py``: ``free_port()``, ``hung_server()``, ``start_redis``, ``stop``..."""
    return _servers


@pytest.fixture(scope="session")
def children() -> types.ModuleType:
    """``tests/children.py`` (``child_env``, ``run_child``...), for a test module that
    ``multiprocessing`` imports again in its workers: this file has not run there, so no
    ``kiln_test_children`` to import."""
    return _children


@pytest.fixture(autouse=True)
def kiln_store(tmp_path, monkeypatch):
    """A private local store under tmp_path; process-wide settings restored afterwards."""
    for var in [v for v in os.environ if v.startswith("KILN_")]:
        monkeypatch.delenv(var)
    # JAX's own cache stays off unless a test turns the kiln:// route on (tests/test_jax_cache.py):
    # the suite counts kiln's entries and JAX's compiles
    monkeypatch.setenv("KILN_JAX_CACHE", "0")
    cache = tmp_path / "kiln-cache"
    kiln.configure(cache_dir=cache, store=None, verify=_VERIFY)
    kiln.reset_stats()
    yield cache
    assert kiln.wait_for_tier_up(timeout=300), "a background tier-up compile did not finish"
    kiln.disable_jax_cache()
    kiln.configure(cache_dir=None, store=None, verify=None, explain=None, strict=None,
                   signing_key=None, max_size=None, progress=None, tier_up=None)


# ----------------------------------------------------------------------------------------------
# Cross-process tests
# ----------------------------------------------------------------------------------------------
# Cross-process tests (``test_staleness.py``, ``test_warm_start.py``) use :class:`Program` through
# the ``xp`` fixture: a small user program written into a temporary folder and run in fresh Python
# processes sharing one store (``KILN_CACHE_DIR``). Inside the program, the ``kiln_probe`` module
# measures each call:
#
# - ``TRACE()``: put it in a function body; it counts Python-side traces (the body only runs when
#   jax traces it);
# - ``call(name, fn, *args, **kwargs)``: calls ``fn`` and records, for that call alone, its result
#   leaves, any exception, the deltas of :func:`kiln.stats` counters, the ``TRACE()`` count, and
#   jax's own monitoring events (traces, lowerings, XLA backend compiles), counted independently
#   of kiln;
# - ``report(**extra)``: prints everything as one JSON line.
#
# ``TRACE`` is user code like any other (kiln hashes its bytecode), but the count it keeps lives in
# an object whose ``__kiln_digest__`` is constant, so counting never changes a key. (A global
# ``int`` or ``list`` counter would be hashed by value and change the key on every trace.)
# Children run with ``PYTHONDONTWRITEBYTECODE=1``: an edit that keeps a file's size, made in the
# same second as the previous run, would otherwise be shadowed by a stale ``.pyc``.

PROBE_SOURCE = '''
import json
import warnings

import jax
import numpy as np

import kiln

warnings.simplefilter("error", kiln.KilnWarning)

events = []
results = {}

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "jax_traces",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax_lowerings",
    "/jax/core/compile/backend_compile_duration": "xla_compiles",
}
COUNTERS = ("hits", "misses", "traces", "compiles", "calls_hot", "bad_entries", "stores_written",
            "verifies")


class _Counter:
    """Counts traces; its __kiln_digest__ keeps the changing count out of kiln's keys."""

    n = 0

    def __kiln_digest__(self):
        return b"kiln-probe-counter"


_counter = _Counter()


def TRACE():
    _counter.n += 1


def _listener(event, duration, **kwargs):
    events.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)


def plain(out):
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays = (jax.Array, np.ndarray, np.generic, int, float, bool, complex)
    return {
        # a leaf that is not an array (filter_jit: a Module's function) by its type name
        "leaves": [np.asarray(a).tolist() if isinstance(a, arrays) else
                   a if isinstance(a, str) else f"<{type(a).__name__}>" for a in leaves],
        "dtypes": [str(np.asarray(a).dtype) if isinstance(a, arrays) else "static"
                   for a in leaves],
        "tree": str(treedef),
        "type": type(out).__name__,
    }


def call(name, fn, *args, **kwargs):
    """Call fn, record what it cost; exceptions are recorded, not raised."""
    if name in results:
        raise ValueError(f"duplicate probe name {name!r}")
    s0, e0, t0 = kiln.stats(), len(events), _counter.n
    rec = {}
    out = None
    try:
        out = jax.block_until_ready(fn(*args, **kwargs))
        rec.update(plain(out))
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    s1 = kiln.stats()
    for k in COUNTERS:
        rec[k] = getattr(s1, k) - getattr(s0, k)
    rec["py_traces"] = _counter.n - t0
    new_events = events[e0:]
    for ev, k in EVENTS.items():
        rec[k] = new_events.count(ev)
    results[name] = rec
    return out


def report(**extra):
    print("KILN-PROBE " + json.dumps(
        {"results": results, "stats": kiln.stats().as_dict(), "extra": extra}
    ), flush=True)
'''

PRELUDE = '''\
import sys as _sys
import types as _types

kiln_probe = _types.ModuleType("kiln_probe")
with open("kiln_probe.txt") as _f:
    exec(compile(_f.read(), "<kiln-probe>", "exec"), kiln_probe.__dict__)
_sys.modules["kiln_probe"] = kiln_probe
from kiln_probe import TRACE, call, report  # noqa: E402
'''

@dataclass
class Run:
    """One finished child process."""

    results: dict[str, dict[str, Any]]
    stats: dict[str, Any]
    extra: dict[str, Any]
    stdout: str
    stderr: str

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.results[name]


@dataclass
class Program:
    """A user program in its own folder, with a store shared by all its runs."""

    root: Path
    base_env: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir = self.root / "prog"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cache = self.root / "cache"
        (self.dir / "kiln_probe.txt").write_text(PROBE_SOURCE)

    def write(self, name: str, text: str) -> Path:
        """Write a file of the program (``prog.py`` gets the probe prelude prepended)."""
        text = textwrap.dedent(text)
        if name == "prog.py":
            text = PRELUDE + text
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def edit(self, name: str, old: str, new: str) -> None:
        """Replace the one occurrence of ``old`` in file ``name`` by ``new``."""
        path = self.dir / name
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise AssertionError(f"{name}: expected one {old!r}, found {count}")
        path.write_text(text.replace(old, new))

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 180,
            main: tuple[str, ...] = ("prog.py",)) -> Run:
        """Run ``prog.py`` in a fresh process; fail with its output unless it reported."""
        return self.finish(self.start(*args, env=env, main=main), timeout=timeout)

    def start(self, *args: str, env: dict[str, str] | None = None,
              main: tuple[str, ...] = ("prog.py",)) -> subprocess.Popen[str]:
        """Start ``prog.py`` in a fresh process (for several at once); see :meth:`finish`.
        ``main``: what Python runs, before ``args`` (``("-m", "kiln", "run", "prog.py")``)."""
        settings = {"KILN_CACHE_DIR": str(self.cache), "KILN_JAX_CACHE": "0",
                    "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
                    **self.base_env, **(env or {})}
        if "KILN_GUARD_EXCLUDE" not in settings:
            # the programs here take labels on the command line (which calls to make, "cold" or
            # "warm"), which the guard counts as an input like any other (a warm run with
            # other arguments verifies once): these tests are of the key, so the command line
            # is left out of the guard; tests/test_guard.py tests the guard with it
            settings["KILN_GUARD_EXCLUDE"] = "argv"
        proc = _children.start_child([sys.executable, *main, *args], cwd=self.dir,
                                     env=_children.child_env(**settings))
        proc.kiln_args = (args, env)  # type: ignore[attr-defined]
        return proc

    def finish(self, proc: subprocess.Popen[str], timeout: float = 180) -> Run:
        """Wait for a started process; fail with its output unless it reported."""
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"child process ran past {timeout} s\n--- stderr ---\n"
                                 f"{stderr[-8000:]}") from None
        args, env = proc.kiln_args  # type: ignore[attr-defined]
        lines = [ln for ln in stdout.splitlines() if ln.startswith("KILN-PROBE ")]
        if proc.returncode != 0 or not lines:
            raise AssertionError(
                f"child process failed (exit {proc.returncode}) with args {args}, env {env}\n"
                f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}"
            )
        data = json.loads(lines[-1][len("KILN-PROBE "):])
        run = Run(data["results"], data["stats"], data["extra"], stdout, stderr)
        self.runs.append(run)
        return run


def value(rec: dict[str, Any]) -> Any:
    """The single result leaf of a probe record (fails with the error, if the call raised)."""
    assert "error" not in rec, rec["error"]
    assert len(rec["leaves"]) == 1, rec
    return rec["leaves"][0]


def assert_cold(rec: dict[str, Any]) -> None:
    """A persistent miss: traced, compiled once, no error."""
    assert "error" not in rec, rec["error"]
    assert rec["misses"] == 1 and rec["hits"] == 0, rec
    assert rec["compiles"] == 1 and rec["xla_compiles"] >= 1, rec
    assert rec["py_traces"] >= 1, rec


def assert_warm(rec: dict[str, Any]) -> None:
    """A warm start: loaded from the store with no trace, no lowering and no compile."""
    assert "error" not in rec, rec["error"]
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["traces"] == 0 and rec["py_traces"] == 0 and rec["jax_traces"] == 0, rec
    assert rec["jax_lowerings"] == 0, rec
    assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec


def assert_same_key(rec: dict[str, Any]) -> None:
    """The key held: loaded, never compiled; traced at most once, and only to verify the guard
    (an input of the process changed since the entry was written: a file, the program's own
    source, a variable it read; ``kiln._keys._guard``)."""
    assert "error" not in rec, rec["error"]
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec
    assert rec["traces"] == rec["verifies"] <= 1, rec


def assert_warm_verified(rec: dict[str, Any]) -> None:
    """A hit that traced and lowered (verify path / audit mode) but never compiled."""
    assert "error" not in rec, rec["error"]
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["traces"] >= 1 and rec["py_traces"] >= 1, rec
    assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec


@pytest.fixture(scope="session")
def xp() -> types.SimpleNamespace:
    """Cross-process helpers: ``xp.Program(folder)``, ``xp.value(rec)``, ``xp.assert_cold``,
    ``xp.assert_warm``, ``xp.assert_same_key``, ``xp.assert_warm_verified`` (test modules
    cannot import conftest)."""
    return types.SimpleNamespace(
        Program=Program, value=value, assert_cold=assert_cold, assert_warm=assert_warm,
        assert_warm_verified=assert_warm_verified, assert_same_key=assert_same_key,
    )
