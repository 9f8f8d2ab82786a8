"""Fleets: one compile per key across processes (single-flight), takeover after a holder is
killed, remote stores layered behind the local one, faults that never stop the program, and
signed entries. Real processes; real ``redis-server`` / ``moto_server`` (tests/servers.py)."""

from __future__ import annotations

import json
import signal
import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child, start_child

import kiln
from kiln._base import FORMAT_VERSION
from kiln.stores import LayeredStore, LocalStore, open_store

# A program whose XLA compile takes about a second on this machine: long enough that processes
# released together all miss before the first one stores its entry (without single-flight each
# would compile).
SLOW = """
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp

import kiln


@kiln.jit
def f(x):
    TRACE()
    for i in range(120):
        x = jnp.tanh(x @ x.T) @ x + jnp.sort(x, axis=i % 2) * jnp.cumsum(x, axis=(i + 1) % 2)
    return x


if len(sys.argv) > 2:  # a barrier: every process is ready before any calls f
    barrier, n = Path(sys.argv[1]), int(sys.argv[2])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < n and time.monotonic() < deadline:
        time.sleep(0.01)
if len(sys.argv) > 3:  # tell the test when this process starts waiting for another's compile
    import logging

    class Waiting(logging.Handler):
        def emit(self, record):
            if "another process is compiling" in record.getMessage():
                Path(sys.argv[3]).touch()

    logging.getLogger("kiln").addHandler(Waiting())
    logging.getLogger("kiln").setLevel(logging.DEBUG)
call("f", f, jnp.full((8, 8), 0.01))
report()
"""

# The same program with plain jax.jit, its compiles cached through the kiln:// route.
SLOW_PLAIN = SLOW.replace("@kiln.jit", "@jax.jit").replace(
    "import kiln\n", "import jax\n\nimport kiln\n\nkiln.enable_jax_cache()\n", 1).replace(
    'call("f", f, jnp.full((8, 8), 0.01))\nreport()',
    'x = jnp.full((8, 8), 0.01)\ns0 = kiln.stats()\ncall("f", f, x)\ns1 = kiln.stats()\n'
    'report(jax_misses=s1.jax_cache_misses - s0.jax_cache_misses,\n'
    '       jax_hits=s1.jax_cache_hits - s0.jax_cache_hits)')

# Holds the lease on one key the way a compiling process does, then waits to be killed.
HOLDER = """
import sys
import time

from kiln import get_config
from kiln.stores import open_store

store = open_store(get_config())
lease = store.lease(sys.argv[1], get_config().lease_seconds)
assert lease.acquire(), "the lease was not free"
print("held", flush=True)
while True:  # renewed like a compiling process's lease, until killed
    time.sleep(0.5)
    lease.renew()
"""


def _env(kind: str, url: str | None, host: int) -> dict[str, str]:
    """A child's settings: ``kind`` "local" shares the Program's directory store; "redis" /
    "s3" give each child (a "host") its own local store with the remote one behind it."""
    if kind == "local":
        return {}
    return {"KILN_STORE": url or "", "KILN_SIGNING_KEY": "fleet-secret",
            "KILN_CACHE_DIR": f"host-{host}"}


@pytest.fixture(params=["local", "redis"])
def fleet(request):
    """(kind, remote URL or None)."""
    if request.param == "local":
        return "local", None
    return "redis", request.getfixturevalue("redis_url")


def _together(xp, tmp_path, source, n, kind, url):
    """``source`` as ``n`` processes released together through a barrier (each a "host" of
    ``kind``): the program and the runs, in process order."""
    prog = xp.Program(tmp_path)
    prog.write("prog.py", source)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # (each process lists the barrier folder while the others arrive: a listing that depends
    # on timing, which the guard would count as an input; the barrier is not the program's)
    procs = [prog.start(str(barrier), str(n), env={**_env(kind, url, i),
                                                    "KILN_GUARD_EXCLUDE": f"argv,{barrier}"})
             for i in range(n)]
    return prog, [prog.finish(p, timeout=300) for p in procs]


