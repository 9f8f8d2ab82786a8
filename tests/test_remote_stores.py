"""The remote stores (Redis, fsspec) against real servers: ``redis-server`` and ``moto_server``
(S3) started as processes by ``tests/servers.py``, and ``memory://`` (no server).

Every behaviour test runs on all three backends; faults use a closed port and a port that accepts
connections and never answers (``hung_server``), counting the connections a store makes (one:
no retries). Leases that run out are waited for by polling ``acquire()`` under a deadline (Redis
expires them in the server); the fsspec lease's staleness rule is also checked with an injected
clock.
"""

from __future__ import annotations

import errno
import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kiln._base import FORMAT_VERSION, encode
from kiln._base._errors import StoreError
from kiln.stores import _fsspec
from kiln.stores._base import EntryStat, Leasable, Lease, Store
from kiln.stores._fsspec import FsspecStore
from kiln.stores._redis import RedisStore

BACKENDS = ["redis", "s3", "memory"]
V = FORMAT_VERSION


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def entry(name: str, payload: bytes = b"x" * 100, **header: Any) -> bytes:
    """A real entry blob (unsigned) with ``header`` (plus ``created``) and one section."""
    return encode({"name": name, "created": 1234.5, **header}, {"x": payload}, signing_key=None)


def assert_total(store: Any, blob_bytes: int, count: int) -> None:
    """``store.total_size()`` is ``blob_bytes`` (Redis: plus its own bytes per key, which
    MEMORY USAGE counts)."""
    total = store.total_size()
    if isinstance(store, RedisStore):
        assert blob_bytes <= total <= blob_bytes + 200 * count, (total, blob_bytes)
    else:
        assert total == blob_bytes


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture
def location(request: pytest.FixtureRequest) -> str:
    """The URL of an empty store of the backend named by ``request.param``."""
    kind = request.param
    if kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    if kind == "s3":
        return str(request.getfixturevalue("s3_url"))
    url = f"memory://kiln-test-{uuid.uuid4().hex}"
    request.addfinalizer(lambda: _clear_memory(url))
    return url


def _clear_memory(url: str) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture
def opener(location: str) -> Iterator[Callable[..., Any]]:
    """``opener(**options)``: a new store instance on ``location`` (closed after the test)."""
    opened: list[Any] = []

    def open_store(**options: Any) -> Any:
        store = (RedisStore(location, **options) if location.startswith("redis")
                 else FsspecStore(location, **options))
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def store(opener: Callable[..., Any]) -> Any:
    return opener()


backends = pytest.mark.parametrize("location", BACKENDS, indirect=True)


def _raw_redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


# -- the protocol ------------------------------------------------------------------------------
@backends
def test_round_trip(store: Any) -> None:
    assert isinstance(store, Store) and isinstance(store, Leasable)
    k, blob = key("a"), entry("a")
    assert store.get(k) is None and store.peek(k) is None
    assert store.stat(k) is None and store.header(k) is None
    store.put(k, blob)
    assert store.get(k) == blob
    assert store.peek(k) == blob
    assert "***" not in store.url and repr(store).endswith(f"({store.url!r})")


@backends
def test_put_is_create_only_and_replace_overwrites(store: Any, opener: Callable[..., Any]
                                                   ) -> None:
    k = key("a")
    store.put(k, b"first")
    store.put(k, b"second")  # a no-op: entries are content-addressed
    other = opener()
    other.put(k, b"third")  # another process, too
    assert store.get(k) == b"first" and other.get(k) == b"first"
    store.replace(k, b"fixed")
    assert store.get(k) == b"fixed" and other.get(k) == b"fixed"
    other.replace(key("new"), b"made")  # replace also creates
    assert store.get(key("new")) == b"made"


@backends
def test_delete(store: Any) -> None:
    k = key("a")
    assert store.delete(k) is False
    store.put(k, b"blob")
    store.get(k)  # a used marker too (fsspec): deleted with the entry
    assert store.delete(k) is True
    assert store.get(k) is None and store.stat(k) is None
    assert store.delete(k) is False
    assert list(store.iter()) == []


