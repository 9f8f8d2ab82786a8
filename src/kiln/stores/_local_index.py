"""The local store's index, ``index.sqlite``: a row per entry for LRU eviction, and counters.

The index is advisory: it is rebuilt from the directory when it is missing or corrupt, a row
whose file is gone is dropped, and the rows of reads and writes are recorded together, in one
transaction at most every ``_TOUCH_EVERY`` seconds, before the index is read, and at exit (a
put costs a file write, not a SQLite commit: ``benchmarks/store_put.py``). A row lost to a
crash before that is written again when the entry is next read, and by ``kiln prune``.
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from .._base import is_key
from ._backend import called_at_exit, to_evict
from ._local_files import Folders, entry_path, on_disk

__all__ = ["Index"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL, "
    "created REAL NOT NULL, last_used REAL NOT NULL)"
)
_COUNTERS = "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)"
_UPSERT = "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)"
_TOTAL = "SELECT COALESCE(SUM(size), 0) FROM entries"
_TOUCH_EVERY = 1.0  # seconds between index writes of reads (LRU order)


@contextlib.contextmanager
def _index_errors(path: Path) -> Iterator[None]:
    """Any failure of the SQLite index (disk full, read-only, locked, corrupt) as ``OSError``."""
    try:
        yield
    except sqlite3.Error as e:
        raise OSError(errno.EIO, f"store index {path}: {e}") from None


def _open(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=60, check_same_thread=False)
    db.execute(_SCHEMA)
    db.commit()
    return db


class Index:
    """The index of the entries in ``folders`` (thread-safe; its failures raise ``OSError``),
    behind :class:`kiln.stores.LocalStore`'s methods of the same names."""

    def __init__(self, folders: Folders) -> None:
        self._folders = folders
        self.path = folders.root / "index.sqlite"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
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
        _open_indexes.add(self)

    # -- what the store records ----------------------------------------------------------
    def touch(self, key: str, size: int) -> None:
        """``key`` (``size`` bytes) was read now."""
        now = time.time()
        with self._lock:
            self._touched[key] = (size, now)
            if now - self._touched_at >= _TOUCH_EVERY:
                self._record_locked()

    def wrote(self, key: str, size: int, max_size: int) -> None:
        """``key`` (``size`` bytes) was written now: its row is recorded with the next batch,
        at once when the store may pass ``max_size`` bytes (then least recently used entries
        other than ``key`` are evicted)."""
        now = time.time()
        with self._lock, _index_errors(self.path):
            self._touched.pop(key, None)
            self._written[key] = (size, now)
            self._pending_bytes += size
            known = self._known_total
            if known is None or known + self._pending_bytes > max_size:
                self._record_locked()  # (reads the index's total again)
                if self._known_total is None or self._known_total > max_size:
                    self._conn()
                    self._evict_locked(max_size, keep=key)
                    self._known_total = None  # read again at the next recording
            elif now - self._touched_at >= _TOUCH_EVERY:
                self._record_locked()

    def forget(self, key: str) -> None:
        """``key``'s entry file was deleted: drop its row."""
        with self._lock, _index_errors(self.path):
            self._touched.pop(key, None)
            if key in self._written:
                self._pending_bytes -= self._written.pop(key)[0]
            db = self._conn()
            db.execute("DELETE FROM entries WHERE key=?", (key,))
            db.commit()
            self._known_total = None

    def flush(self) -> None:
        with self._lock:
            self._record_locked()

    # -- what the store reads ------------------------------------------------------------
    def times(self, key: str) -> tuple[float, float] | None:
        """``(created, last_used)`` of ``key``'s row; ``None`` when it has none or the index
        cannot be read (best-effort)."""
        with contextlib.suppress(OSError, sqlite3.Error), self._lock:
            self._record_locked()
            return self._conn().execute(  # type: ignore[no-any-return]
                "SELECT created, last_used FROM entries WHERE key=?", (key,)).fetchone()
        return None

    def total_size(self) -> int:
        with self._lock, _index_errors(self.path):
            self._record_locked()
            (total,) = self._conn().execute(_TOTAL).fetchone()
        return int(total)

    def add_counts(self, counts: dict[str, int]) -> None:
        with self._lock, _index_errors(self.path):
            db = self._conn()
            db.execute(_COUNTERS)
            for name, value in counts.items():
                db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                           "SET value = value + excluded.value", (name, int(value)))
            db.commit()

    def counts(self) -> dict[str, int]:
        with self._lock, _index_errors(self.path):
            db = self._conn()
            try:
                rows = db.execute("SELECT name, value FROM counters").fetchall()
            except sqlite3.OperationalError:  # no such table: nothing recorded yet
                return {}
            return {name: int(v) for name, v in rows}

    # -- upkeep --------------------------------------------------------------------------
    def rebuild(self) -> None:
        with self._lock, _index_errors(self.path):
            self._conn()
            self._rebuild_locked()

    def prune(self, max_size: int, *, dry_run: bool) -> list[str]:
        """Reconcile the index with the files (unless ``dry_run``), then evict least recently
        used entries until at most ``max_size`` bytes are left; the keys evicted (or that would
        be)."""
        with self._lock, _index_errors(self.path):
            self._conn()
            self._record_locked()
            if not dry_run:
                self._reconcile_locked()
            return self._evict_locked(max_size, keep=None, dry_run=dry_run)

    # -- under the lock ------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        path = self.path
        if self._db is not None and not path.exists():
            # the index was deleted under us (by hand, or another process): start a new one
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        if self._db is None:
            self._folders.forget()  # (the store may have been removed: check and make it again)
            self._folders.make()
            with _index_errors(path):
                self._db = self._connect(path)
        return self._db

    def _connect(self, path: Path) -> sqlite3.Connection:
        fresh = not path.exists()
        try:
            db = _open(path)
        except sqlite3.OperationalError:
            raise  # read-only, full, locked: a fault, not a corrupt index
        except sqlite3.DatabaseError:  # "file is not a database": rebuild it
            with contextlib.suppress(OSError):
                path.unlink()
            db, fresh = _open(path), True
        with contextlib.suppress(OSError):
            path.chmod(0o600)
        self._db = db
        if fresh:
            self._rebuild_locked()
        return db

    def _rebuild_locked(self) -> None:
        db = self._db
        assert db is not None
        rows = [(key, st.st_size, st.st_mtime, st.st_mtime)
                for key, st in on_disk(self._folders.entries).items()]
        db.execute("DELETE FROM entries")
        db.executemany(_UPSERT, rows)
        db.commit()

    def _record_locked(self) -> None:
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
            db.executemany(_UPSERT,
                           [(key, size, when, when) for key, (size, when) in written.items()])
            for key, (size, when) in touched.items():
                cur = db.execute("UPDATE entries SET last_used=? WHERE key=?", (when, key))
                if cur.rowcount == 0 and entry_path(self._folders.entries, key).exists():
                    db.execute(_UPSERT, (key, size, when, when))  # (not deleted since)
            db.commit()
            (total,) = db.execute(_TOTAL).fetchone()
            self._known_total, self._pending_bytes = int(total), 0

    def _reconcile_locked(self) -> None:
        """Index rows for entry files that have none (rows lost to a crash before they were
        recorded, files copied in by hand), and none for files that are gone."""
        db = self._db
        assert db is not None
        indexed = {key for (key,) in db.execute("SELECT key FROM entries")}
        found = on_disk(self._folders.entries)
        db.executemany(_UPSERT, [(k, st.st_size, st.st_mtime, st.st_mtime)
                                 for k, st in found.items() if k not in indexed])
        db.executemany("DELETE FROM entries WHERE key=?", [(k,) for k in indexed - found.keys()])
        db.commit()
        self._known_total = None

    def _evict_locked(self, max_size: int, *, keep: str | None, dry_run: bool = False) -> list[str]:
        db = self._db
        assert db is not None
        (total,) = db.execute(_TOTAL).fetchone()
        if total <= max_size:
            return []
        rows = db.execute("SELECT key, size FROM entries ORDER BY last_used ASC").fetchall()
        evicted = to_evict(((key, size) for key, size in rows if key != keep and is_key(key)),
                           total, max_size)
        if not dry_run:
            for key in evicted:
                with contextlib.suppress(OSError):
                    entry_path(self._folders.entries, key).unlink()
                db.execute("DELETE FROM entries WHERE key=?", (key,))
            db.commit()
        return evicted


_open_indexes: weakref.WeakSet[Index] = called_at_exit("flush")