@pytest.mark.slow
def test_single_flight_one_compile_across_processes(xp, tmp_path, fleet):
    kind, url = fleet
    n = 4
    prog, runs = _together(xp, tmp_path, SLOW, n, kind, url)
    recs = [r["f"] for r in runs]
    assert sum(r["compiles"] for r in recs) == 1, recs
    assert sum(r["xla_compiles"] for r in recs) == 1, recs
    assert sum(r["hits"] for r in recs) == n - 1, recs
    assert sum(r["py_traces"] for r in recs) == 1, recs  # waiters do not trace: they load
    values = [np.asarray(xp.value(r)) for r in recs]
    assert all(np.array_equal(v, values[0]) for v in values) and values[0].shape == (8, 8)
    assert sum(r.stats["lease_waits"] for r in runs) >= 1  # someone waited, nobody compiled twice
    if kind == "redis":
        assert sum(r.stats["remote_hits"] for r in runs) == n - 1
        # each process recorded its counters in the shared store at exit: `kiln stats` shows
        # the fleet's (and each host's local store its own)
        with kiln.config_context(store=url, signing_key="fleet-secret"):
            counts = open_store(kiln.get_config(), layered=False).counts()
        assert counts["compiles"] == 1 and counts["hits"] == n - 1, counts
        assert counts["remote_hits"] == n - 1 and counts["lease_waits"] >= 1, counts
        host = LocalStore(prog.dir / "host-0").counts()
        assert host["compiles"] + host["hits"] == 1, host


# SLOW with an output kiln cannot store (a tree whose structure holds a lock): every process
# compiles it; the waiters must not take the key over one after another.
UNSTORABLE = SLOW.replace("import kiln\n", """import threading

import jax

import kiln


class Locked:
    def __init__(self, x, lock):
        self.x, self.lock = x, lock


jax.tree_util.register_pytree_node(
    Locked, lambda b: ((b.x,), b.lock), lambda lock, ch: Locked(ch[0], lock))
""", 1).replace("    return x\n", "    return Locked(x, threading.Lock())\n", 1).replace(
    "import sys\n", "import sys\nimport warnings\n", 1).replace(
    "call(\"f\",", "warnings.simplefilter(\"ignore\", kiln.KilnWarning)\ncall(\"f\",", 1)


@pytest.mark.slow
def test_waiters_on_a_holder_that_cannot_store_compile_at_once_not_in_turn(xp, tmp_path, fleet):
    """The holder compiles, cannot store the executable, and leaves a short-lived
    "not-storable" marker under the key before it lets the lease go: the processes waiting
    for its entry compile at once, none of them takes the key over (before: each took it over
    in turn, N compiles in sequence)."""
    kind, url = fleet
    n = 3
    prog, runs = _together(xp, tmp_path, UNSTORABLE, n, kind, url)
    recs = [r["f"] for r in runs]
    assert [r["compiles"] for r in recs] == [1] * n, recs  # nothing to load: each compiles
    assert all(r["stores_written"] == 0 for r in recs), recs
    assert sum(r.stats["lease_waits"] for r in runs) >= 1  # they did wait for the holder
    assert sum(r.stats["lease_takeovers"] for r in runs) == 0, [r.stats for r in runs]
    assert len({json.dumps(r["leaves"]) for r in recs}) == 1
    # a later process finds the marker (not expired) and compiles without waiting or leasing
    late = prog.run(env=_env(kind, url, n))
    assert late["f"]["compiles"] == 1
    assert late.stats["lease_waits"] == 0 and late.stats["lease_takeovers"] == 0


@pytest.mark.slow
def test_single_flight_for_plain_jax_jit_through_the_jax_cache_route(xp, tmp_path, fleet):
    kind, url = fleet
    prog = xp.Program(tmp_path)
    prog.write("prog.py", SLOW_PLAIN)
    n = 3
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {"KILN_JAX_CACHE": "1"}
    procs = [prog.start(str(barrier), str(n), env={**_env(kind, url, i), **env})
             for i in range(n)]
    runs = [prog.finish(p, timeout=300) for p in procs]
    recs = [r["f"] for r in runs]
    # f missed JAX's cache (and was compiled) in one process; the others loaded its value
    assert sum(r.extra["jax_misses"] for r in runs) == 1, [r.extra for r in runs]
    assert sum(r.extra["jax_hits"] for r in runs) == n - 1, [r.extra for r in runs]
    assert sum(r.stats["lease_waits"] for r in runs) >= 1
    values = [xp.value(r) for r in recs]
    assert all(v == values[0] for v in values)


