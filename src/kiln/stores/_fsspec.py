"""A store on any fsspec file system: object stores (``s3://bucket/prefix``, ``gs://``,
``az://``) and others (``memory://`` for tests).

Layout under the URL (``N`` is :data:`kiln._base._entry.FORMAT_VERSION`, so kilns that read
different formats never meet)::

    vN/entries/<key[:2]>/<key>.kiln    one entry blob per object (kiln._base._entry: its bytes)
    vN/used/<key>                      empty; its modification time is the entry's last use
    vN/counters/<host>.<pid>.<random>.json   counters one process recorded at exit
                                       (``add_counts``; ``counts`` sums them)
    vN/leases/<key>                    JSON {"token", "seq", "host", "pid"}: who compiles <key>

Options come the fsspec way: ``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables (read when
the store is made, so setting them after fsspec was imported works too), e.g.
``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_S3_KEY``, ``FSSPEC_S3_SECRET``, or ``FSSPEC_S3`` holding a
JSON object; then fsspec's config files; then the usual credentials of the backend (AWS
profiles, instance roles). On S3, botocore's timeouts are set from ``timeout`` and its retries
are off (one attempt, and s3fs's own retries are off), unless ``config_kwargs`` set them.

Writes: :meth:`FsspecStore.put` is create-only (S3: ``PutObject`` with ``If-None-Match: *``;
fsspec's ``mode="create"`` elsewhere): entries are content-addressed, so an entry already there
is the same entry and a lost race costs nothing. :meth:`FsspecStore.replace` overwrites; kiln
calls it only after the entry there failed verification. Object stores and ``memory://`` write
a whole object at once (readers see the old object, the new one or none). On other file systems
(sftp, smb, ...) a reader may see a partly written entry; its digest then fails, kiln refuses
it and replaces it.

Last use: reading an entry writes its ``used/`` marker, at most once per key per process per
hour (best-effort: a failed marker write is ignored); :meth:`FsspecStore.prune` evicts by it.

What is trusted: whoever can write under the URL can run code in every process that loads
entries from it (an entry holds native code): keep the bucket private, or set
``KILN_SIGNING_KEY`` (then only entries signed with it are decoded).

Timeouts: reads wait at most ``timeout`` seconds for each answer (S3: botocore's read timeout).
A write on an asynchronous file system (s3fs, gcsfs, adlfs) is abandoned (``TimeoutError``)
once it has taken ``connect_timeout + timeout`` seconds plus one second per MiB: S3 PUTs send
``Expect: 100-continue``, and aiohttp waits for a server that never answers that without any
timeout of its own.

Faults: any exception of the file system (botocore's ``ClientError`` such as ``SlowDown`` or
``AccessDenied``, a refused connection, ``PermissionError``) reaches the caller as ``OSError``;
timeouts as the builtin :class:`TimeoutError`. A missing entry is ``None``, never an error.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from .._base import FORMAT_VERSION, StoreError, is_key, short_key
from ._backend import HEADER_READ, MIN_RATE, check_key, check_lease, header_of, redact_url, to_evict
from ._base import EntryStat
from ._fsspec_open import open_filesystem

__all__ = ["FsspecStore"]

logger = logging.getLogger("kiln")

_USED_EVERY = 3600.0  # seconds between two used-marker writes of one key by one process
# object stores: no folders to make (and s3fs's makedirs would create a missing bucket)
_BUCKETS = {"s3", "s3a", "gs", "gcs"}  # the URL's first part is a bucket that must exist
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}
_monotonic = time.monotonic  # the leases' clock (tests replace it)
# keys of fsspec's info() that hold a modification time, most specific first
_MTIME_FIELDS = ("LastModified", "mtime", "updated", "last_modified", "modified", "created",
                 "timeCreated")


def _is_timeout(e: BaseException) -> bool:
    """A timeout by any library's name for it (botocore's ``ReadTimeoutError``, aiohttp's
    ``ServerTimeoutError``, fsspec's ``FSTimeoutError``, ``socket.timeout``)."""
    return isinstance(e, TimeoutError) or any("Timeout" in c.__name__ for c in type(e).__mro__)


def _is_empty_range(e: BaseException) -> bool:
    """An object store's "range not satisfiable" answer (HTTP 416), as a ranged read of an
    empty object gets."""
    return _error_code(e) == "InvalidRange" or "not satisfiable" in str(e).lower()


def _error_code(e: BaseException) -> str:
    """The S3 error code (``"SlowDown"``) of a botocore ``ClientError`` or of the ``OSError``
    s3fs made of one; ``""`` when there is none."""
    for err in (e, e.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, Mapping):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def _mtime(info: Mapping[str, Any]) -> float | None:
    """POSIX seconds of an fsspec ``info()`` dict's modification time, or ``None``."""
    for field in _MTIME_FIELDS:
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value).timestamp()
    return None


