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
entry, compiled again and replaced. The index is advisory (:mod:`kiln.stores._local_index`).
Directories are created 0700 and files 0600: an entry holds native code, so the store must be
private to its user.

What is trusted: a store directory (or its ``entries/`` folder) that other users can write to,
or that another user owns, is refused with :class:`kiln.StoreError` (kiln never changes
permissions) unless the store is signed (``KILN_SIGNING_KEY``: then only entries signed with
that key are ever decoded). An entry file owned by another user is never read.

Faults: every failure of the files or of the index (``OSError``, ``sqlite3.Error``) reaches
the caller as ``OSError``; a read-only or full store still serves reads (``last_used`` updates
are best-effort). Files under ``entries/`` that are not entries (``strays()``) are never read
as entries, never evicted as entries, and listed by path. Temp files of writers (named
``.<key prefix>.<host>.<pid>.<random>.tmp``) are removed only once their writer is gone (same
host, process no longer running) or after an hour (``_local_files._TEMP_MAX_AGE``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._backend import HEADER_READ, check_key, header_of
from ._base import EntryStat
from ._local_files import Folders, entry_path, is_entry_file, read_entry, write_atomic
from ._local_index import Index
from ._local_lease import LEASE_MIN_AGE, FileLease, file_lease, sweep_leases

__all__ = ["LocalStore"]


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
        self._folders = Folders(self.root, shared=shared)
        self._entries = self._folders.entries
        self._index = Index(self._folders)

    def _path(self, key: str) -> Path:
        return entry_path(self._entries, key)

    def check(self) -> None:
        """Raise :class:`kiln.StoreError` if this store would be refused (not a directory,
        writable by others, owned by another user); see the module docstring."""
        self._folders.check()

    def rebuild_index(self) -> None:
        """Re-read the directory into the index (after files were added or removed by hand)."""
        self._index.rebuild()

    def flush(self) -> None:
        """Record pending reads in the index (LRU order) now."""
        self._index.flush()

    # -- protocol ------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        self._folders.check()
        data = read_entry(path, shared=self.shared)
        if data is not None:
            self._index.touch(key, len(data))
        return data

    def peek(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or ``None``, without marking it used (for audits)."""
        self._folders.check()
        return read_entry(self._path(key), shared=self.shared)

    def put(self, key: str, data: bytes) -> None:
        """Write the entry (atomically: a temp file, then ``os.replace``); its index row is
        recorded with the next batch, at once when the size cap may be passed (then least
        recently used entries are evicted)."""
        path = self._path(key)
        self._folders.within(path.parent, lambda: write_atomic(path, data), sweep=True)
        self._index.wrote(key, len(data), self.max_size)

    replace = put  # put already replaces what the file held

    def lease(self, key: str, seconds: float) -> FileLease:
        """An OS file lock on ``key`` (single-flight between processes of this host).
        ``seconds`` is not used: the lock lasts while its holder lives."""
        return file_lease(self._folders, check_key(key))

    def delete(self, key: str) -> bool:
        path = self._path(key)
        existed = True
        try:
            path.unlink()
        except FileNotFoundError:
            existed = False
        sweep_leases(self.root, 0.0, key)  # (kiln clear: no lock file left behind)
        self._index.forget(key)
        return existed

    def iter(self) -> Iterator[str]:
        """Keys of the entry files (regular files named ``<hex key>.kiln``); anything else
        under ``entries/`` is a stray (:meth:`strays`)."""
        if not self._entries.is_dir():
            return iter(())
        return (p.stem for p in sorted(self._entries.glob("*/*.kiln")) if is_entry_file(p))

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
                if not (p.suffix == ".kiln" and is_entry_file(p)):
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
        created, last_used = self._index.times(key) or (st.st_mtime, st.st_mtime)
        return EntryStat(key, st.st_size, created, last_used)

    def header(self, key: str) -> dict[str, Any] | None:
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(HEADER_READ)
                return header_of(head, lambda: head + f.read())
        except OSError:
            return None

    # -- counters ------------------------------------------------------------------------
    def add_counts(self, counts: dict[str, int]) -> None:
        """Add ``counts`` to the store's counters (one transaction).

        Raises:
            OSError: the index cannot be written.
        """
        self._index.add_counts(counts)

    def counts(self) -> dict[str, int]:
        """The counters added so far (see :meth:`add_counts`)."""
        return self._index.counts()

    # -- size management -----------------------------------------------------------------
    def total_size(self) -> int:
        """Bytes of all entries, from the index."""
        return self._index.total_size()

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries until the store holds at most ``max_size`` bytes.

        Also removes temp files whose writers are gone (killed mid-write); never those of a
        live writer. Returns the evicted keys (or those that would be, with ``dry_run``).
        """
        if not dry_run:
            self._folders.sweep()
            sweep_leases(self.root, LEASE_MIN_AGE)
        return self._index.prune(max_size, dry_run=dry_run)