@pytest.mark.slow
def test_waiter_takes_over_when_the_holder_is_killed(xp, tmp_path, fleet):
    kind, url = fleet
    prog = xp.Program(tmp_path)
    prog.write("prog.py", SLOW)
    first = prog.run(env=_env(kind, url, 0))  # the key, and the value to compare with
    xp.assert_cold(first["f"])
    key = _only_key(prog, kind, url)
    _delete(prog, kind, url, key)
    env = child_env(**{**_env(kind, url, 1), "KILN_LEASE_SECONDS": "2",
                       "JAX_PLATFORMS": "cpu", "KILN_JAX_CACHE": "0",
                       "KILN_CACHE_DIR": str(prog.dir / "host-1") if kind != "local"
                       else str(prog.cache)})
    (prog.dir / "holder.py").write_text(HOLDER)
    holder = start_child([sys.executable, "holder.py", key], cwd=prog.dir, env=env)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        flag = tmp_path / "waiting"
        (tmp_path / "nobarrier").mkdir()
        waiter = prog.start(str(tmp_path / "nobarrier"), "0", str(flag),
                            env={**_env(kind, url, 2), "KILN_LEASE_SECONDS": "2"})
        deadline = time.monotonic() + 120
        while not flag.exists() and waiter.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), "the second process never waited for the lease holder"
        holder.send_signal(signal.SIGKILL)  # the compiler dies without writing its entry
        run = prog.finish(waiter, timeout=300)
    finally:
        holder.kill()
        holder.communicate()
    rec = run["f"]
    assert rec["compiles"] == 1 and xp.value(rec) == xp.value(first["f"])
    assert run.stats["lease_waits"] == 1 and run.stats["lease_takeovers"] == 1


def _only_key(prog, kind: str, url: str | None) -> str:
    if kind == "local":
        (key,) = LocalStore(prog.cache).iter()
        return key
    with kiln.config_context(store=url, signing_key="fleet-secret"):
        keys = list(open_store(kiln.get_config(), layered=False).iter())
    assert len(keys) == 1, keys
    return keys[0]


def _delete(prog, kind: str, url: str | None, key: str) -> None:
    if kind == "local":
        assert LocalStore(prog.cache).delete(key)
        return
    with kiln.config_context(store=url, signing_key="fleet-secret"):
        assert open_store(kiln.get_config(), layered=False).delete(key)


# -- layering, in process --------------------------------------------------------------------
def _f(x):
    return jnp.sin(x) * 2.0 + 1.0


def _run(x, fn=_f):
    """``fn(x)`` looked up in the store (not served from this process's memory)."""
    f = kiln.jit(fn)
    f.clear_cache()
    return f(x)


def _signed_only_f(x):
    # (this test's alone: a late background write of another test's _f, with another guard,
    # would make this test's first call a verify)
    return jnp.cos(x) * 3.0 - 1.0


def test_remote_hit_is_copied_to_the_local_store(redis_url, tmp_path):
    x = jnp.arange(4.0)
    with kiln.config_context(store=redis_url, signing_key="k", cache_dir=tmp_path / "a"):
        want = _run(x)
        assert kiln.stats().compiles == 1 and kiln.stats().remote_misses >= 1
    kiln.reset_stats()
    # another "host": an empty local store, the same remote one
    with kiln.config_context(store=redis_url, signing_key="k", cache_dir=tmp_path / "b"):
        np.testing.assert_array_equal(_run(x), want)
        s = kiln.stats()
        assert s.compiles == 0 and s.hits == 1 and s.remote_hits == 1
    assert len(list(LocalStore(tmp_path / "b").iter())) == 1  # copied on the way
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, signing_key="k", cache_dir=tmp_path / "b"):
        np.testing.assert_array_equal(_run(x), want)
        s = kiln.stats()
        assert s.hits == 1 and s.remote_hits == 0 and s.remote_misses == 0  # read locally


