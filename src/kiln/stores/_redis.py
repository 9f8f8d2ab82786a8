"""A store in Redis (``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path?db=N``).

Layout (``N`` is :data:`kiln._base._entry.FORMAT_VERSION`, so kilns that read different formats
never meet)::

    kiln:vN:entry:<key>    string: the entry blob (see kiln._base._entry for its bytes)
    kiln:vN:lease:<key>    string: the token of the process compiling <key> (with an expiry)
    kiln:vN:counters       hash: counters processes recorded at exit (``add_counts``)

Writes are single ``SET`` commands, atomic to readers. :meth:`RedisStore.put` is create-only
(``SET NX``): entries are content-addressed, so an existing entry is the same entry and a lost
race costs nothing. :meth:`RedisStore.replace` overwrites; kiln calls it only after the entry
there failed verification.

Size and last use: the recommended setup gives Redis a memory limit and lets it evict by itself
(``maxmemory 4gb`` and ``maxmemory-policy allkeys-lru`` in ``redis.conf``). Redis's own LRU clock
is the record of last use: ``GET`` touches it; :meth:`RedisStore.peek`, ``stat`` and ``header``
read under ``CLIENT NO-TOUCH`` so that listings do not (Redis 7.2 and later; older servers
refuse that command and count those reads as uses too). :meth:`RedisStore.total_size` and
:meth:`RedisStore.prune` never touch an entry (``MEMORY USAGE``, ``OBJECT IDLETIME``); prune
does from the client what ``allkeys-lru`` does in the server, for a server without that policy.

What is trusted: whoever can write to the Redis database can run code in every process that
loads entries from it (an entry holds native code): use a private instance, or set
``KILN_SIGNING_KEY`` (then only entries signed with it are decoded).

Faults: every failure of redis-py (down, refused, hung, ``OOM`` past ``maxmemory`` without an
eviction policy, ``READONLY`` replica, authentication) reaches the caller as ``OSError``;
timeouts as the builtin :class:`TimeoutError` (a subclass of ``OSError``). Retries are off: a
hung server costs one ``timeout``, not one per retry. Messages and :attr:`RedisStore.url` never
contain the password.
"""

from __future__ import annotations

import contextlib
import errno
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from .._base import FORMAT_VERSION, EntryError, StoreError, is_key, peek_header
from ._backend import HEADER_READ, check_key, check_lease, header_of, redact_url, to_evict
from ._base import EntryStat

__all__ = ["RedisStore"]

_BATCH = 500  # keys per pipelined round trip in listings


class RedisStray(str):
    """A Redis key under the store's prefix that is not an entry, the counters or a lease
    (``kiln:v4:entry:NOTHEX``): listed and removed by ``kiln verify``."""

    def is_dir(self) -> bool:
        return False


def _wrong_type(e: BaseException) -> bool:
    """Redis's reply to a string command on a key of another type (a hash, a list, ...)."""
    return str(e).startswith("WRONGTYPE")


