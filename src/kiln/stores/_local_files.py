"""The local store's files: its folders (refused when other users can change them, made 0700
once per process), entry files read without following links and written atomically, and
writers' temp files. :mod:`kiln.stores._local` describes the layout and what is trusted."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .._base import StoreError, is_key
from ._backend import check_key

__all__ = ["HOST", "Folders", "entry_path", "is_entry_file", "on_disk", "read_entry",
           "write_atomic"]

T = TypeVar("T")
_TEMP_MAX_AGE = 3600.0  # seconds: no write of one entry takes this long
HOST = socket.gethostname().replace(".", "_")[:32] or "host"


def entry_path(entries: Path, key: str) -> Path:
    """Where the entry of ``key`` lives under ``entries/``; raises ``ValueError`` for a name
    that is not a key."""
    return entries / check_key(key)[:2] / f"{key}.kiln"


def is_entry_file(p: Path) -> bool:
    """A regular file (not a link) named ``<hex key>.kiln``."""
    if not is_key(p.stem):
        return False
    try:
        return stat.S_ISREG(p.lstat().st_mode)
    except OSError:
        return False


def on_disk(entries: Path) -> dict[str, os.stat_result]:
    """key -> ``lstat`` of each entry file under ``entries/`` (what :func:`is_entry_file`
    accepts)."""
    found: dict[str, os.stat_result] = {}
    for path in entries.glob("*/*.kiln"):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if is_key(path.stem) and stat.S_ISREG(st.st_mode):
                found[path.stem] = st
    return found


class Folders:
    """The store's root and ``entries/``, and the folders under them this process made.

    :meth:`check` refuses a store other users can change; :meth:`make` makes a folder (0700)
    once per process while it stays; :meth:`within` runs a write there, again once when the
    folder was removed meanwhile (``kiln clear``, by hand)."""

    def __init__(self, root: Path, *, shared: bool) -> None:
        self.root = root
        self.entries = root / "entries"
        self.shared = shared
        self._checked = False
        self._ready: set[Path] = set()  # folders made (and swept) by this process

    def check(self) -> None:
        """Refuse a store that other users can change (see :mod:`kiln.stores._local`).

        Raises:
            StoreError: the root or ``entries/`` is writable by others or owned by another
                user, or the root is not a directory.
        """
        if self._checked:
            return
        me = os.geteuid()
        for d in (self.root, self.entries):
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
        self._checked = self.root.is_dir() and self.entries.is_dir()

    def make(self, folder: Path | None = None, *, sweep: bool = False,
             parents: bool = False) -> None:
        """Make the root and ``entries/`` (checked before and after), then ``folder`` (and its
        missing ``parents``; with ``sweep``, its abandoned temp files removed), where this
        process has not yet."""
        if self.root not in self._ready:
            self.check()
            for d in (self.root, self.entries):
                if not d.is_dir():
                    d.mkdir(mode=0o700, parents=True, exist_ok=True)
                    os.chmod(d, 0o700)
            self.check()
            self._ready.add(self.root)
        if folder is not None and folder not in self._ready:
            folder.mkdir(mode=0o700, parents=parents, exist_ok=True)
            if sweep:
                _sweep_temp_files(folder)
            self._ready.add(folder)

    def sweep(self) -> None:
        """Remove the abandoned temp files in every folder of ``entries/``."""
        if self.entries.is_dir():
            for sub in self.entries.iterdir():
                if sub.is_dir() and not sub.is_symlink():
                    _sweep_temp_files(sub)

    def forget(self) -> None:
        """Check and make every folder again (one was found gone)."""
        self._ready.clear()

    def within(self, folder: Path, act: Callable[[], T], *, sweep: bool = False,
               parents: bool = False) -> T:
        """``act()`` once ``folder`` is made (see :meth:`make`); made again and ``act()`` run
        again once when it fails with ``FileNotFoundError`` (the folder was removed since)."""
        try:
            self.make(folder, sweep=sweep, parents=parents)
            return act()
        except FileNotFoundError:
            self.forget()
        self.make(folder, sweep=sweep, parents=parents)
        return act()


def read_entry(path: Path, *, shared: bool) -> bytes | None:
    """The bytes of a regular file at ``path`` (never following a symlink, never reading past
    the size it had when opened; owned by this user unless ``shared``), or None when there is
    none."""
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
        if st.st_uid != os.geteuid() and not shared:
            raise OSError(errno.EPERM, f"entry {path} is owned by uid {st.st_uid}, not by "
                          "you: not read (set KILN_SIGNING_KEY for a shared store)")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read(st.st_size)


def write_atomic(path: Path, data: bytes, *, prefix: str | None = None,
                 entry: bool = True) -> None:
    """Write ``data`` to a temp file beside ``path`` (0600; ``<prefix><random>.tmp``, by default
    ``.<key prefix>.<host>.<pid>.<random>.tmp``), then ``os.replace`` it there; the temp file is
    removed on failure. ``entry``: ``path`` is a store's entry, so a directory where it goes
    (not an entry) is removed first."""
    if prefix is None:
        prefix = f".{path.stem[:16]}.{HOST}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # a directory where the entry goes: not an entry
            if not entry:
                raise
            shutil.rmtree(path)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
    if len(parts) == 6 and parts[2] == HOST and parts[3].isdigit():
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


def _sweep_temp_files(folder: Path) -> None:
    """Remove abandoned ``.*.tmp`` files in ``folder``."""
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        if _temp_is_abandoned(tmp, now):
            with contextlib.suppress(OSError):
                tmp.unlink()