def test_read_only_and_remote_only_modes(redis_url, tmp_path):
    import redis

    x = jnp.arange(3.0)
    with kiln.config_context(store=redis_url, signing_key="k", cache_dir=tmp_path / "a",
                             remote_mode="read-only"):
        store = open_store(kiln.get_config())
        assert isinstance(store, LayeredStore) and store.read_only
        _run(x)
        assert list(store.remote.iter()) == []  # never published
        assert len(list(store.local.iter())) == 1
        store.record_counts()  # (at exit): into the local store only, leases never remote
        assert store.remote.counts() == {} and store.local.counts()["compiles"] >= 1
        lease = store.lease("ab" * 32, 30)
        assert lease.acquire()
        client = redis.Redis.from_url(redis_url)
        assert client.keys("kiln:*") == []  # no lease (nor anything else) in Redis
        client.close()
        lease.release()
    with kiln.config_context(store=redis_url, signing_key="k", cache_dir=tmp_path / "b",
                             remote_mode="remote-only"):
        store = open_store(kiln.get_config())
        assert store.local is None
        _run(x)
        assert len(list(store.remote.iter())) == 1
    assert not (tmp_path / "b").exists()


def test_s3_store_layered(s3_url, tmp_path):
    x = jnp.arange(5.0)
    with kiln.config_context(store=s3_url, signing_key="k", cache_dir=tmp_path / "a"):
        want = _run(x)
    kiln.reset_stats()
    with kiln.config_context(store=s3_url, signing_key="k", cache_dir=tmp_path / "b"):
        np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().remote_hits == 1 and kiln.stats().compiles == 0


# -- faults ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["hung", "down"])
def test_a_remote_store_that_fails_warns_once_and_is_skipped(servers, how, tmp_path):
    with servers.hung_server() as hung:
        port = hung.port if how == "hung" else servers.free_port()
        url = f"redis://127.0.0.1:{port}/0"
        x = jnp.arange(3.0)
        with kiln.config_context(store=url, signing_key="k", cache_dir=tmp_path,
                                 remote_timeout=0.5):
            with pytest.warns(kiln.StoreWarning, match="skipping it for the rest") as rec:
                np.testing.assert_array_equal(_run(x), _f(x))
            assert len(rec) == 1
            s = kiln.stats()
            assert (s.remote_timeouts, s.remote_errors) == ((1, 0) if how == "hung" else (0, 1))
            # skipped from now on: more misses, no more attempts, no more warnings
            accepted = hung.accepted
            for i in range(3):
                np.testing.assert_array_equal(kiln.jit(lambda x, i=i: x + i)(x), x + i)
            s = kiln.stats()
            assert s.remote_timeouts + s.remote_errors == 1 and hung.accepted == accepted
            assert s.compiles == 4 and len(list(LocalStore(tmp_path).iter())) == 4


# -- signing -----------------------------------------------------------------------------------
def test_a_remote_store_without_a_signing_key_warns_once(redis_url, tmp_path):
    with kiln.config_context(store=redis_url, cache_dir=tmp_path):
        # where the user's code makes a kiln function (the first read may be inside JAX's
        # cache, where kiln only logs)
        with pytest.warns(kiln.StoreWarning, match="anyone who can write to it can run code"):
            f = kiln.jit(_f)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            f(jnp.arange(2.0))


def test_a_worker_without_the_key_leaves_signed_entries_alone(redis_url, tmp_path, capsys):
    """A misconfigured worker (no KILN_SIGNING_KEY) compiles for itself and never replaces
    or deletes the fleet's signed entries."""
    from kiln import _cli

    x = jnp.arange(3.0)
    with kiln.config_context(store=redis_url, signing_key="fleet", remote_mode="remote-only"):
        want = _run(x, _signed_only_f)
        remote = open_store(kiln.get_config(), layered=False)
        (key,) = [k for k in remote.iter()
                  if ((remote.header(k) or {}).get("function") or "").endswith("_signed_only_f")]
        signed = remote.get(key)
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, remote_mode="remote-only"):
        with pytest.warns(kiln.StoreWarning) as rec:
            np.testing.assert_array_equal(_run(x, _signed_only_f), want)
        texts = [str(w.message) for w in rec]
        assert any("is not loaded (entry is signed but no signing_key" in t
                   and "leaving the entry as it is" in t for t in texts), texts
        assert kiln.stats().compiles == 1 and remote.get(key) == signed
        # kiln verify --delete-bad without the key: reported as unverified, never deleted
        assert _cli.main(["verify", "--delete-bad", "--store", redis_url]) == 1
        out = capsys.readouterr().out
        assert f"UNVERIFIED {key[:12]}" in out and "1 signed and not verified" in out
        assert remote.get(key) == signed
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, signing_key="fleet", remote_mode="remote-only"):
        np.testing.assert_array_equal(_run(x, _signed_only_f), want)
        assert kiln.stats().hits == 1 and kiln.stats().compiles == 0