@backends
def test_iter_lists_exactly_the_keys(store: Any, location: str) -> None:
    keys = {key(str(i)) for i in range(5)}
    for k in keys:
        store.put(k, b"blob " + k.encode())
    # what is not an entry of this format: another format version, other names, other keys
    if location.startswith("redis"):
        raw = _raw_redis(location)
        try:
            raw.set(f"kiln:v{V + 1}:entry:{key('old')}", b"blob")
            raw.set(f"kiln:v{V}:entry:NOT-A-KEY", b"blob")
            raw.set(f"kiln:v{V}:lease:{key('leased')}", b"token")
            raw.set("someone-else", b"blob")
        finally:
            raw.close()
    else:
        fs, base = store._fs, store._base
        fs.pipe_file(base.replace(f"/v{V}", f"/v{V + 1}") + f"/entries/ab/{key('old')}.kiln", b"b")
        fs.pipe_file(f"{base}/entries/zz/not-a-key.kiln", b"blob")
        fs.pipe_file(f"{base}/entries/{key('x')[:2]}/{key('x')}.tmp", b"blob")
        fs.pipe_file(f"{base}/entries/00/{key('misplaced')}.kiln", b"blob")
        fs.pipe_file(f"{base}/used/{key('only-used')}", b"")
    assert list(store.iter()) == sorted(keys)
    assert_total(store, sum(len(b"blob " + k.encode()) for k in keys), len(keys))


@backends
def test_layout_carries_the_format_version(store: Any, location: str) -> None:
    k = key("a")
    store.put(k, b"blob")
    if location.startswith("redis"):
        raw = _raw_redis(location)
        try:
            assert raw.keys("*") == [f"kiln:v{V}:entry:{k}".encode()]
        finally:
            raw.close()
    else:
        assert store._fs.cat_file(f"{store._base}/entries/{k[:2]}/{k}.kiln") == b"blob"
        assert store._base.endswith(f"/v{V}")


@backends
def test_stat(store: Any, location: str) -> None:
    k, blob = key("a"), entry("a", b"y" * 5000)
    before = time.time()
    store.put(k, blob)
    st = store.stat(k)
    assert isinstance(st, EntryStat)
    assert st.key == k and st.size == len(blob)
    if location.startswith("redis"):
        assert st.created == 1234.5  # the header's
    else:
        assert abs(st.created - before) < 120  # the object's modification time (server clock)
    assert st.last_used >= st.created
    store.put(key("raw"), b"not an entry")
    st = store.stat(key("raw"))
    assert st is not None and st.size == len(b"not an entry")


