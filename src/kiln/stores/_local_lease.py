"""The local store's leases: OS file locks, freed by the OS when their holder dies (see
:mod:`kiln.stores._local` for their files)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import filelock

try:
    import fcntl
except ImportError:  # (Windows: filelock's own lock)
    fcntl = None  # type: ignore[assignment]

from ._local_files import Folders

__all__ = ["LEASE_MIN_AGE", "OFD", "FileLease", "file_lease", "sweep_leases"]

LEASE_MIN_AGE = 60.0  # seconds: prune leaves a newer lease file (about to be locked)
# Linux's open-file-description locks (3.15+): byte-range locks that, like flock, belong to
# the open file (two threads' descriptors exclude each other, a dead holder's lock is freed),
# unlike POSIX record locks, which a process never conflicts with and loses on any close.
OFD = fcntl is not None and hasattr(fcntl, "F_OFD_SETLK")


def file_lease(folders: Folders, key: str) -> FileLease:
    """A lease on ``key`` of the store in ``folders`` (not yet acquired)."""
    if OFD:
        return FileLease(folders.root / "leases" / "keys.lock", folders, offset=_lock_offset(key))
    return FileLease(_key_file(folders.root, key), folders)


def _key_file(root: Path, key: str) -> Path:
    return root / "leases" / key[:2] / f"{key}.lock"


def _lock_offset(key: str) -> int:
    """The byte of ``leases/keys.lock`` that stands for ``key``: 62 bits of its hash, so two
    keys share a byte with probability 2**-62."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 2


class FileLease:
    """A lease held as an OS file lock (``flock``, the lock ``filelock`` takes on POSIX):
    released by the OS when its holder's process dies (``kill -9``), so a waiter takes over at
    once. It never expires, so nothing renews it (no thread per compile).

    Taken with ``fcntl.flock`` directly where there is one: every miss of the ``kiln://`` route
    takes a lease, and ``filelock.FileLock`` (4.x: fork tracking, a singleton table, ``realpath``)
    costs 0.12 ms an acquire and release where the system call costs 0.007 ms.
    ``filelock`` elsewhere (Windows)."""

    expires = False

    def __init__(self, path: Path, folders: Folders, offset: int | None = None) -> None:
        self._path = path
        self._folders = folders
        self._offset = offset  # the byte locked in a file shared by every key (OFD locks)
        self._lock: Any = None

    def acquire(self) -> bool:
        if self._lock is None:  # (held already: a second lock would lose the first one's handle)
            self._lock = self._folders.within(
                self._path.parent, lambda: _try_lock(self._path, self._offset), parents=True)
        return self._lock is not None

    def renew(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            _unlock(lock)


def sweep_leases(root: Path, min_age: float, key: str | None = None) -> None:
    """Remove lease files (``leases/xx/<key>.lock``, one per key ever compiled) that no
    process holds and that are at least ``min_age`` seconds old; only ``key``'s when
    given. A held one is left (its compile is running)."""
    folder = root / "leases"
    paths = ([_key_file(root, key)] if key is not None
             else folder.glob("*/*.lock") if folder.is_dir() else [])
    now = time.time()
    for path in paths:
        with contextlib.suppress(OSError):
            if now - path.lstat().st_mtime < min_age or (lock := _try_lock(path)) is None:
                continue  # new, or held: a compile is running
            try:
                path.unlink()
            finally:
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