def test_signed_remote_entries_tampered_or_foreign_are_never_loaded(redis_url, tmp_path):
    x = jnp.arange(3.0)
    with kiln.config_context(store=redis_url, signing_key="old", remote_mode="remote-only"):
        want = _run(x)
        remote = open_store(kiln.get_config(), layered=False)
        (key,) = remote.iter()
        good = remote.get(key)
    # key rotation: the old key still reads, with the new one writing
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, signing_key="new", signing_keys_old="old",
                             remote_mode="remote-only"):
        np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().hits == 1 and kiln.stats().compiles == 0
    # another key only: never decoded; recompiled and replaced (signed with the new key)
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, signing_key="new", remote_mode="remote-only"):
        with pytest.warns(kiln.StoreWarning, match="unusable"):
            np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().bad_entries == 1 and kiln.stats().compiles == 1
        assert remote.get(key) != good
        kiln.reset_stats()
        np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().hits == 1
    # a changed byte: refused, replaced
    blob = remote.get(key)
    tampered = blob[:-40] + bytes([blob[-40] ^ 1]) + blob[-39:]
    remote.replace(key, tampered)
    kiln.reset_stats()
    with kiln.config_context(store=redis_url, signing_key="new", remote_mode="remote-only"):
        with pytest.warns(kiln.StoreWarning, match="digest mismatch"):
            np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().compiles == 1 and remote.get(key) != tampered
        kiln.reset_stats()
        np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().hits == 1 and kiln.stats().bad_entries == 0


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_full_or_read_only_redis_warns_once_and_results_stay_right(servers, how, tmp_path):
    import redis

    url, proc = servers.start_redis(tmp_path / "redis")
    try:
        client = redis.Redis.from_url(url)
        if how == "full":  # full before kiln's first write (the lease), whatever the
            client.set("filler", b"x" * 2_000_000)  # server's own baseline memory
            client.config_set("maxmemory", "1mb")
            client.config_set("maxmemory-policy", "noeviction")
        else:  # a replica of a primary that is gone: it answers reads, refuses writes
            client.replicaof("127.0.0.1", servers.free_port())
        client.close()
        x = jnp.linspace(0.0, 1.0, 300_000)  # an entry larger than 1 MB of Redis memory
        with kiln.config_context(store=url + "/0", signing_key="k", cache_dir=tmp_path / "c"):
            with pytest.warns(kiln.StoreWarning, match="reading it only from now on") as rec:
                np.testing.assert_array_equal(_run(x), _f(x))
            assert len(rec) == 1 and kiln.stats().remote_errors == 1
            assert open_store(kiln.get_config()).dead is None  # still read
            kiln.reset_stats()
            np.testing.assert_array_equal(_run(x), _f(x))  # now from the local store
            assert kiln.stats().hits == 1 and kiln.stats().remote_errors == 0
    finally:
        servers.stop(proc)


def test_a_rate_limited_object_store_warns_once(tmp_path, monkeypatch):
    """An S3 endpoint that answers every request with 503 SlowDown (a real HTTP server)."""
    import http.server
    import threading

    class SlowDown(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>")
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowDown)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("FSSPEC_S3_KEY", "k")
        monkeypatch.setenv("FSSPEC_S3_SECRET", "s")
        x = jnp.arange(3.0)
        with kiln.config_context(store="s3://bucket/kiln", signing_key="k", cache_dir=tmp_path,
                                 remote_timeout=5):
            with pytest.warns(kiln.StoreWarning, match="skipping it for the rest") as rec:
                np.testing.assert_array_equal(_run(x), _f(x))
            assert len(rec) == 1 and kiln.stats().remote_errors == 1
            assert kiln.stats().compiles == 1 and len(list(LocalStore(tmp_path).iter())) == 1
    finally:
        server.shutdown()
        server.server_close()


# -- the CLI on a remote store -----------------------------------------------------------------
def _cli(argv, capsys):
    from kiln import _cli

    code = _cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("remote", ["redis", "s3"])
