"""JAX's own persistent cache routed into kiln's store (the ``kiln://`` route): unchanged
``jax.jit`` code, ``kiln run``, ``kiln.enable_jax_cache``, entries checked like kiln's own.

Real XLA compiles are counted in the child processes by wrapping
``jax._src.compiler.backend_compile_and_load`` (what JAX calls on a cache miss), independently
of kiln's and JAX's cache counters.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from kiln_test_children import child_env, run_child

import kiln
from kiln._base import decode, encode
from kiln._travel import _jax_cache
from kiln.stores import LocalStore

JAX_WRITES_CALLBACKS = jax.__version_info__ >= (0, 11)


# a child script's first lines: every real XLA compile counted in ``compiles``
COUNTING = textwrap.dedent('''
    import json, sys, jax, jax.numpy as jnp
    from jax._src import compiler

    compiles = []
    _real = compiler.backend_compile_and_load

    def counting(*args, **kwargs):
        compiles.append(1)
        return _real(*args, **kwargs)

    compiler.backend_compile_and_load = counting
''')

SCRIPT = COUNTING + textwrap.dedent('''
    import os

    @jax.jit
    def step(x, w):
        return jnp.tanh(x @ w) * 2.0 + 1.0

    def with_callback(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1

    x = jnp.arange(12.0).reshape(3, 4)
    w = jnp.ones((4, 4)) / 4
    y = step(x, w)
    z = jnp.cos(y).sum()           # eager operations compile too
    out = {"y": y.tolist(), "z": float(z), "compiles": len(compiles)}
    if os.environ.get("WITH_CALLBACK"):
        before = len(compiles)
        out["cb"] = jax.jit(with_callback)(x).tolist()
        out["callback_compiles"] = len(compiles) - before
    import kiln
    s = kiln.stats()
    out.update(hits=s.jax_cache_hits, misses=s.jax_cache_misses, writes=s.jax_cache_writes,
               bad=s.bad_entries, routed=kiln._travel._jax_cache.is_enabled(),
               read_s=s.jax_cache_read_seconds, load_s=s.jax_cache_load_seconds,
               lowerings=s.jax_lowerings, lower_s=s.jax_lower_seconds)
    print("RESULT " + json.dumps(out))
''')


def _env(store: Path, **extra: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=str(store), JAX_PLATFORMS="cpu", PYTHONDONTWRITEBYTECODE="1",
                     **extra)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[dict, str]:
    proc = run_child(cmd, cwd=cwd, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


def _kiln_run(tmp_path: Path, store: Path, **extra: str) -> tuple[dict, str]:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    # --no-jit: the route alone (kiln run's default also makes every jax.jit a kiln.jit)
    return _run([sys.executable, "-m", "kiln", "run", "--no-jit", str(script)], tmp_path,
                _env(store, **extra))


def _jax_entries(store: Path) -> dict[str, dict]:
    s = LocalStore(str(store))
    out = {}
    for key in s.iter():
        header = s.header(key)
        if header and header.get("kind") == "jax-cache":
            out[key] = header
    return out


@pytest.mark.slow
def test_kiln_run_unchanged_jax_script_compiles_nothing_the_second_time(tmp_path):
    store = tmp_path / "store"
    cold, err = _kiln_run(tmp_path, store)
    assert cold["routed"] is True
    assert cold["compiles"] >= 3  # step, tanh/cos eager ops, the sum
    assert cold["misses"] == cold["compiles"] and cold["writes"] == cold["compiles"]
    entries = _jax_entries(store)
    assert len(entries) == cold["writes"]
    assert "jax:jit_step" in {h["function"] for h in entries.values()}
    assert "jax cache hits: 0" in err

    warm, err = _kiln_run(tmp_path, store)
    assert warm["compiles"] == 0  # no XLA compile at all
    assert warm["hits"] == cold["compiles"] and warm["misses"] == 0 and warm["writes"] == 0
    assert (warm["y"], warm["z"]) == (cold["y"], cold["z"])
    # the warm-start breakdown's route figures (benchmarks/warm_breakdown.py): reads are timed
    # in every run, JAX's retrieval of hits only where there are hits
    assert cold["read_s"] > 0 and warm["read_s"] > 0
    assert cold["load_s"] == 0 and warm["load_s"] > 0
    # JAX lowers every program itself before its cache can look it up, warm or cold: one
    # lowering per compile, then one per hit
    assert cold["lowerings"] == cold["compiles"] and warm["lowerings"] == warm["hits"]
    assert cold["lower_s"] > 0 and warm["lower_s"] > 0
    assert f"jax cache hits: {cold['compiles']}" in err

    # kiln ls lists them as plain-jax entries, kiln verify checks them
    ls = run_child([sys.executable, "-m", "kiln", "ls", "--json"], env=_env(store), timeout=120)
    rows = json.loads(ls.stdout)
    listed = rows["entries"] if isinstance(rows, dict) else rows
    assert {r["kind"] for r in listed} == {"jax-cache"}
    verify = run_child([sys.executable, "-m", "kiln", "verify"], env=_env(store), timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"{len(entries)} ok, 0 bad" in verify.stdout

    # KILN_JAX_CACHE=0: the route stays off under kiln run too
    off, _ = _kiln_run(tmp_path, tmp_path / "other", KILN_JAX_CACHE="0")
    assert off["routed"] is False and off["writes"] == 0
    assert not (tmp_path / "other").exists() or not _jax_entries(tmp_path / "other")


@pytest.mark.slow
def test_tampered_or_foreign_entry_is_recompiled_and_replaced(tmp_path):
    store = tmp_path / "store"
    cold, _ = _kiln_run(tmp_path, store, KILN_SIGNING_KEY="key-a")
    key, header = next((k, h) for k, h in _jax_entries(store).items()
                       if h["function"] == "jax:jit_step")
    path = next(p for p in store.rglob(f"{key}*") if p.is_file())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    warm, err = _kiln_run(tmp_path, store, KILN_SIGNING_KEY="key-a")
    assert warm["compiles"] == 1 and warm["bad"] == 1  # the tampered one only
    assert warm["y"] == cold["y"]
    assert "is unusable" in err and "JAX compiles it again" in err
    again, _ = _kiln_run(tmp_path, store, KILN_SIGNING_KEY="key-a")
    assert again["compiles"] == 0 and again["bad"] == 0  # replaced

    # entries signed with another key are never decoded: every one is compiled again
    other, err = _kiln_run(tmp_path, store, KILN_SIGNING_KEY="key-b")
    assert other["compiles"] == cold["compiles"] and other["bad"] == cold["compiles"]
    assert other["y"] == cold["y"]


@pytest.mark.slow
def test_host_callbacks_cached_as_jax_decides(tmp_path):
    """jax 0.10 never writes an executable with host callbacks; 0.11+ writes it."""
    store = tmp_path / "store"
    cold, _ = _kiln_run(tmp_path, store, WITH_CALLBACK="1")
    warm, _ = _kiln_run(tmp_path, store, WITH_CALLBACK="1")
    assert warm["cb"] == cold["cb"]
    assert cold["callback_compiles"] >= 1
    assert warm["callback_compiles"] == (0 if JAX_WRITES_CALLBACKS else cold["callback_compiles"])


@pytest.mark.slow
def test_kiln_jit_process_routes_jax_cache_by_default_but_not_kiln_s_own_compiles(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent('''
        import json, jax, jax.numpy as jnp, kiln

        @kiln.jit
        def fitted(x):
            return jnp.sin(x) * 3.0

        x = jnp.linspace(0.0, 1.0, 8)   # an eager op: through JAX's cache
        y = fitted(x)
        s = kiln.stats()
        print("RESULT " + json.dumps({"y": y.tolist(), "routed": kiln._travel._jax_cache.is_enabled(),
                                      "compiles": s.compiles, "hits": s.hits,
                                      "writes": s.jax_cache_writes}))
    '''))
    store = tmp_path / "store"
    cold, _ = _run([sys.executable, str(prog)], tmp_path, _env(store))
    assert cold["routed"] is True and cold["compiles"] == 1 and cold["writes"] >= 1
    functions = {h["function"] for h in _jax_entries(store).values()}
    assert functions and not any("fitted" in f for f in functions)  # kiln stored its own
    warm, _ = _run([sys.executable, str(prog)], tmp_path, _env(store))
    assert warm["hits"] == 1 and warm["compiles"] == 0 and warm["writes"] == 0
    assert warm["y"] == cold["y"]

    # a cache directory of the user's own is left alone
    own = tmp_path / "jax-own"
    mine, _ = _run([sys.executable, str(prog)], tmp_path,
                   _env(tmp_path / "s2", JAX_COMPILATION_CACHE_DIR=str(own)))
    assert mine["routed"] is False and mine["writes"] == 0
    # and KILN_JAX_CACHE=0 keeps it off
    off, _ = _run([sys.executable, str(prog)], tmp_path, _env(tmp_path / "s3", KILN_JAX_CACHE="0"))
    assert off["routed"] is False and off["writes"] == 0


def test_jax_never_serializes_kiln_s_own_executable(kiln_store, monkeypatch):
    """JAX serializes and compresses an executable before the route's write, which drops the
    value of kiln's own compile (kiln's entry holds it): so kiln's compile tells JAX to write
    nothing, in that thread only, and the executable is serialized once, by kiln."""
    from jax._src import compilation_cache

    serialized = []
    real = compilation_cache.put_executable_and_time

    def counting(cache_key, module_name, *args, **kwargs):
        serialized.append(module_name)
        return real(cache_key, module_name, *args, **kwargs)

    monkeypatch.setattr(compilation_cache, "put_executable_and_time", counting)
    assert kiln.enable_jax_cache() is True
    try:
        @kiln.jit
        def own_program(x):
            return jnp.tanh(x) * 3.0

        @jax.jit
        def plain_program(x):
            return jnp.tanh(x) * 5.0

        x = jnp.arange(4.0)
        assert own_program(x).tolist() == (jnp.tanh(x) * 3.0).tolist()
        assert plain_program(x).tolist() == (jnp.tanh(x) * 5.0).tolist()
        assert kiln.stats().compiles == 1 and kiln.stats().stores_written == 1
        assert "jit_plain_program" in serialized  # plain jax.jit: routed as before
        assert not any("own_program" in name for name in serialized), serialized
        # the override was thread-local and is gone: JAX writes what it compiles again
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    finally:
        kiln.disable_jax_cache()


def test_the_route_holds_its_lease_from_the_miss_until_jax_writes(kiln_store):
    """JAX's put asks ``exists`` before it writes the value it compiled after a miss. That
    check must not give the key's lease up and take it again: in between, a process waiting
    for the value could take the lease, find nothing and compile the program a second time
    (seen as 2 compiles among 3 processes in tests/test_fleet.py, once in four runs)."""
    from kiln.stores import open_store

    jax_key = "jit_probe-0123456789abcdef"
    path = _jax_cache.StorePath(_jax_cache.ROOT) / f"{jax_key}-cache"
    assert path.exists() is False  # JAX's get: a miss, and this thread now holds the lease
    held = _jax_cache._held.item
    assert held is not None and held[0] == _jax_cache.store_key(jax_key)
    other = open_store(kiln.get_config()).lease(held[0], 30)  # another process's attempt
    assert other.acquire() is False
    assert path.exists() is False  # JAX's put checks before writing
    assert _jax_cache._held.item is held  # the same hold: never released and taken again
    assert other.acquire() is False
    path.write_bytes(b"the compiled value")  # JAX's write: stored, then the lease released
    assert _jax_cache._held.item is None
    assert other.acquire() is True
    other.release()
    assert path.exists() and path.read_bytes() == b"the compiled value"


def test_route_leases_are_released_after_the_compile_by_one_thread(kiln_store):
    """After XLA's compile a route lease is released within max(2 s, compile time) even when
    JAX never writes the value; one thread of the process does it for every lease (a timer
    thread per miss cost a thread start on each)."""
    from kiln.stores import open_store

    leases = []
    for i in range(3):
        path = _jax_cache.StorePath(_jax_cache.ROOT) / f"jit_probe{i}-0123456789abcdef-cache"
        assert path.exists() is False  # a miss: this thread takes the key's lease
        key, held = _jax_cache._held.item
        _jax_cache._on_duration(_jax_cache._BACKEND_COMPILE, 0.0)  # XLA compiled; no write
        leases.append(open_store(kiln.get_config()).lease(key, 30))
        assert leases[-1].acquire() is False
        _jax_cache._held.item = None  # (the next miss of this thread)
    assert [t.name for t in threading.enumerate()].count("kiln-route-leases") == 1
    deadline = time.monotonic() + 30
    while not all(lease.acquire() for lease in leases):
        assert time.monotonic() < deadline, "route leases never released"
        time.sleep(0.1)
    for lease in leases:
        lease.release()


def test_enable_and_disable_in_process(kiln_store):
    before = {name: getattr(jax.config, name) for name in _jax_cache._SETTINGS}
    assert kiln.enable_jax_cache() is True
    try:
        assert jax.config.jax_compilation_cache_dir == "kiln://store"
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_enable_xla_caches == "none"
        assert jax.config.jax_compilation_cache_max_size == -1

        @jax.jit
        def g(x):
            return x * 7.0 - 2.0

        assert float(g(jnp.float32(1.5))) == 8.5
        assert kiln.stats().jax_cache_writes >= 1
        s = LocalStore(str(kiln_store))
        headers = [s.header(k) for k in s.iter()]
        mine = [h for h in headers if h and h.get("function") == "jax:jit_g"]
        assert len(mine) == 1 and mine[0]["kind"] == "jax-cache"
        key = mine[0]["key"]
        entry = decode(s.get(key), signing_key=None)
        assert entry.header["jax_key"].startswith("jit_g-")
        assert key == _jax_cache.store_key(entry.header["jax_key"])
    finally:
        kiln.disable_jax_cache()
    assert {name: getattr(jax.config, name) for name in _jax_cache._SETTINGS} == before


def test_a_user_cache_dir_is_never_overridden(tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    try:
        assert kiln.enable_jax_cache() is False
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", None)


def test_disable_keeps_the_route_off_for_later_kiln_functions(kiln_store):
    kiln.configure(jax_cache=True)
    try:
        assert kiln.enable_jax_cache() is True
        kiln.disable_jax_cache()
        kiln.jit(lambda x: x + 1)  # would turn the route on by default
        assert _jax_cache.is_enabled() is False
        assert kiln.enable_jax_cache() is True  # explicitly, it comes back
    finally:
        kiln.disable_jax_cache()
        kiln.configure(jax_cache=None)


def test_an_entry_of_another_kind_under_the_key_reads_as_absent(kiln_store, caplog):
    """A valid kiln entry copied under a route key (not a jax-cache entry) is not handed to
    JAX: it reads as absent, is counted as bad, and is logged (not warned: this runs inside
    JAX's cache, where a warning made an error would stop the user's call)."""
    s = LocalStore(str(kiln_store))
    jax_key = "jit_h-0123abcd"
    key = _jax_cache.store_key(jax_key)
    s.put(key, encode({"kind": "executable", "key": key}, {"jax": b"not-an-executable"},
                      signing_key=None))
    path = _jax_cache.StorePath(_jax_cache.ROOT) / f"{jax_key}-cache"
    with caplog.at_level("WARNING", logger="kiln"):
        assert path.exists() is False
        assert path.exists() is False  # once per entry
    assert kiln.stats().bad_entries == 1
    assert [r.getMessage() for r in caplog.records if "is unusable" in r.getMessage()] == [
        f"kiln: JAX cache entry {key[:12]} (jit_h) in {str(kiln_store)!r} is unusable (entry "
        f"is of kind 'executable', not 'jax-cache'); JAX compiles it again and kiln replaces it"]


@pytest.mark.slow
def test_an_executable_jax_s_cache_loaded_is_compiled_again_before_kiln_stores_it(tmp_path):
    """XLA serializes an executable JAX's persistent cache deserialized without its kernels:
    an entry made from one fails on its first run in every later process ("NOT_FOUND: Function
    sine_multiply_fusion not found", seen in JAX's api_test under kiln). kiln's compile that
    JAX's cache serves is compiled again, fresh, before it is stored."""
    prog = tmp_path / "prog.py"
    prog.write_text(COUNTING + textwrap.dedent('''
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

        def f(x):
            return jnp.exp(x) * jnp.sin(x)

        x = jnp.arange(3.0)
        if sys.argv[1] == "jax":
            y = jax.jit(f)(x)
            out = {}
        else:
            import kiln
            y = kiln.jit(f)(x)
            s = kiln.stats()
            out = {"kiln_compiles": s.compiles, "hits": s.hits, "written": s.stores_written}
        print("RESULT " + json.dumps({"y": y.tolist(), "xla_compiles": len(compiles), **out}))
    '''))
    store = tmp_path / "store"
    env = _env(store, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-own"))
    plain, _ = _run([sys.executable, str(prog), "jax"], tmp_path, env)
    assert plain["xla_compiles"] == 2  # the eager arange and f: in the user's own JAX cache
    cold, _ = _run([sys.executable, str(prog), "kiln"], tmp_path, env)
    # JAX's cache served the program; kiln compiled it again (the one XLA compile) to store it
    assert cold["kiln_compiles"] == 1 and cold["written"] == 1 and cold["xla_compiles"] == 1
    warm, _ = _run([sys.executable, str(prog), "kiln"], tmp_path, env)
    assert warm["hits"] == 1 and warm["kiln_compiles"] == 0 and warm["xla_compiles"] == 0
    assert warm["y"] == cold["y"] == plain["y"]


@pytest.mark.slow
def test_the_route_is_on_from_import_so_work_before_the_first_kiln_jit_is_cached(tmp_path):
    """A script that draws data before any kiln.jit exists: the random-number
    programs are compiled by the first process only, as JAX's cache configured from the
    environment would; KILN_JAX_CACHE=0 leaves JAX alone from import on."""
    prog = tmp_path / "prog.py"
    prog.write_text(COUNTING + textwrap.dedent('''
        import kiln

        routed_at_import = kiln._travel._jax_cache.is_enabled()
        w = jax.random.normal(jax.random.key(1), (8, 8))   # before any kiln.jit exists
        before = len(compiles)
        f = kiln.jit(lambda x: x * 2)
        y = f(w)
        s = kiln.stats()
        print("RESULT " + json.dumps({"y": float(y.sum()), "routed": routed_at_import,
                                      "compiles_before_kiln": before,
                                      "hits": s.jax_cache_hits, "writes": s.jax_cache_writes}))
    '''))
    store = tmp_path / "store"
    cold, _ = _run([sys.executable, str(prog)], tmp_path, _env(store))
    assert cold["routed"] is True and cold["compiles_before_kiln"] >= 1 and cold["writes"] >= 1
    warm, _ = _run([sys.executable, str(prog)], tmp_path, _env(store))
    assert warm["compiles_before_kiln"] == 0 and warm["writes"] == 0
    assert warm["hits"] == cold["writes"] and warm["y"] == cold["y"]
    off, _ = _run([sys.executable, str(prog)], tmp_path, _env(store, KILN_JAX_CACHE="0"))
    assert off["routed"] is False and off["hits"] == 0 and off["compiles_before_kiln"] >= 1


SERVED = textwrap.dedent('''
    import json, sys, jax, jax.numpy as jnp
    from jax._src import compiler

    served = []
    _real = compiler.log_persistent_cache_hit

    def record(module_name, cache_key):
        served.append(module_name)
        return _real(module_name, cache_key)

    compiler.log_persistent_cache_hit = record
    import kiln

    w = jax.random.normal(jax.random.key(0), (8, 8))   # eager work before any jit
    b = jnp.tanh(w).sum()

    def step(x):
        return jnp.sin(x) @ w + b

    f = kiln.jit(step) if sys.argv[1] == "kiln" else jax.jit(step)
    y = f(w)
    z = jax.jit(lambda v: v * 3.0)(y)                   # a library's jax.jit after it
    print("RESULT " + json.dumps({"served": sorted(served), "kiln_hits": kiln.stats().hits,
                                  "z": z.tolist()}))
''')


@pytest.mark.slow
def test_what_kiln_caches_is_what_jax_s_cache_would(tmp_path):
    """The same script under JAX's own cache and under kiln, twice each: every
    program JAX's cache serves the second time is served under kiln too, by kiln's store
    (the kiln.jit function) or by JAX's cache through the kiln:// route (everything else)."""
    prog = tmp_path / "served.py"
    prog.write_text(SERVED)
    jax_env = _env(tmp_path / "unused", KILN_JAX_CACHE="0",
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    kiln_env = _env(tmp_path / "store")
    runs = {}
    for name, mode, env in (("jax", "jax", jax_env), ("kiln", "kiln", kiln_env)):
        _run([sys.executable, str(prog), mode], tmp_path, env)
        runs[name], _ = _run([sys.executable, str(prog), mode], tmp_path, env)
    by_jax, by_kiln = set(runs["jax"]["served"]), set(runs["kiln"]["served"])
    assert "jit_step" in by_jax and len(by_jax) >= 3, by_jax  # eager ops, step, the lambda
    assert runs["kiln"]["kiln_hits"] == 1  # step, from kiln's own store
    assert by_kiln == by_jax - {"jit_step"}, (by_jax, by_kiln)
    assert runs["kiln"]["z"] == runs["jax"]["z"]