class RedisStore:
    """Entries in a Redis database; see the module docstring for the layout and faults.

    Recommended server setup: ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``, so
    that Redis evicts least recently used entries by itself. :meth:`prune` is for servers
    without it. Under an LFU policy (``allkeys-lfu``) Redis keeps no idle time (``OBJECT
    IDLETIME`` fails): :meth:`prune` then treats all entries as equally old, and
    :meth:`stat` reports ``last_used`` as ``created``.

    Args:
        url: ``redis://[user[:password]@]host[:port][/db]``, ``rediss://...`` (TLS) or
            ``unix:///path/to/socket?db=N``.
        timeout: seconds one command may wait for the server's answer.
        connect_timeout: seconds a connection may take to open.

    Raises:
        StoreError: redis-py is not installed, or ``url`` is not a Redis URL.

    Example:
        >>> from kiln.stores._redis import RedisStore
        >>> store = RedisStore("redis://localhost:6379/0", timeout=2.0)  # doctest: +SKIP
        >>> store.put("ab" * 32, b"blob"); store.get("ab" * 32)  # doctest: +SKIP
        b'blob'
        >>> store.close()  # doctest: +SKIP
    """

    def __init__(self, url: str, *, timeout: float = 10.0, connect_timeout: float = 1.0) -> None:
        try:
            import redis
            import redis.backoff
            import redis.exceptions
            import redis.retry
        except ImportError:
            raise StoreError(
                f"kiln store {redact_url(url)!r} needs the redis package: "
                "pip install 'jax-kiln[redis]'"
            ) from None
        self.url = redact_url(url)
        self.timeout = timeout
        parts = urllib.parse.urlsplit(url)
        secrets = [parts.password or ""] + [v for k, v in urllib.parse.parse_qsl(parts.query)
                                            if k.lower() == "password"]
        # as written and as redis-py reads it (percent-decoded): never in a message
        self._secrets = sorted({t for s in secrets if s for t in (s, urllib.parse.unquote(s))},
                               key=len, reverse=True)
        self._exc: Any = redis.exceptions
        self._prefix = f"kiln:v{FORMAT_VERSION}:"
        try:
            # retries off (Retry(..., 0)): a hung server costs one timeout, not several
            self._redis: Any = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                retry_on_timeout=False, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            )
        except ValueError as e:
            raise StoreError(f"kiln store {self.url!r} is not a Redis URL ({self._clean(e)}); "
                             "use redis://host:port/db, rediss://... or unix:///path") from None

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    def close(self) -> None:
        """Close the connections (the store reconnects if it is used again)."""
        self._redis.close()

    # -- helpers -------------------------------------------------------------------------
    def _clean(self, e: BaseException) -> str:
        text = str(e)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """redis-py's exceptions as ``OSError`` (timeouts as :class:`TimeoutError`), named
        with what failed and the store's URL (never its password)."""
        exc = self._exc
        try:
            yield
        except exc.TimeoutError as e:
            raise TimeoutError(errno.ETIMEDOUT, f"{doing} redis store {self.url}: no answer in "
                               f"{self.timeout:g} s ({self._clean(e)})") from None
        except exc.AuthenticationError as e:  # (a ConnectionError in redis-py)
            raise PermissionError(errno.EACCES, f"{doing} redis store {self.url}: "
                                  f"{self._clean(e)}") from None
        except exc.ConnectionError as e:
            raise ConnectionError(errno.ECONNREFUSED, f"{doing} redis store {self.url}: "
                                  f"{self._clean(e)}") from None
        except exc.RedisError as e:
            code = (errno.ENOSPC if isinstance(e, exc.OutOfMemoryError) else
                    errno.EROFS if isinstance(e, exc.ReadOnlyError) else errno.EIO)
            raise OSError(code, f"{doing} redis store {self.url}: {type(e).__name__}: "
                          f"{self._clean(e)}") from None

    def _entry(self, key: str) -> str:
        return f"{self._prefix}entry:{check_key(key)}"

    def _scan(self) -> Iterator[tuple[str, bytes]]:
        """(key, Redis key) of every entry, in SCAN order (each one at least once)."""
        start = len(self._prefix) + len("entry:")
        for name in self._redis.scan_iter(match=f"{self._prefix}entry:*", count=_BATCH):
            key = name[start:].decode("ascii", "replace")
            if is_key(key):
                yield key, name

    def _untouched(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Replies to read ``commands`` sent in one round trip between ``CLIENT NO-TOUCH ON``
        and ``OFF``, so that they do not count as uses (Redis 7.2+; older servers reply to
        those two with an error, ignored here). A reply error comes back as its exception."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
        for args in commands:
            pipe.execute_command(*args)
        pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
        return list(pipe.execute(raise_on_error=False)[1:-1])

    def _memory_and_idle(self) -> list[tuple[str, int, float]]:
        """(key, bytes in Redis, idle seconds) of every entry, without touching any (``MEMORY
        USAGE`` and ``OBJECT IDLETIME`` leave the LRU clock alone); idle 0.0 for all when the
        server keeps no idle time (an LFU policy)."""
        rows: list[tuple[str, int, float]] = []
        found = list(self._scan())
        for batch in (found[i:i + _BATCH] for i in range(0, len(found), _BATCH)):
            pipe = self._redis.pipeline(transaction=False)
            for _, name in batch:
                pipe.execute_command("OBJECT", "IDLETIME", name)
                pipe.execute_command("MEMORY", "USAGE", name, "SAMPLES", "0")
            out = pipe.execute(raise_on_error=False)
            for (key, _), idle, size in zip(batch, out[0::2], out[1::2], strict=True):
                if isinstance(size, int):  # None: evicted or deleted meanwhile
                    rows.append((key, size, float(idle) if isinstance(idle, int) else 0.0))
        return rows

    # -- protocol ------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The blob under ``key``, or ``None``. ``GET`` also marks it used (Redis's LRU)."""
        name = self._entry(key)
        with self._errors("read from"):
            try:
                data = self._redis.get(name)
            except self._exc.ResponseError as e:
                if not _wrong_type(e):
                    raise
                return b""  # not a string: a bad entry of this key (kiln replaces it)
        return None if data is None else bytes(data)

    def peek(self, key: str) -> bytes | None:
        """Like :meth:`get`, without marking the entry used (on Redis 7.2 and later: see the
        module docstring)."""
        name = self._entry(key)
        with self._errors("read from"):
            (data,) = self._untouched(("GET", name))
            if isinstance(data, BaseException):
                if _wrong_type(data):
                    return b""  # not a string: a bad entry (kiln verify lists it)
                raise data
        return None if data is None else bytes(data)

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` unless an entry is there already (``SET NX``: entries
        are content-addressed, so the one there is the same entry)."""
        name = self._entry(key)
        with self._errors("write to"):
            self._redis.set(name, bytes(data), nx=True)

    def replace(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what is there. kiln calls this only after
        the entry there failed verification (corrupt, or signed with another key)."""
        name = self._entry(key)
        with self._errors("write to"):
            self._redis.set(name, bytes(data))

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add ``counts`` to the store's counters (``HINCRBY``, one round trip)."""
        with self._errors("write to"):
            pipe = self._redis.pipeline(transaction=False)
            for name, value in counts.items():
                pipe.hincrby(f"{self._prefix}counters", name, int(value))
            pipe.execute()

    def counts(self) -> dict[str, int]:
        """The counters added so far (see :meth:`add_counts`)."""
        with self._errors("read from"):
            raw = self._redis.hgetall(f"{self._prefix}counters")
        return {k.decode() if isinstance(k, bytes) else str(k): int(v) for k, v in raw.items()}

    def delete(self, key: str) -> bool:
        name = self._entry(key)
        with self._errors("delete from"):
            return bool(self._redis.delete(name))

    def strays(self) -> list[RedisStray]:
        """Keys under this store's prefix that are not entries (an entry name whose key is not
        lowercase hex), the counters or leases (``SCAN``)."""
        entry, lease = f"{self._prefix}entry:", f"{self._prefix}lease:"
        out = []
        with self._errors("list"):
            for raw in self._redis.scan_iter(match=f"{self._prefix}*", count=_BATCH):
                name = raw.decode("utf-8", "replace")
                if name == f"{self._prefix}counters" or name.startswith(lease):
                    continue
                if name.startswith(entry) and is_key(name[len(entry):]):
                    continue
                out.append(RedisStray(name))
        return sorted(out)

    def remove_stray(self, path: str) -> None:
        """Delete one key listed by :meth:`strays`.

        Raises:
            ValueError: ``path`` is not a key under this store's prefix.
            OSError: the server failed.
        """
        if not str(path).startswith(self._prefix):
            raise ValueError(f"{path} is not in store {self.url}")
        with self._errors("delete from"):
            self._redis.delete(str(path))

    def temp_files(self) -> list[str]:
        """None: Redis takes each value whole in one command, so no write leaves a temp file."""
        return []

    def iter(self) -> Iterator[str]:
        """Keys of all entries (``SCAN``; an entry written or evicted meanwhile may or may not
        appear, none appears twice)."""
        with self._errors("list"):
            keys = sorted({key for key, _ in self._scan()})
        return iter(keys)

    def stat(self, key: str) -> EntryStat | None:
        """Size, ``created`` (from the entry's header; now when unreadable) and ``last_used``
        (now minus ``OBJECT IDLETIME``, whole seconds; ``created`` under an LFU policy)."""
        name = self._entry(key)
        with self._errors("read from"):
            idle, size, head = self._untouched(("OBJECT", "IDLETIME", name), ("STRLEN", name),
                                               ("GETRANGE", name, 0, HEADER_READ - 1))
            if isinstance(size, BaseException):
                if not _wrong_type(size):
                    raise size
                size, head = 0, b""  # not a string: listed as an empty (bad) entry
            if size is None or (not size and not self._redis.exists(name)):
                return None
        now = time.time()
        created = now
        with contextlib.suppress(EntryError, TypeError, ValueError, KeyError):
            created = float(peek_header(bytes(head))["created"])
        # no idle time under an LFU policy (OBJECT IDLETIME replies with an error)
        last_used = now - idle if isinstance(idle, int) else created
        return EntryStat(key, int(size), created, last_used)

    def header(self, key: str) -> dict[str, Any] | None:
        """The entry's JSON header from its first 64 KiB (``GETRANGE``; the whole blob when the
        header is longer), or ``None`` when there is no entry or it is not one."""
        name = self._entry(key)
        with self._errors("read from"):
            (head,) = self._untouched(("GETRANGE", name, 0, HEADER_READ - 1))
            if isinstance(head, BaseException):
                if _wrong_type(head):
                    return None
                raise head
        return header_of(head, lambda: self.peek(key))

    # -- size management -----------------------------------------------------------------
    def total_size(self) -> int:
        """Bytes Redis holds for all entries (``MEMORY USAGE``: each blob plus tens of bytes of
        Redis's own per key; the figure ``maxmemory`` counts). Touches no entry."""
        with self._errors("list"):
            return sum(size for _, size, _ in self._memory_and_idle())

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries (largest ``OBJECT IDLETIME`` first; in ``SCAN``
        order under an LFU policy) until the entries take at most ``max_size`` bytes (as
        :meth:`total_size` counts them). Returns the evicted keys (or those that would be, with
        ``dry_run``). Prefer ``maxmemory-policy allkeys-lru`` on the server."""
        with self._errors("prune"):
            rows = sorted(self._memory_and_idle(), key=lambda r: -r[2])  # stable: ties keep order
            evicted = to_evict([(key, size) for key, size, _ in rows],
                               sum(size for _, size, _ in rows), max_size)
            if not dry_run:
                for chunk in range(0, len(evicted), _BATCH):
                    self._redis.delete(*(self._entry(k) for k in evicted[chunk:chunk + _BATCH]))
        return evicted

    # -- single flight -------------------------------------------------------------------
    def lease(self, key: str, seconds: float) -> _RedisLease:
        """A lease on ``key`` lasting ``seconds`` unless renewed (not yet acquired): redis-py's
        :class:`redis.lock.Lock` on ``kiln:vN:lease:<key>`` (``SET NX PX``; renew and release
        check the token in a Lua script, so a lease taken over is never touched)."""
        name = f"{self._prefix}lease:{check_lease(key, seconds)}"
        lock = self._redis.lock(name, timeout=max(seconds, 0.001), blocking=False,
                                thread_local=False)
        return _RedisLease(self, lock)


class _RedisLease:
    """A :class:`kiln.stores._base.Lease` on a redis-py lock (expiry in the server: a holder
    that dies stops renewing and the key expires ``seconds`` later)."""

    expires = True  # (a key with a time to live, renewed while held)

    def __init__(self, store: RedisStore, lock: Any) -> None:
        self._store = store
        self._lock = lock
        self._held = False

    def acquire(self) -> bool:
        with self._store._errors("lease a key in"):
            if self._held and self._lock.owned():
                return True
            self._held = bool(self._lock.acquire(blocking=False))
        return self._held

    def renew(self) -> bool:
        if not self._held:
            return False
        with self._store._errors("renew a lease in"):
            try:
                return bool(self._lock.reacquire())
            except self._store._exc.LockError:  # expired, or taken over
                self._held = False
                return False

    def release(self) -> None:
        held, self._held = self._held, False
        if not held:
            return
        with self._store._errors("release a lease in"):
            with contextlib.suppress(self._store._exc.LockError):  # not ours any more
                self._lock.release()