def test_cli_verbs_work_on_a_remote_store(
    servers, remote, request, tmp_path, capsys, monkeypatch
):
    import json

    url = request.getfixturevalue("redis_url" if remote == "redis" else "s3_url")
    monkeypatch.setenv("KILN_SIGNING_KEY", "k")
    # the first contact of a server on a busy test machine can take more than the production
    # 0.8 s (moto_server's first request): a skipped store here is a flaky test, not a finding
    monkeypatch.setenv("KILN_REMOTE_TIMEOUT", "30")
    with kiln.config_context(store=url, signing_key="k", remote_mode="remote-only",
                             remote_timeout=30.0):
        _run(jnp.arange(3.0))
        kiln.jit(lambda x: x * 3)(jnp.arange(2.0))
        remote_store = open_store(kiln.get_config(), layered=False)
    keys = sorted(remote_store.iter())
    assert len(keys) == 2
    code, out, _ = _cli(["ls", "--json", "--store", url], capsys)
    assert code == 0 and sorted(r["key"] for r in json.loads(out)) == keys
    remote_store.add_counts({"remote_hits": 3, "compiles": 1})
    remote_store.add_counts({"remote_hits": 2})
    code, out, _ = _cli(["stats", "--json", "--store", url], capsys)
    summary = json.loads(out)
    assert code == 0 and summary["entries"] == 2
    assert summary["counters"] == {"compiles": 1, "remote_hits": 5}
    code, out, _ = _cli(["stats", "--store", url], capsys)
    assert "compiles: 1, remote hits: 5" in out
    # a tampered entry: verify finds it, --delete-bad removes it from the remote store
    blob = remote_store.get(keys[0])
    remote_store.replace(keys[0], blob[:-1] + bytes([blob[-1] ^ 1]))
    code, out, _ = _cli(["verify", "--store", url], capsys)
    assert code == 1 and f"BAD {keys[0][:12]}" in out and "2 entries: 1 ok, 1 bad" in out
    code, out, _ = _cli(["verify", "--delete-bad", "--store", url], capsys)
    assert code == 1 and sorted(remote_store.iter()) == keys[1:]
    code, out, _ = _cli(["prune", "--max-size", "0", "--store", url], capsys)
    assert code == 0 and "removed 1 entry" in out and list(remote_store.iter()) == []
    # a store that is down: an error naming it, exit 1, no traceback
    code, _, err = _cli(["ls", "--store", f"redis://127.0.0.1:{servers.free_port()}/0"], capsys)
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err


def test_verify_lists_and_removes_junk_keys_in_redis(redis_url, capsys, monkeypatch):
    """A key under kiln's prefix that is no entry (``kiln:v4:entry:NOTHEX``, a key of an
    unknown kind) is listed by ``kiln verify`` (exit 1) and removed by ``--delete-bad``; the
    counters and entries are left alone."""
    import redis

    from kiln._base import FORMAT_VERSION

    monkeypatch.setenv("KILN_SIGNING_KEY", "k")
    with kiln.config_context(store=redis_url, signing_key="k", remote_mode="remote-only"):
        _run(jnp.arange(3.0))
    prefix = f"kiln:v{FORMAT_VERSION}:"
    client = redis.Redis.from_url(redis_url)
    client.set(f"{prefix}entry:NOTHEX", b"junk")
    client.set(f"{prefix}whatever", b"junk")
    client.hset(f"{prefix}counters", "hits", 1)
    try:
        code, out, _ = _cli(["verify", "--store", redis_url], capsys)
        assert code == 1
        assert f"BAD {prefix}entry:NOTHEX" in out and f"BAD {prefix}whatever" in out
        code, out, _ = _cli(["verify", "--delete-bad", "--store", redis_url], capsys)
        assert code == 1  # (what it found; removed now)
        assert client.get(f"{prefix}entry:NOTHEX") is None and client.get(f"{prefix}whatever") is None
        assert client.hget(f"{prefix}counters", "hits") == b"1"
        code, out, _ = _cli(["verify", "--store", redis_url], capsys)
        assert code == 0 and "1 entry: 1 ok, 0 bad" in out
    finally:
        client.close()