class FsspecStore:
    """Entries as objects under an fsspec URL; see the module docstring for the layout,
    options and faults.

    Args:
        url: an fsspec URL: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
            ``memory://name``, ...
        timeout: seconds one request may wait for an answer (S3: botocore's read timeout;
            other file systems keep their own timeouts).
        connect_timeout: seconds a connection may take to open (S3).
        storage_options: options for the file system, over those of the environment.

    Raises:
        StoreError: fsspec, or the package for the URL's protocol, is not installed, or the
            URL is not one fsspec knows.

    Example:
        >>> from kiln.stores._fsspec import FsspecStore
        >>> store = FsspecStore("memory://kiln-doctest")
        >>> key = "ab" * 32
        >>> store.put(key, b"blob"); store.put(key, b"other"); store.get(key)
        b'blob'
        >>> list(store.iter()) == [key], store.delete(key), store.get(key)
        (True, True, None)
    """

    def __init__(
        self, url: str, *, timeout: float = 10.0, connect_timeout: float = 1.0,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = redact_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._fs, root, protocols = open_filesystem(
            url, self.url, timeout=timeout, connect_timeout=connect_timeout,
            storage_options=storage_options)
        self._has_folders = not _OBJECT_STORES.intersection(protocols)
        self._has_buckets = bool(_BUCKETS.intersection(protocols))
        # fsspec's sync wrapper of an async file system takes a deadline (``timeout=``)
        self._deadlines = bool(getattr(self._fs, "async_impl", False))
        self._base = f"{root.rstrip('/')}/v{FORMAT_VERSION}"
        self._used_lock = threading.Lock()
        self._used_at: dict[str, float] = {}  # key -> time.monotonic() of our last marker

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def close(self) -> None:
        """Close the file system's connections (s3fs: its aiobotocore client)."""
        fs = self._fs
        creator = getattr(fs, "_s3creator", None)  # s3fs's client context, when connected
        if creator is not None and callable(getattr(fs, "close_session", None)):
            with contextlib.suppress(Exception):
                fs.close_session(getattr(fs, "loop", None), creator)
            fs._s3 = None
            fs._s3creator = None

    # -- helpers -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Any exception of the file system as ``OSError`` (timeouts as
        :class:`TimeoutError`), named with what failed and the store's URL."""
        try:
            yield
        except Exception as e:
            if _is_timeout(e):
                raise TimeoutError(errno.ETIMEDOUT, f"{doing} store {self.url}: no answer in "
                                   f"{self.timeout:g} s ({type(e).__name__}: {e})") from e
            if isinstance(e, OSError):
                raise
            raise OSError(errno.EIO, f"{doing} store {self.url}: {type(e).__name__}: "
                          f"{e}") from e

    def check(self) -> None:
        """Raise :class:`kiln.StoreError` when the URL's bucket does not exist (S3, GCS): a
        listing of it would otherwise read as an empty store (``kiln ls`` said "no entries").

        Raises:
            StoreError: the bucket does not exist.
            OSError: the store did not answer.
        """
        if not self._has_buckets:
            return
        bucket = self._base.split("/", 1)[0]
        with self._errors("read from"):
            exists = self._fs.exists(bucket)
        if not exists:
            raise StoreError(f"kiln store {self.url!r}: bucket {bucket!r} does not exist (create "
                             "it, or fix the URL in --store / KILN_STORE)")

    def _entry(self, key: str) -> str:
        return f"{self._base}/entries/{check_key(key)[:2]}/{key}.kiln"

    def _write(self, path: str, data: bytes, *, create: bool) -> bool:
        """Write ``data`` at ``path``; with ``create``, only if nothing is there (``False``
        then). Makes missing folders on file systems that have folders (never a bucket)."""
        options: dict[str, Any] = {"mode": "create" if create else "overwrite"}
        if self._deadlines:
            options["timeout"] = self.connect_timeout + self.timeout + len(data) / MIN_RATE
        try:
            try:
                self._fs.pipe_file(path, data, **options)
            except FileNotFoundError:
                if not self._has_folders:
                    raise  # S3: no such bucket
                self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                self._fs.pipe_file(path, data, **options)
        except FileExistsError:
            if create:
                return False
            raise
        except OSError as e:
            # S3: two conditional writes of one key at once; the other one won
            if create and _error_code(e) == "ConditionalRequestConflict":
                return False
            raise
        return True

    def add_counts(self, counts: dict[str, int]) -> None:
        """Record ``counts`` as one small object (object stores have no atomic increment:
        :meth:`counts` sums the objects)."""
        name = f"{socket.gethostname()[:32]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.json"
        with self._errors("write to"):
            self._write(f"{self._base}/counters/{name}",
                        json.dumps({k: int(v) for k, v in counts.items()}).encode(), create=True)

    def counts(self) -> dict[str, int]:
        """The sums of the counters recorded so far (see :meth:`add_counts`)."""
        total: dict[str, int] = {}
        with self._errors("read from"):
            for path in self._listing(f"{self._base}/counters"):
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    raw = self._read(path)
                    for name, value in json.loads(raw or b"{}").items():
                        total[str(name)] = total.get(str(name), 0) + int(value)
        return total

    def _read(self, path: str, start: int | None = None, end: int | None = None
              ) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(path, start=start, end=end))
        except FileNotFoundError as e:
            if _error_code(e) == "NoSuchBucket":
                raise  # a store that is not there, not a missing entry
            return None
        except OSError as e:
            if not start and _is_empty_range(e):
                return b""  # a ranged read of an empty object (S3 answers 416)
            raise

    def _listing(self, folder: str) -> dict[str, Mapping[str, Any]]:
        """path -> info of every file under ``folder`` (nothing when it is missing)."""
        self._fs.invalidate_cache(folder)
        try:
            found = self._fs.find(folder, detail=True)
        except FileNotFoundError:
            return {}
        return {p: info for p, info in found.items() if info.get("type", "file") == "file"}

    def _entry_infos(self) -> dict[str, Mapping[str, Any]]:
        """key -> info of every entry object (anything else under ``entries/`` is skipped)."""
        out: dict[str, Mapping[str, Any]] = {}
        for path, info in self._listing(f"{self._base}/entries").items():
            parent, _, name = path.rpartition("/")
            key = name[: -len(".kiln")]
            if (name.endswith(".kiln") and is_key(key)
                    and parent.endswith(f"/{key[:2]}")):
                out[key] = info
        return out

    def _mark_used(self, key: str) -> None:
        """Write ``used/<key>`` if this process has not done so in the last hour (best-effort:
        a failure is logged at DEBUG and not retried for an hour)."""
        now = time.monotonic()
        with self._used_lock:
            last = self._used_at.get(key)
            if last is not None and now - last < _USED_EVERY:
                return
            self._used_at[key] = now
        try:
            self._write(f"{self._base}/used/{key}", b"", create=False)
        except Exception as e:  # noqa: BLE001 - a last-use record must never fail a read
            logger.debug("kiln: cannot record the use of %s in %s (%s)", short_key(key), self.url,
                         e)

    # -- protocol ------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The blob under ``key``, or ``None``; records its use (see the module docstring)."""
        data = self.peek(key)
        if data is not None:
            self._mark_used(key)
        return data

    def peek(self, key: str) -> bytes | None:
        """Like :meth:`get`, without recording a use."""
        path = self._entry(key)
        with self._errors("read from"):
            return self._read(path)

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` unless an entry is there already (create-only: entries
        are content-addressed, so the one there is the same entry)."""
        path = self._entry(key)
        with self._errors("write to"):
            self._write(path, bytes(data), create=True)

    def replace(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what is there. kiln calls this only after
        the entry there failed verification (corrupt, or signed with another key)."""
        path = self._entry(key)
        with self._errors("write to"):
            self._write(path, bytes(data), create=False)

    def delete(self, key: str) -> bool:
        path = self._entry(key)
        with self._errors("delete from"):
            existed = bool(self._fs.exists(path))  # S3 deletes a missing object without error
            if existed:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(path)
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(f"{self._base}/used/{key}")
        return existed

    def iter(self) -> Iterator[str]:
        """Keys of the entry objects (``<key[:2]>/<hex key>.kiln``), sorted; anything else
        under ``entries/`` is skipped."""
        with self._errors("list"):
            keys = sorted(self._entry_infos())
        return iter(keys)

    def stat(self, key: str) -> EntryStat | None:
        """Size, ``created`` (the object's modification time) and ``last_used`` (its
        ``used/`` marker's, else ``created``)."""
        path = self._entry(key)
        with self._errors("read from"):
            try:
                info = self._fs.info(path)
            except FileNotFoundError:
                return None
            try:
                used = _mtime(self._fs.info(f"{self._base}/used/{key}"))
            except FileNotFoundError:
                used = None
        created = _mtime(info)
        if created is None:
            created = time.time()
        return EntryStat(key, int(info.get("size") or 0), created, max(created, used or created))

    def header(self, key: str) -> dict[str, Any] | None:
        """The entry's JSON header from its first 64 KiB (the whole object when the header is
        longer), or ``None`` when there is no entry or it is not one."""
        path = self._entry(key)
        with self._errors("read from"):
            return header_of(self._read(path, 0, HEADER_READ), lambda: self._read(path))

    # -- size management -----------------------------------------------------------------
    def total_size(self) -> int:
        """Bytes of all entry objects (one listing)."""
        with self._errors("list"):
            return sum(int(info.get("size") or 0) for info in self._entry_infos().values())

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries (by ``used/`` marker, else creation) until the
        entries take at most ``max_size`` bytes. Returns the evicted keys (or those that would
        be, with ``dry_run``)."""
        with self._errors("prune"):
            entries = self._entry_infos()
            used: dict[str, float] = {}
            for path, info in self._listing(f"{self._base}/used").items():
                when = _mtime(info)
                if when is not None:
                    used[path.rpartition("/")[2]] = when
            now = time.time()
            rows = []
            for key, info in entries.items():
                created = _mtime(info) or now
                rows.append((max(created, used.get(key, created)), key, int(info.get("size") or 0)))
            evicted = to_evict([(key, size) for _, key, size in sorted(rows)],
                               sum(size for _, _, size in rows), max_size)
            if not dry_run:
                for key in evicted:
                    with contextlib.suppress(FileNotFoundError):
                        self._fs.rm_file(self._entry(key))
                    with contextlib.suppress(FileNotFoundError):
                        if key in used:
                            self._fs.rm_file(f"{self._base}/used/{key}")
        return evicted

    # -- single flight -------------------------------------------------------------------
    def lease(self, key: str, seconds: float) -> _ObjectLease:
        """A lease on ``key`` lasting ``seconds`` unless renewed (not yet acquired); see
        :class:`_ObjectLease` for how it works without clocks shared between hosts."""
        return _ObjectLease(self, f"{self._base}/leases/{check_lease(key, seconds)}", seconds)


class _ObjectLease:
    """A :class:`kiln.stores._base.Lease` as an object holding the holder's token.

    ``acquire``: no object -> write one create-only, then read it back (a file system whose
    create-only write is not atomic may let two writers through: the one read back wins). An
    object of another holder -> remember its content and this process's ``time.monotonic()``
    when that content was first seen; once it has not changed for ``seconds`` (its holder stopped
    renewing: died, or lost its host) delete it and write ours. Staleness is judged by this
    process's own clock only, never by comparing clocks across hosts. Two processes taking over
    at once may both compile once; entries are content-addressed, so that is harmless.

    ``renew``: rewrite the object (a new ``seq``, so its content changes) if it still holds our
    token, else ``False``. ``release``: delete it if it still holds our token.
    """

    expires = True  # (taken over when not renewed for its seconds)

    def __init__(self, store: FsspecStore, path: str, seconds: float) -> None:
        self._store = store
        self._fs = store._fs
        self._path = path
        self._seconds = seconds
        self._token = uuid.uuid4().hex
        self._seq = 0
        self._held = False
        self._seen: tuple[bytes, float] | None = None  # another holder's content, first seen

    def _body(self) -> bytes:
        self._seq += 1
        return json.dumps({"token": self._token, "seq": self._seq,
                           "host": socket.gethostname(), "pid": os.getpid()}).encode()

    def _holder(self, content: bytes | None) -> str | None:
        if content is None:
            return None
        try:
            token = json.loads(content).get("token")
        except (ValueError, AttributeError):
            return ""  # not a lease we understand: someone else's
        return token if isinstance(token, str) else ""

    def _create(self) -> bool:
        if not self._store._write(self._path, self._body(), create=True):
            return False
        self._held = self._holder(self._store._read(self._path)) == self._token
        return self._held

    def acquire(self) -> bool:
        with self._store._errors("lease a key in"):
            current = self._store._read(self._path)
            if current is None:
                self._seen = None
                return self._create()
            if self._holder(current) == self._token:
                self._held = True
                return True
            now = _monotonic()
            if self._seen is None or self._seen[0] != current:
                self._seen = (current, now)  # a holder we have not watched yet, or renewed
                return False
            if now - self._seen[1] < self._seconds:
                return False
            # unchanged for `seconds` of our clock: its holder stopped renewing
            if self._store._read(self._path) != current:
                self._seen = None
                return False
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(self._path)
            self._seen = None
            return self._create()

    def renew(self) -> bool:
        if not self._held:
            return False
        with self._store._errors("renew a lease in"):
            if self._holder(self._store._read(self._path)) != self._token:
                self._held = False  # taken over (or deleted as stale)
                return False
            self._store._write(self._path, self._body(), create=False)
        return True

    def release(self) -> None:
        held, self._held = self._held, False
        if not held:
            return
        with self._store._errors("release a lease in"):
            if self._holder(self._store._read(self._path)) == self._token:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(self._path)
