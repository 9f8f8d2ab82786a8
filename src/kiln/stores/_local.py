"""The local directory store (the default).

Layout under ``root``::

    entries/<key[:2]>/<key>.kiln    one entry blob per file (see kiln._base._entry for its bytes)
    leases/keys.lock                single-flight: while a process compiles a key it holds an OS
                                    lock on one byte of this file, at an offset made from the key
                                    (Linux open-file-description locks, ``F_OFD_SETLK``; the OS
                                    frees it when the holder dies). One file for every key: no
                                    file is created on a miss
    leases/<key[:2]>/<key>.lock     the same, a file per key (``flock``), where the system has no
                                    OFD locks (macOS, Windows); removed by prune / clear when
                                    nobody holds them
    index.sqlite                    key, size, created, last_used: for LRU eviction without
                                    scanning the directory on every write; and the counters of
                                    processes that used a shared store behind this one
                                    (``add_counts``, shown by ``kiln stats``)

Writes are atomic (a temp file in the same folder, then ``os.replace``; the temp file is removed
on failure), so a reader in another process sees the old entry, the new one, or none, never half
of one. They are not fsynced (JAX's cache does not either): after an operating-system crash a
file may be empty or torn, and its digest, checked before any byte is decoded, makes it a bad
entry, compiled again and replaced. The index is advisory: it is rebuilt from the directory
when it is missing or corrupt, a row whose file is gone is dropped, and the rows of reads and
writes are recorded together, in one transaction at most every ``_TOUCH_EVERY`` seconds, before
the index is read, and at exit (a put costs a file write, not a SQLite commit:
``benchmarks/store_put.py``). A row lost to a crash before that is written again when the
entry is next read, and by ``kiln prune``. Directories are created 0700 and files 0600: an entry
holds native code, so the store must be private to its user.

What is trusted: a store directory (or its ``entries/`` folder) that other users can write to,
or that another user owns, is refused with :class:`kiln.StoreError` (kiln never changes
permissions) unless the store is signed (``KILN_SIGNING_KEY``: then only entries signed with
that key are ever decoded). An entry file owned by another user is never read.

Faults: every failure of the files or of the index (``OSError``, ``sqlite3.Error``) reaches
the caller as ``OSError``; a read-only or full store still serves reads (``last_used`` updates
are best-effort). Files under ``entries/`` that are not entries (``strays()``) are never read
as entries, never evicted as entries, and listed by path. Temp files of writers (named
``.<key prefix>.<host>.<pid>.<random>.tmp``) are removed only once their writer is gone (same
host, process no longer running) or after ``_TEMP_MAX_AGE`` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import shutil
import socket
import sqlite3
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock

try:
    import fcntl
except ImportError:  # (Windows: filelock's own lock)
    fcntl = None  # type: ignore[assignment]

from .._base import EntryError, StoreError, is_key, peek_header
from ._base import EntryStat

__all__ = ["LocalStore"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL, "
    "created REAL NOT NULL, last_used REAL NOT NULL)"
)
_COUNTERS = "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)"
_HEADER_READ = 1 << 16


_TEMP_MAX_AGE = 3600.0  # seconds: no write of one entry takes this long
_LEASE_MIN_AGE = 60.0  # seconds: prune leaves a newer lease file (about to be locked)
_HOST = socket.gethostname().replace(".", "_")[:32] or "host"


def _temp_is_abandoned(tmp: Path, now: float) -> bool:
    """Whether no live writer can own temp file ``tmp``: its writer (host and pid in its name)
    is gone, or it is older than ``_TEMP_MAX_AGE`` seconds."""
    try:
        age = now - tmp.stat().st_mtime
    except OSError:
        return False
    if age >= _TEMP_MAX_AGE:
        return True
    parts = tmp.name.split(".")  # ["", key16, host, pid, random, "tmp"]
    if len(parts) == 6 and parts[2] == _HOST and parts[3].isdigit():
        pid = int(parts[3])
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True  # that process has exited
        except OSError:
            return False  # alive (owned by someone else)
    return False


def _sweep_temp_files(folder: Path) -> int:
    """Remove abandoned ``.*.tmp`` files in ``folder``; returns how many."""
    now = time.time()
    removed = 0
    for tmp in folder.glob(".*.tmp"):
        if _temp_is_abandoned(tmp, now):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed += 1
    return removed


@contextlib.contextmanager
def _index_errors(path: Path) -> Iterator[None]:
    """Any failure of the SQLite index (disk full, read-only, locked, corrupt) as ``OSError``."""
    try:
        yield
    except sqlite3.Error as e:
        raise OSError(errno.EIO, f"store index {path}: {e}") from None


def _is_entry_file(p: Path) -> bool:
    """A regular file (not a link) named ``<hex key>.kiln``."""
    if not is_key(p.stem):
        return False
    try:
        return stat.S_ISREG(p.lstat().st_mode)
    except OSError:
        return False


_TOUCH_EVERY = 1.0  # seconds between index writes of reads (LRU order)
_open_stores: weakref.WeakSet[LocalStore] = weakref.WeakSet()


@atexit.register
def _record_all_touched() -> None:
    for store in list(_open_stores):
        with contextlib.suppress(Exception):
            store.flush()


class LocalStore:
    """Entries as files under ``root`` with an LRU size cap of ``max_size`` bytes."""

    def __init__(
        self, root: str | os.PathLike[str], *, max_size: int = 4 * 1024**3, shared: bool = False
    ) -> None:
        """``shared``: the store is signed (``KILN_SIGNING_KEY``), so a directory other users
        can write to is accepted (their unsigned or foreign entries are never decoded)."""
        self.root = Path(root).expanduser()
        self.url = str(self.root)
        self.max_size = max_size
        self.shared = shared
        self._entries = self.root / "entries"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._checked = False
        # reads not yet recorded in the index: key -> (size, last used), written in one
        # transaction at most every _TOUCH_EVERY seconds, before the index is read, and at exit
        self._touched: dict[str, tuple[int, float]] = {}
        self._touched_at = 0.0
        # writes not yet recorded in the index (key -> (size, time)), recorded with the reads;
        # their bytes, and the index's total at the last recording (None: not read yet), keep
        # the size cap without a query per write
        self._written: dict[str, tuple[int, float]] = {}
        self._pending_bytes = 0
        self._known_total: int | None = None
        self._ready: set[Path] = set()  # entry folders made and swept by this process
        _open_stores.add(self)

    # -- helpers -------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"store key must be lowercase hex, got {key!r}")
        return self._entries / key[:2] / f"{key}.kiln"

    def _check_private(self) -> None:
        """Refuse a store that other users can change (see the module docstring).

        Raises:
            StoreError: the root or ``entries/`` is writable by others or owned by another
                user, or the root is not a directory.
        """
        if self._checked:
            return
        me = os.geteuid()
        for d in (self.root, self._entries):
            try:
                st = os.stat(d)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise StoreError(f"kiln store {str(d)!r} is not a directory; point "
                                 "KILN_CACHE_DIR at a directory (or remove that file)")
            if self.shared:
                continue
            if st.st_uid != me:
                raise StoreError(
                    f"kiln store directory {str(d)!r} is owned by uid {st.st_uid}, not by you "
                    f"(uid {me}): whoever owns it can run code in your processes through its "
                    "entries. Use a directory of your own, or set KILN_SIGNING_KEY for a store "
                    "meant to be shared (then only entries signed with it are loaded)"
                )
            if st.st_mode & 0o022:
                raise StoreError(
                    f"kiln store directory {str(d)!r} is writable by other users (mode "
                    f"{stat.S_IMODE(st.st_mode):o}): they could plant entries that run as "
                    f"you. Run 'chmod 700 {d}', or set KILN_SIGNING_KEY for a store meant to "
                    "be shared (then only entries signed with it are loaded)"
                )
        self._checked = self.root.is_dir() and self._entries.is_dir()

    def check(self) -> None:
        """Raise :class:`kiln.StoreError` if this store would be refused (not a directory,
        writable by others, owned by another user); see :meth:`_check_private`."""
        self._check_private()

    def _ensure_dirs(self) -> None:
        """Make the store's root and ``entries/`` (0700) where missing; checked once per
        process while they stay (a write that finds a folder gone clears ``_ready``)."""
        if self.root in self._ready:
            return
        self._check_private()
        for d in (self.root, self._entries):
            if not d.is_dir():
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)
        self._check_private()
        self._ready.add(self.root)

    def _conn(self) -> sqlite3.Connection:
        path = self.root / "index.sqlite"
        if self._db is not None and not path.exists():
            # the index was deleted under us (by hand, or another process): start a new one
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        if self._db is None:
            self._ready.clear()  # (the store may have been removed: check and make it again)
            self._ensure_dirs()
            with _index_errors(path):
                self._db = self._connect(path)
        return self._db

    def _connect(self, path: Path) -> sqlite3.Connection:
        fresh = not path.exists()
        try:
            db = sqlite3.connect(path, timeout=60, check_same_thread=False)
            db.execute(_SCHEMA)
            db.commit()
        except sqlite3.OperationalError:
            raise  # read-only, full, locked: a fault, not a corrupt index
        except sqlite3.DatabaseError:  # "file is not a database": rebuild it
            with contextlib.suppress(OSError):
                path.unlink()
            db = sqlite3.connect(path, timeout=60, check_same_thread=False)
            db.execute(_SCHEMA)
            db.commit()
            fresh = True
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
        self._db = db
        if fresh:
            self._rebuild_locked()
        return db

    def _rebuild_locked(self) -> None:
        db = self._db
        assert db is not None
        rows = []
        for path in self._entries.glob("*/*.kiln"):
            try:
                st = path.lstat()
            except OSError:
                continue
            if is_key(path.stem) and stat.S_ISREG(st.st_mode):
                rows.append((path.stem, st.st_size, st.st_mtime, st.st_mtime))
        db.execute("DELETE FROM entries")
        db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)", rows)
        db.commit()

    def rebuild_index(self) -> None:
        """Re-read the directory into the index (after files were added or removed by hand)."""
        with self._lock, _index_errors(self.root / "index.sqlite"):
            self._conn()
            self._rebuild_locked()

    # -- protocol ------------------------------------------------------------------------
    def _read(self, path: Path) -> bytes | None:
        """The bytes of a regular file at ``path`` (never following a symlink, never reading
        past the size it had when opened), or None when there is none."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(
                os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink where an entry should be
                raise OSError(e.errno, f"entry path is a symlink: {path}") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"entry path is not a regular file: {path}")
            if st.st_uid != os.geteuid() and not self.shared:
                raise OSError(errno.EPERM, f"entry {path} is owned by uid {st.st_uid}, not by "
                              "you: not read (set KILN_SIGNING_KEY for a shared store)")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read(st.st_size)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        self._check_private()
        data = self._read(path)
        if data is None:
            return None
        now = time.time()
        with self._lock:
            self._touched[key] = (len(data), now)
            if now - self._touched_at >= _TOUCH_EVERY:
                self._record_touched_locked()
        return data

    def _record_touched_locked(self) -> None:
        """Write the reads and writes since the last time into the index (one transaction: a
        commit per read cost ~1.5 ms, most of a JAX-cache hit through the kiln:// route, and a
        commit per write 2 ms of a 4.6 ms put). Best-effort: a read-only or full store still
        serves its entries (a lost row is written again at the entry's next read)."""
        touched, self._touched = self._touched, {}
        written, self._written = self._written, {}
        self._touched_at = time.time()
        if not touched and not written and self._known_total is not None:
            return
        with contextlib.suppress(OSError, sqlite3.Error):
            db = self._conn()
            db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                           [(key, size, when, when) for key, (size, when) in written.items()])
            for key, (size, when) in touched.items():
                cur = db.execute("UPDATE entries SET last_used=? WHERE key=?", (when, key))
                if cur.rowcount == 0 and self._path(key).exists():  # (not deleted since)
                    db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                               (key, size, when, when))
            db.commit()
            (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
            self._known_total, self._pending_bytes = int(total), 0

    def flush(self) -> None:
        """Record pending reads in the index (LRU order) now."""
        with self._lock:
            self._record_touched_locked()

    def peek(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or ``None``, without marking it used (for audits)."""
        self._check_private()
        return self._read(self._path(key))

    def put(self, key: str, data: bytes) -> None:
        """Write the entry (atomically: a temp file, then ``os.replace``); its index row is
        recorded with the next batch, at once when the size cap may be passed (then least
        recently used entries are evicted)."""
        path = self._path(key)
        try:
            self._write_file(path, data)
        except FileNotFoundError:  # its folder was removed since (kiln clear, by hand)
            self._ready.clear()
            self._write_file(path, data)
        now = time.time()
        with self._lock, _index_errors(self.root / "index.sqlite"):
            self._touched.pop(key, None)
            self._written[key] = (len(data), now)
            self._pending_bytes += len(data)
            known = self._known_total
            if known is None or known + self._pending_bytes > self.max_size:
                self._record_touched_locked()  # (reads the index's total again)
                if self._known_total is None or self._known_total > self.max_size:
                    self._conn()
                    self._evict_locked(self.max_size, keep=key)
                    self._known_total = None  # read again at the next recording
            elif now - self._touched_at >= _TOUCH_EVERY:
                self._record_touched_locked()

    def _write_file(self, path: Path, data: bytes) -> None:
        folder = path.parent
        if folder not in self._ready:
            self._ensure_dirs()
            folder.mkdir(mode=0o700, exist_ok=True)
            _sweep_temp_files(folder)
            self._ready.add(folder)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.stem[:16]}.{_HOST}.{os.getpid()}.", suffix=".tmp", dir=folder
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            try:
                os.replace(tmp, path)
            except IsADirectoryError:  # a directory where the entry goes: not an entry
                shutil.rmtree(path)
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    replace = put  # put already replaces what the file held

    def lease(self, key: str, seconds: float) -> FileLease:
        """An OS file lock on ``key`` (single-flight between processes of this host).
        ``seconds`` is not used: the lock lasts while its holder lives."""
        self._path(key)  # checks the key
        if _OFD:
            return FileLease(self.root / "leases" / "keys.lock", self, offset=_lock_offset(key))
        return FileLease(self.root / "leases" / key[:2] / f"{key}.lock", self)

    def delete(self, key: str) -> bool:
        path = self._path(key)
        existed = True
        try:
            path.unlink()
        except FileNotFoundError:
            existed = False
        self._sweep_leases(0.0, key)  # (kiln clear: no lock file left behind)
        with self._lock, _index_errors(self.root / "index.sqlite"):
            self._touched.pop(key, None)
            if key in self._written:
                self._pending_bytes -= self._written.pop(key)[0]
            db = self._conn()
            db.execute("DELETE FROM entries WHERE key=?", (key,))
            db.commit()
            self._known_total = None
        return existed

    def iter(self) -> Iterator[str]:
        """Keys of the entry files (regular files named ``<hex key>.kiln``); anything else
        under ``entries/`` is a stray (:meth:`strays`)."""
        if not self._entries.is_dir():
            return iter(())
        return (p.stem for p in sorted(self._entries.glob("*/*.kiln")) if _is_entry_file(p))

    def strays(self) -> list[Path]:
        """Paths under ``entries/`` that are neither entries nor writers' temp files: files
        not named like a key, directories or links where an entry should be, other files."""
        if not self._entries.is_dir():
            return []
        out = []
        for sub in sorted(self._entries.iterdir()):
            if not sub.is_dir() or sub.is_symlink() or len(sub.name) != 2:
                out.append(sub)
                continue
            for p in sorted(sub.iterdir()):
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    continue
                if not (p.suffix == ".kiln" and _is_entry_file(p)):
                    out.append(p)
        return out

    def temp_files(self) -> list[Path]:
        """Writers' temp files under ``entries/`` (in progress, or left by killed writers)."""
        if not self._entries.is_dir():
            return []
        return sorted(self._entries.glob("*/.*.tmp"))

    def remove_stray(self, path: Path) -> None:
        """Delete one stray (file, link or directory tree) under ``entries/``.

        Raises:
            ValueError: ``path`` is not under this store's ``entries/``.
            OSError: it could not be removed.
        """
        if self._entries not in Path(path).parents:
            raise ValueError(f"{path} is not in store {self.url}")
        if Path(path).is_dir() and not Path(path).is_symlink():
            shutil.rmtree(path)
        else:
            Path(path).unlink()

    def stat(self, key: str) -> EntryStat | None:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        row = None
        with contextlib.suppress(OSError, sqlite3.Error), self._lock:  # times: best-effort
            self._record_touched_locked()
            row = self._conn().execute(
                "SELECT created, last_used FROM entries WHERE key=?", (key,)
            ).fetchone()
        created, last_used = row if row else (st.st_mtime, st.st_mtime)
        return EntryStat(key, st.st_size, created, last_used)

    def header(self, key: str) -> dict[str, Any] | None:
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(_HEADER_READ)
                try:
                    return peek_header(head)
                except EntryError:
                    f.seek(0)
                    return peek_header(f.read())
        except (OSError, EntryError):
            return None

    # -- counters ------------------------------------------------------------------------
    def add_counts(self, counts: dict[str, int]) -> None:
        """Add ``counts`` to the store's counters (one transaction).

        Raises:
            OSError: the index cannot be written.
        """
        with self._lock, _index_errors(self.root / "index.sqlite"):
            db = self._conn()
            db.execute(_COUNTERS)
            for name, value in counts.items():
                db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                           "SET value = value + excluded.value", (name, int(value)))
            db.commit()

    def counts(self) -> dict[str, int]:
        """The counters added so far (see :meth:`add_counts`)."""
        with self._lock, _index_errors(self.root / "index.sqlite"):
            db = self._conn()
            try:
                rows = db.execute("SELECT name, value FROM counters").fetchall()
            except sqlite3.OperationalError:  # no such table: nothing recorded yet
                return {}
            return {name: int(v) for name, v in rows}

    # -- size management -----------------------------------------------------------------
    def total_size(self) -> int:
        """Bytes of all entries, from the index."""
        with self._lock, _index_errors(self.root / "index.sqlite"):
            self._record_touched_locked()
            (total,) = self._conn().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        return int(total)

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries until the store holds at most ``max_size`` bytes.

        Also removes temp files whose writers are gone (killed mid-write); never those of a
        live writer. Returns the evicted keys (or those that would be, with ``dry_run``).
        """
        if not dry_run and self._entries.is_dir():
            for sub in self._entries.iterdir():
                if sub.is_dir() and not sub.is_symlink():
                    _sweep_temp_files(sub)
        if not dry_run:
            self._sweep_leases(_LEASE_MIN_AGE)
        with self._lock, _index_errors(self.root / "index.sqlite"):
            self._conn()
            self._record_touched_locked()
            if not dry_run:
                self._reconcile_locked()
            return self._evict_locked(max_size, keep=None, dry_run=dry_run)

    def _sweep_leases(self, min_age: float, key: str | None = None) -> int:
        """Remove lease files (``leases/xx/<key>.lock``, one per key ever compiled) that no
        process holds and that are at least ``min_age`` seconds old; only ``key``'s when
        given. A held one is left (its compile is running). Returns how many were removed."""
        folder = self.root / "leases"
        paths = ([folder / key[:2] / f"{key}.lock"] if key is not None
                 else folder.glob("*/*.lock") if folder.is_dir() else [])
        now, removed = time.time(), 0
        for path in paths:
            try:
                if now - path.lstat().st_mtime < min_age:
                    continue
            except OSError:
                continue
            try:
                lock = _try_lock(path)
            except OSError:
                continue
            if lock is None:
                continue  # held: a compile is running
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
            finally:
                _unlock(lock)
        return removed

    def _reconcile_locked(self) -> None:
        """Index rows for entry files that have none (rows lost to a crash before they were
        recorded, files copied in by hand), and none for files that are gone."""
        db = self._db
        assert db is not None
        indexed = {key for (key,) in db.execute("SELECT key FROM entries")}
        on_disk: dict[str, os.stat_result] = {}
        for path in self._entries.glob("*/*.kiln"):
            with contextlib.suppress(OSError):
                st = path.lstat()
                if is_key(path.stem) and stat.S_ISREG(st.st_mode):
                    on_disk[path.stem] = st
        db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                       [(k, st.st_size, st.st_mtime, st.st_mtime)
                        for k, st in on_disk.items() if k not in indexed])
        db.executemany("DELETE FROM entries WHERE key=?",
                       [(k,) for k in indexed - on_disk.keys()])
        db.commit()
        self._known_total = None

    def _evict_locked(self, max_size: int, *, keep: str | None, dry_run: bool = False) -> list[str]:
        db = self._db
        assert db is not None
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        evicted: list[str] = []
        if total <= max_size:
            return evicted
        for key, size in db.execute(
            "SELECT key, size FROM entries ORDER BY last_used ASC"
        ).fetchall():
            if total <= max_size:
                break
            if key == keep or not is_key(key):
                continue
            evicted.append(key)
            total -= size
            if not dry_run:
                with contextlib.suppress(OSError):
                    self._path(key).unlink()
                db.execute("DELETE FROM entries WHERE key=?", (key,))
        if not dry_run:
            db.commit()
        return evicted


class FileLease:
    """A lease held as an OS file lock (``flock``, the lock ``filelock`` takes on POSIX):
    released by the OS when its holder's process dies (``kill -9``), so a waiter takes over at
    once. It never expires, so nothing renews it (no thread per compile).

    Taken with ``fcntl.flock`` directly where there is one: every miss of the ``kiln://`` route
    takes a lease, and ``filelock.FileLock`` (4.x: fork tracking, a singleton table, ``realpath``)
    costs 0.12 ms an acquire and release where the system call costs 0.007 ms.
    ``filelock`` elsewhere (Windows)."""

    expires = False

    def __init__(self, path: Path, store: LocalStore, offset: int | None = None) -> None:
        self._path = path
        self._store = store
        self._offset = offset  # the byte locked in a file shared by every key (OFD locks)
        self._lock: Any = None

    def acquire(self) -> bool:
        if self._lock is not None:
            return True  # (held already: a second lock would lose the first one's handle)
        folder = self._path.parent
        for attempt in (1, 2):
            if folder not in self._store._ready:
                self._store._ensure_dirs()
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._store._ready.add(folder)
            try:
                self._lock = _try_lock(self._path, self._offset)
            except FileNotFoundError:  # its folder was removed since (kiln clear, by hand)
                self._store._ready.clear()
                if attempt == 2:
                    raise
                continue
            return self._lock is not None
        return False  # (not reached)

    def renew(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            _unlock(lock)


def _try_lock(path: Path, offset: int | None = None) -> Any:
    """An exclusive OS lock on ``path`` (created if absent), or on its byte at ``offset``
    (``F_OFD_SETLK``), taken without waiting: the handle for :func:`_unlock`, or None while
    another holder has it.

    Raises:
        OSError: the file cannot be opened (FileNotFoundError: its folder is gone).
    """
    if fcntl is None:
        lock = filelock.FileLock(path, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            return None
        return lock
    with _fds_lock:  # (a fork waits: its child must not get a descriptor it cannot close)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if offset is None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: OFD), padding
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                            struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return None
            raise
        _held_fds.add(fd)
        return _OSLock(fd, os.getpid())


# Linux's open-file-description locks (3.15+): byte-range locks that, like flock, belong to
# the open file (two threads' descriptors exclude each other, a dead holder's lock is freed),
# unlike POSIX record locks, which a process never conflicts with and loses on any close.
_OFD = fcntl is not None and hasattr(fcntl, "F_OFD_SETLK")


def _lock_offset(key: str) -> int:
    """The byte of ``leases/keys.lock`` that stands for ``key``: 62 bits of its hash, so two
    keys share a byte with probability 2**-62."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 2


class _OSLock:
    """A lock :func:`_try_lock` took: its descriptor, and the process that took it."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int, pid: int) -> None:
        self.fd, self.pid = fd, pid


def _unlock(lock: Any) -> None:
    """Give up a lock :func:`_try_lock` took."""
    if not isinstance(lock, _OSLock):
        lock.release()  # (filelock's)
        return
    if lock.pid != os.getpid():
        # a lease a forked child inherited: its descriptor was closed at the fork, and the
        # number may name another file of the child's by now
        return
    with _fds_lock:
        _held_fds.discard(lock.fd)
        with contextlib.suppress(OSError):
            os.close(lock.fd)  # (closing the descriptor drops its lock)


# descriptors of the locks this process holds: a forked child closes its copies, or the lock
# would last as long as the child (flock and OFD locks belong to the open file, which a fork
# shares); taken and given up under _fds_lock, which a fork waits for
_held_fds: set[int] = set()
_fds_lock = threading.Lock()


def _close_held_in_child() -> None:
    global _fds_lock
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()
    _fds_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    # (through the global: a child has a lock of its own for its own forks)
    os.register_at_fork(before=lambda: _fds_lock.acquire(),
                        after_in_parent=lambda: _fds_lock.release(),
                        after_in_child=_close_held_in_child)