def test_a_bucket_that_does_not_exist_is_an_error_not_an_empty_store(s3_url, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("KILN_SIGNING_KEY", "k")
    bucket = "kiln-no-such-bucket"
    code, out, err = _cli(["ls", "--store", f"s3://{bucket}/p"], capsys)
    assert code == 1 and out == ""
    assert f"bucket {bucket!r} does not exist" in err and "no entries" not in err
    code, out, err = _cli(["ls", "--store", s3_url], capsys)  # the bucket exists: empty
    assert code == 0 and "no entries" in err


def test_the_jax_cache_route_logs_shared_store_problems_never_warns(servers, tmp_path, caplog):
    """Inside JAX's cache a warning made an error by the user's filters would fail the call:
    the route logs (an unsigned shared store; a store that is down) instead."""
    import logging
    import warnings

    import jax

    url = f"redis://127.0.0.1:{servers.free_port()}/0"
    with kiln.config_context(store=url, cache_dir=tmp_path, remote_timeout=0.5):
        assert kiln.enable_jax_cache()
        try:
            with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="kiln"):
                warnings.simplefilter("error")
                y = jax.jit(lambda x: x * 7.0 + 1.0)(np.arange(3.0, dtype=np.float32))
        finally:
            kiln.disable_jax_cache()
    np.testing.assert_array_equal(y, np.arange(3.0) * 7.0 + 1.0)
    assert "KILN_SIGNING_KEY is not set" in caplog.text
    assert "skipping it for the rest of this process" in caplog.text
    assert kiln.stats().remote_errors == 1 and kiln.stats().jax_cache_writes >= 1


@pytest.mark.parametrize("url, problem", [
    ("redis://", "names no host"),
    ("redis://127.0.0.1:99999/0", "port must be a number"),
    ("redis://h:notaport/0", "port must be a number"),
    ("redis://h:6379/x", "database must be a number"),
    ("s3://", "names no bucket"),
    ("redis://user:hunter2@h:99999/0", "redis://user:\\*\\*\\*@h"),
])
def test_a_bad_store_url_is_a_config_error_naming_the_variable(url, problem, monkeypatch):
    monkeypatch.setenv("KILN_STORE", url)
    with pytest.raises(kiln.ConfigError, match=f"KILN_STORE=.*{problem}") as e:
        kiln.get_config()
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("var, value", [("KILN_LEASE_SECONDS", "1e300"),
                                        ("KILN_REMOTE_TIMEOUT", "1e12"),
                                        ("KILN_LEASE_WAIT", "-3")])
def test_lease_and_timeout_settings_are_bounded(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(kiln.ConfigError, match=f"{var} must be a number of seconds above 0"):
        kiln.get_config()


def test_old_signing_keys_need_a_current_one(monkeypatch):
    monkeypatch.setenv("KILN_SIGNING_KEYS_OLD", "k1")
    with pytest.raises(kiln.ConfigError, match="set KILN_SIGNING_KEY"):
        kiln.get_config()


def test_a_bad_setting_never_escapes_into_jax_s_cache(monkeypatch, caplog):
    """The kiln:// route with a bad KILN_STORE: plain jax.jit still works under -W error."""
    import logging

    import jax

    assert kiln.enable_jax_cache()
    try:
        monkeypatch.setenv("KILN_STORE", "redis://127.0.0.1:99999/0")
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="kiln"):
            warnings.simplefilter("error")
            y = jax.jit(lambda x: x * 5.0 - 1.0)(np.arange(4.0, dtype=np.float32))
    finally:
        kiln.disable_jax_cache()
    np.testing.assert_array_equal(y, np.arange(4.0) * 5.0 - 1.0)
    assert "JAX cache route cannot read" in caplog.text and "KILN_STORE" in caplog.text


def test_a_redis_key_of_another_type_is_one_bad_entry_replaced(redis_url, tmp_path):
    import redis

    x = jnp.arange(3.0)
    with kiln.config_context(store=redis_url, signing_key="k", remote_mode="remote-only"):
        want = _run(x)
        remote = open_store(kiln.get_config(), layered=False)
        (key,) = remote.iter()
        client = redis.Redis.from_url(redis_url)
        name = f"kiln:v{FORMAT_VERSION}:entry:{key}"
        client.delete(name)
        client.hset(name, "not", "an entry")  # a hash where an entry goes
        kiln.reset_stats()
        with pytest.warns(kiln.StoreWarning, match="unusable"):
            np.testing.assert_array_equal(_run(x), want)
        s = kiln.stats()
        assert s.bad_entries == 1 and s.compiles == 1 and s.remote_errors == 0
        assert client.type(name) == b"string"  # replaced
        client.close()
        kiln.reset_stats()
        np.testing.assert_array_equal(_run(x), want)
        assert kiln.stats().hits == 1


