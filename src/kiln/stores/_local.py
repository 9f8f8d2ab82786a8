"""The local directory store (the default).

Layout under ``root``::

    entries/<key[:2]>/<key>.kiln    one entry blob per file (see kiln._entry for its bytes)
    index.sqlite                    key, size, created, last_used: for LRU eviction without
                                    scanning the directory on every write

Writes are atomic (a temp file in the same folder, then ``os.replace``; the temp file is removed
on failure), so a reader in another process sees the old entry, the new one, or none, never half
of one. The index is advisory: it is rebuilt from the directory when it is missing or corrupt,
and a row whose file is gone is dropped. Directories are created 0700 and files 0600: an entry
holds native code, so the store must be private to its user.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._entry import peek_header
from .._errors import EntryError
from ._base import EntryStat

__all__ = ["LocalStore"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL, "
    "created REAL NOT NULL, last_used REAL NOT NULL)"
)
_HEADER_READ = 1 << 16


_TEMP_MAX_AGE = 600.0  # seconds: a temp file older than this belongs to a dead writer


def _sweep_temp_files(folder: Path, older_than: float = _TEMP_MAX_AGE) -> None:
    """Remove ``.*.tmp`` files older than ``older_than`` seconds (left by killed writers)."""
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime >= older_than:
                tmp.unlink()


class LocalStore:
    """Entries as files under ``root`` with an LRU size cap of ``max_size`` bytes."""

    def __init__(self, root: str | os.PathLike[str], *, max_size: int = 4 * 1024**3) -> None:
        self.root = Path(root).expanduser()
        self.url = str(self.root)
        self.max_size = max_size
        self._entries = self.root / "entries"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    # -- helpers -------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"store key must be lowercase hex, got {key!r}")
        return self._entries / key[:2] / f"{key}.kiln"

    def _ensure_dirs(self) -> None:
        for d in (self.root, self._entries):
            if not d.is_dir():
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self._ensure_dirs()
            path = self.root / "index.sqlite"
            fresh = not path.exists()
            try:
                db = sqlite3.connect(path, timeout=60, check_same_thread=False)
                db.execute(_SCHEMA)
                db.commit()
            except sqlite3.DatabaseError:
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
        return self._db

    def _rebuild_locked(self) -> None:
        db = self._db
        assert db is not None
        rows = []
        for path in self._entries.glob("*/*.kiln"):
            try:
                st = path.stat()
            except OSError:
                continue
            rows.append((path.stem, st.st_size, st.st_mtime, st.st_mtime))
        db.execute("DELETE FROM entries")
        db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)", rows)
        db.commit()

    def rebuild_index(self) -> None:
        """Re-read the directory into the index (after files were added or removed by hand)."""
        with self._lock:
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
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"entry path is not a regular file: {path}")
            return f.read(st.st_size)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        data = self._read(path)
        if data is None:
            return None
        now = time.time()
        with self._lock:
            db = self._conn()
            cur = db.execute("UPDATE entries SET last_used=? WHERE key=?", (now, key))
            if cur.rowcount == 0:
                db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                           (key, len(data), now, now))
            db.commit()
        return data

    def peek(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or ``None``, without marking it used (for audits)."""
        return self._read(self._path(key))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._ensure_dirs()
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # not an entry: replace it
        _sweep_temp_files(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        now = time.time()
        with self._lock:
            db = self._conn()
            db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                       (key, len(data), now, now))
            db.commit()
            self._evict_locked(self.max_size, keep=key)

    def delete(self, key: str) -> bool:
        path = self._path(key)
        existed = True
        try:
            path.unlink()
        except FileNotFoundError:
            existed = False
        with self._lock:
            db = self._conn()
            db.execute("DELETE FROM entries WHERE key=?", (key,))
            db.commit()
        return existed

    def iter(self) -> Iterator[str]:
        if not self._entries.is_dir():
            return iter(())
        return (p.stem for p in sorted(self._entries.glob("*/*.kiln")))

    def stat(self, key: str) -> EntryStat | None:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        with self._lock:
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

    # -- size management -----------------------------------------------------------------
    def total_size(self) -> int:
        """Bytes of all entries, from the index."""
        with self._lock:
            (total,) = self._conn().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        return int(total)

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries until the store holds at most ``max_size`` bytes.

        Also removes temporary files left by writers that were killed mid-write.
        Returns the evicted keys (or those that would be, with ``dry_run``).
        """
        if not dry_run and self._entries.is_dir():
            for sub in self._entries.iterdir():
                if sub.is_dir():
                    _sweep_temp_files(sub, older_than=0.0)
        with self._lock:
            self._conn()
            return self._evict_locked(max_size, keep=None, dry_run=dry_run)

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
            if key == keep:
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