@backends
def test_header_reads_only_the_start(store: Any, location: str, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    k = key("big")
    store.put(k, entry("big", b"z" * (1 << 20)))  # 1 MiB payload
    store.put(key("long"), entry("long", b"", note="n" * 100_000))  # a header over 64 KiB
    store.put(key("junk"), b"not an entry at all")
    reads: list[Any] = []
    if location.startswith("redis"):
        real = store._untouched

        def untouched(*commands: tuple[Any, ...]) -> list[Any]:
            for command in commands:
                assert command[0] == "GETRANGE", command  # never GET: the whole blob
                reads.append(command[-1])
            return real(*commands)

        monkeypatch.setattr(store._redis, "get", lambda *a: pytest.fail("read the whole blob"))
        monkeypatch.setattr(store, "_untouched", untouched)
    else:
        real = store._fs.cat_file
        monkeypatch.setattr(store._fs, "cat_file",
                            lambda path, start=None, end=None, **kw:
                            reads.append(end) or real(path, start=start, end=end, **kw))
    header = store.header(k)
    assert header is not None and header["name"] == "big"
    assert header["sections"] and reads and all(end is not None and end < 70_000 for end in reads)
    monkeypatch.undo()
    long = store.header(key("long"))
    assert long is not None and long["note"] == "n" * 100_000  # the whole blob, then
    assert store.header(key("junk")) is None
    assert store.header(key("missing")) is None


# -- size management ---------------------------------------------------------------------------
@backends
def test_prune_brings_the_total_under_the_limit(store: Any) -> None:
    keys = [key(str(i)) for i in range(4)]
    for k in keys:
        store.put(k, bytes(1000))
    assert_total(store, 4000, 4)
    assert store.prune(5000) == []
    would = store.prune(2500, dry_run=True)
    assert len(would) == 2 and set(would) <= set(keys)
    assert_total(store, 4000, 4)  # dry run: nothing evicted
    evicted = store.prune(2500)
    assert len(evicted) == 2
    assert_total(store, 2000, 2)
    assert sorted(store.iter()) == sorted(set(keys) - set(evicted))
    assert all(store.get(k) is None for k in evicted)


@pytest.mark.parametrize("location", ["redis"], indirect=True)
def test_redis_prune_evicts_least_recently_used_first(store: Any, location: str) -> None:
    """Idle times are set with RESTORE ... IDLETIME (Redis's LRU clock counts whole seconds, so
    no test could wait for it). Prune reads them without touching any entry."""
    keys = [key(str(i)) for i in range(4)]
    for k in keys:
        store.put(k, bytes(1000))
    raw = _raw_redis(location)
    try:
        for k, idle in zip(keys, [100, 400, 300, 200], strict=True):
            name = f"kiln:v{V}:entry:{k}"
            raw.execute_command("RESTORE", name, 0, raw.dump(name), "REPLACE", "IDLETIME", idle)
        assert store.prune(2500, dry_run=True) == [keys[1], keys[2]]
        assert store.prune(2500, dry_run=True) == [keys[1], keys[2]]  # the dry run touched none
        assert store.get(keys[1]) is not None  # now the most recently used
        assert store.prune(2500) == [keys[2], keys[3]]
        assert sorted(store.iter()) == sorted([keys[0], keys[1]])
        st = store.stat(keys[0])
        assert st is not None and time.time() - st.last_used >= 99
    finally:
        raw.close()


@pytest.mark.parametrize("location", ["memory"], indirect=True)
def test_fsspec_prune_evicts_least_recently_used_first(store: Any) -> None:
    """``memory://`` keeps times in microseconds: each write is later than the one before."""
    keys = [key(str(i)) for i in range(4)]
    for k in keys:
        store.put(k, bytes(1000))
    assert store.get(keys[0]) is not None  # its used marker: now the most recently used
    st = store.stat(keys[0])
    assert st is not None and st.last_used > st.created
    assert store.prune(2500, dry_run=True) == [keys[1], keys[2]]
    assert store.prune(2500) == [keys[1], keys[2]]
    assert sorted(store.iter()) == sorted([keys[0], keys[3]])


@pytest.mark.parametrize("location", ["redis"], indirect=True)
def test_redis_under_an_lfu_policy(store: Any, location: str) -> None:
    """Under allkeys-lfu Redis keeps no idle time: stat and prune still work (all entries count
    as equally old)."""
    raw = _raw_redis(location)
    old = raw.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        raw.config_set("maxmemory-policy", "allkeys-lfu")
        for i in range(3):
            store.put(key(str(i)), entry(str(i)))
        st = store.stat(key("0"))
        assert st is not None and st.last_used == st.created == 1234.5
        assert len(store.prune(0)) == 3 and list(store.iter()) == []
    finally:
        raw.config_set("maxmemory-policy", old)
        raw.close()


# -- leases ------------------------------------------------------------------------------------
@backends
def test_lease_is_exclusive_until_released(opener: Callable[..., Any]) -> None:
    k = key("compile me")
    a, b = opener().lease(k, 30.0), opener().lease(k, 30.0)
    assert isinstance(a, Lease)
    assert a.acquire() is True
    assert a.acquire() is True  # already ours
    assert b.acquire() is False
    assert a.renew() is True
    assert b.acquire() is False
    a.release()
    assert a.renew() is False  # released: nothing to renew
    assert b.acquire() is True
    assert a.acquire() is False
    b.release()
    b.release()  # twice: harmless
    other = opener().lease(key("another key"), 30.0)
    assert other.acquire() is True  # leases of different keys are independent
    other.release()


@backends
def test_a_lease_that_runs_out_is_taken_over(opener: Callable[..., Any], location: str) -> None:
    """The holder stops renewing (it died): after ``seconds`` another process takes over, and
    the old holder learns it lost the lease. Polls ``acquire()`` under a deadline."""
    k = key("compile me")
    a = opener().lease(k, 0.3)
    # Redis expires a lease after its holder's seconds; an object store's lease is judged stale
    # after the observer's seconds. Either way b takes over after 0.3 s, then holds it for long.
    b = opener().lease(k, 30.0 if location.startswith("redis") else 0.3)
    assert a.acquire() is True
    assert b.acquire() is False
    deadline = time.monotonic() + 15.0
    while not b.acquire():
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.05)
    assert a.renew() is False  # taken over
    a.release()  # must not release b's lease
    assert opener().lease(k, 0.3).acquire() is False
    assert b.renew() is True
    b.release()
    assert opener().lease(k, 0.3).acquire() is True