def test_an_empty_object_in_a_bucket_is_listed_not_fatal(s3_url, tmp_path, capsys, monkeypatch):
    import json

    from kiln import _cli

    monkeypatch.setenv("KILN_SIGNING_KEY", "k")
    with kiln.config_context(store=s3_url, signing_key="k", remote_mode="remote-only"):
        _run(jnp.arange(3.0))
        remote = open_store(kiln.get_config(), layered=False)
        (key,) = remote.iter()
        remote.replace(key, b"")
    assert _cli.main(["ls", "--json", "--store", s3_url]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in rows] == [key]
    assert _cli.main(["stats", "--store", s3_url]) == 0


# -- write-behind -------------------------------------------------------------------------------
def test_writes_are_write_behind_and_the_lease_waits_for_the_upload(redis_url, tmp_path):
    """A put returns once the entry is in the local store; the upload runs on a background
    thread, and the remote lease on the key is let go only when it has landed, so another host
    missing the key waits for the entry instead of compiling it."""
    import threading

    from kiln.stores import wait_for_uploads
    from kiln.stores._redis import RedisStore

    host_a = LayeredStore(LocalStore(tmp_path / "a"), RedisStore(redis_url))
    host_b = LayeredStore(LocalStore(tmp_path / "b"), RedisStore(redis_url))
    key = "cd" * 32
    landed, go = threading.Event(), threading.Event()
    put = host_a.remote.put

    def slow_put(k, data):
        go.wait(60)  # an upload that takes as long as the test wants
        put(k, data)
        landed.set()

    host_a.remote.put = slow_put
    lease_a = host_a.lease(key, 30)
    assert lease_a.acquire()
    host_a.put(key, b"entry bytes")  # returns with the upload still pending
    assert host_a.local.get(key) == b"entry bytes" and host_b.get(key) is None
    lease_a.release()  # the compile is done; the lease stays until the upload lands
    lease_b = host_b.lease(key, 30)
    assert not lease_b.acquire()  # host B waits for A's entry, it does not compile
    assert host_a.wait_for_uploads(0.05) == 1
    go.set()
    assert wait_for_uploads(30) == 0 and landed.is_set()
    assert host_b.get(key) == b"entry bytes"
    assert lease_b.acquire()  # released after the upload
    lease_b.release()


EXIT_WITH_HUNG_UPLOAD = """
import threading
import kiln
from kiln.stores import open_store, _layered

_layered._EXIT_WAIT = 0.5  # (10 s by default)
store = open_store(kiln.get_config())
store.remote.put = lambda key, data: threading.Event().wait()  # an upload that never lands
store.put("ef" * 32, b"entry")
print("PUT-RETURNED", flush=True)
"""


def test_exit_waits_for_uploads_only_up_to_a_bound_then_warns(redis_url, tmp_path):
    env = child_env(KILN_STORE=redis_url, KILN_SIGNING_KEY="k",
                    KILN_CACHE_DIR=str(tmp_path / "s"))
    proc = run_child([sys.executable, "-c", EXIT_WITH_HUNG_UPLOAD], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "PUT-RETURNED" in proc.stdout
    assert "StoreWarning: kiln: 1 entry not uploaded to redis://" in proc.stderr
    assert "they stay in the local store" in proc.stderr
    assert LocalStore(tmp_path / "s").get("ef" * 32) == b"entry"


def test_a_write_to_a_dead_remote_only_store_is_not_counted_as_written(servers, tmp_path):
    url = f"redis://127.0.0.1:{servers.free_port()}/0"  # nothing listens there
    x = jnp.arange(3.0)
    with kiln.config_context(store=url, signing_key="k", remote_mode="remote-only"):
        with pytest.warns(kiln.StoreWarning, match="skipping it"):
            np.testing.assert_array_equal(_run(x), _f(x))
        s = kiln.stats()
        assert s.compiles == 1 and s.stores_written == 0 and s.remote_errors == 1