@pytest.mark.parametrize("location", ["memory", "s3"], indirect=True)
def test_fsspec_lease_staleness_is_judged_by_the_local_clock(
        opener: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewing holder keeps its lease however long it holds it; a silent one is taken over
    ``seconds`` after this process first saw its lease unchanged (never by comparing clocks)."""
    now = [1000.0]
    monkeypatch.setattr(_fsspec, "_monotonic", lambda: now[0])
    k = key("compile me")
    a, b = opener().lease(k, 10.0), opener().lease(k, 10.0)
    assert a.acquire() is True
    for _ in range(5):  # 50 s of renewing every 9 s
        assert b.acquire() is False
        now[0] += 9.0
        assert a.renew() is True
    assert b.acquire() is False  # sees the latest renewal: its 10 s start now
    now[0] += 9.9
    assert b.acquire() is False
    now[0] += 0.2
    assert b.acquire() is True
    assert a.renew() is False
    assert json.loads(opener()._fs.cat_file(b._path))["token"] == b._token


# -- faults ------------------------------------------------------------------------------------
def _remote_store(kind: str, host: str, port: int, **options: Any) -> Any:
    if kind == "redis":
        return RedisStore(f"redis://{host}:{port}/0", **options)
    return FsspecStore("s3://kiln-test/x", storage_options={
        "endpoint_url": f"http://{host}:{port}", "key": "k", "secret": "s"}, **options)


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_hung_server_costs_one_timeout(servers, kind: str) -> None:
    with servers.hung_server() as hung:
        store = _remote_store(kind, hung.host, hung.port, timeout=0.5, connect_timeout=0.5)
        try:
            with pytest.raises(TimeoutError) as info:
                store.get(key("a"))
            assert isinstance(info.value, OSError) and info.value.errno == errno.ETIMEDOUT
            assert hung.accepted == 1  # one attempt: no retries
            with pytest.raises(TimeoutError):  # S3: its Expect: 100-continue is never answered
                store.put(key("a"), b"blob")
            assert hung.accepted == 2
        finally:
            store.close()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_closed_port_raises_oserror(servers, kind: str) -> None:
    store = _remote_store(kind, "127.0.0.1", servers.free_port(), timeout=0.5)
    try:
        for call in (lambda: store.get(key("a")), lambda: store.put(key("a"), b"blob"),
                     lambda: list(store.iter()), lambda: store.lease(key("a"), 1.0).acquire()):
            with pytest.raises(OSError) as info:
                call()
            assert not isinstance(info.value, TimeoutError)
    finally:
        store.close()


def test_redis_password_never_shown(redis_server: Any) -> None:
    host_port = redis_server.url.split("//", 1)[1]
    store = RedisStore(f"redis://me:hunter2-kiln@{host_port}/0?password=hunter2-kiln")
    try:
        assert "hunter2" not in store.url and "hunter2" not in repr(store)
        with pytest.raises(OSError) as info:  # the server has no such user
            store.get(key("a"))
        assert "hunter2" not in str(info.value)
    finally:
        store.close()


@pytest.mark.parametrize("location", ["redis"], indirect=True)
def test_redis_out_of_memory_is_an_oserror(store: Any, location: str) -> None:
    raw = _raw_redis(location)
    old = raw.config_get("maxmemory*")
    try:
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", "1mb")
        with pytest.raises(OSError) as info:
            store.put(key("big"), bytes(4 << 20))
        assert info.value.errno == errno.ENOSPC
    finally:
        raw.config_set("maxmemory", old["maxmemory"])
        raw.config_set("maxmemory-policy", old["maxmemory-policy"])
        raw.close()


def test_s3_missing_bucket_is_an_error_not_a_miss(s3_server: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    store = FsspecStore("s3://no-such-bucket/x", timeout=5.0)
    try:
        with pytest.raises(OSError):
            store.get(key("a"))
        with pytest.raises(OSError):
            store.put(key("a"), b"blob")
        assert not store._fs.exists("no-such-bucket")  # kiln never makes a bucket
    finally:
        store.close()


@pytest.mark.parametrize("location", ["memory"], indirect=True)
def test_any_file_system_failure_is_an_oserror(store: Any, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    class SlowDown(Exception):  # what botocore's ClientError would be, untranslated
        pass

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SlowDown("Please reduce your request rate.")

    monkeypatch.setattr(store._fs, "cat_file", fail)
    with pytest.raises(OSError, match="SlowDown"):
        store.get(key("a"))
    monkeypatch.setattr(store._fs, "pipe_file", fail)
    with pytest.raises(OSError):
        store.put(key("a"), b"blob")


@pytest.mark.parametrize("location", ["memory"], indirect=True)
def test_a_failed_used_marker_does_not_fail_a_read(store: Any, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    store.put(key("a"), b"blob")
    real = store._fs.pipe_file

    def pipe_file(path: str, *args: Any, **kwargs: Any) -> Any:
        if "/used/" in path:
            raise PermissionError(errno.EACCES, "read-only bucket")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store._fs, "pipe_file", pipe_file)
    assert store.get(key("a")) == b"blob"


def test_missing_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(StoreError, match=r"pip install 'jax-kiln\[redis\]'"):
        RedisStore("redis://localhost/0")
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(StoreError, match=r"pip install 'jax-kiln\[s3\]'"):
        FsspecStore("s3://bucket/x")


def test_bad_urls_and_keys() -> None:
    with pytest.raises(StoreError, match="not a Redis URL"):
        RedisStore("http://localhost/0")
    with pytest.raises(StoreError, match="no protocol"):
        FsspecStore("nosuchprotocol://x")
    store = FsspecStore("memory://kiln-test-keys")
    with pytest.raises(ValueError, match="lowercase hex"):
        store.get("../../etc/passwd")
    with pytest.raises(ValueError, match="positive"):
        store.lease(key("a"), 0)
