"""What a trace reads from outside Python: files opened, directories listed, databases
connected, paths checked.

A function that reads a file while it traces (``json.load(open("cfg.json"))``,
``np.load("w.npy")``) bakes the file's content into the program. The static walk cannot see
that; the trace can. CPython's audit hooks (PEP 578, ``sys.addaudithook``) report every
``open`` (the builtin, ``io.open_code``, ``os.open``), ``os.listdir`` and ``os.scandir``
(``glob``, ``pathlib.Path.iterdir`` and ``os.walk`` use them) and ``sqlite3.connect`` before it
happens. While kiln traces, a :class:`ReadRecorder` collects the events of the tracing thread
and of the threads it starts while recording (a ``ThreadPoolExecutor`` the trace submits to:
``threading.Thread.start`` is wrapped while a recording is open, and a thread it starts runs
its ``run`` recorded), and the file reads of work the trace hands to another thread through
asyncio, which carries the trace's ``contextvars`` context there (``asyncio.to_thread``, a
coroutine run on another thread's event loop: zarr's local store reads its files so, in its
own loop thread and pool), and after the trace turns them into manifest items
(:func:`kiln._keys._manifest.check_manifest` re-checks them on a warm lookup):

- ``[path, "<file>", digest, stat]``: a file the trace opened for reading, by the xxh3-128
  digest of its content (``"absent"`` when it did not exist: a trace that falls back to a
  default when the file is missing). ``stat`` is ``"size:mtime_ns:inode:ctime_ns"``; a warm
  lookup stats the file and reads it again only when one of them moved (a file replaced by
  another of the same size and modification time, ``cp -p``, has another inode or change
  time). A file modified less than 2 seconds
  before the trace gets an empty ``stat`` and is always read (a later write within the same
  mtime tick would not move it: git's "racy" entries). A SQLite database (``sqlite3.connect``:
  SQLite opens the file in C, so no ``open`` event) is three such items: the database file and
  its ``-wal`` and ``-journal`` companions (committed pages not yet in the file; usually
  ``"absent"``); ``":memory:"``, ``""`` and a ``file:...?mode=memory`` URI are no file;
- ``[path, "<dir>", digest, stat]``: a directory the trace listed, by its sorted names;
- ``[path, "<stat>", value, how]``: a path the trace checked without opening it
  (``os.path.exists``, ``isfile``, ``isdir``, ``pathlib.Path.exists``, ``os.stat``,
  ``os.access``): ``os.stat``, ``os.lstat`` and ``os.access`` are wrapped while a recording is
  open. ``how`` says what the check could see, and ``value`` is that, re-computed on a warm
  lookup: ``"type"`` / ``"ltype"`` (an existence or type check: ``"absent"``, ``"file"``,
  ``"dir"``, ...), ``"ident"`` / ``"lident"`` (``os.path.samefile``, ``ismount``: type,
  device and inode), ``"stat"`` / ``"lstat"`` (a raw stat: mode, size, mtime, inode, device,
  links, owner; not the access and change times; a directory by type, device and inode only,
  as its size and mtime move with every entry added), ``"access:<mode>:..."`` (the answer).

``path`` is the path as the trace passed it: a relative path is checked relative to the
working directory of the process that looks the entry up, where the trace would open it.

Not recorded: reads of installed libraries' files (stdlib, site-packages: they count by
version, and by their ``RECORD``, :mod:`kiln._keys._libraries`), the import system importing a
module (a user module imported while tracing is a manifest item of its own; package data read
through a loader, ``pkgutil.get_data``, is the user's read), the source file of a loaded module
(``linecache`` formatting a warning: code is fingerprinted by the walk), kiln's store and JAX's
cache directory, and files opened for writing only.

What cannot be keyed makes the recording *unkeyable* (the function then takes the verify
path, with the reason): a socket, a pipe or a device (``/dev/urandom``; ``os.devnull`` is
fine), a file under ``/proc`` or ``/sys``, a file descriptor opened elsewhere, a file or a
checked path that changed during the trace, a network connection or a subprocess started while
tracing, a thread started without ``threading.Thread`` (``_thread.start_new_thread``; seen on
Python 3.12+).

Files a C library opens itself raise no audit event: the openers kiln knows are wrapped while a
recording is open (:mod:`._c_readers`).

Not seen (docs/never-stale.md, "What kiln cannot see"): reads that do not go through Python's
audited or wrapped calls (another C library calling ``fopen`` itself: GDAL, HDF5's external
links; a C-level reader bound by name before the recording, ``from netCDF4 import Dataset``,
``from pyarrow.csv import read_csv``, as ``from os import stat`` is; ``os.fstat``,
``os.readlink``, ``os.DirEntry.stat``), and reads by threads that were running before the trace
started (a ``ThreadPoolExecutor`` whose workers an earlier call started) unless asyncio carried
the trace's context there.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
import urllib.parse
from typing import Any

import xxhash

from . import _state
from ._c_readers import (
    _READER_MODULES,
    _inside_reader,
    _late,
    _reader_wrappers,
    _wrap_readers,
    is_probe,
)
from ._state import DIR, FILE, STAT, check_stat

__all__ = ["DIR", "FILE", "is_probe", "STAT", "ReadRecorder", "check_read", "check_stat",
           "content_digest", "racy"]


_READS = frozenset({"open", "os.listdir", "os.scandir"})
_DATABASE = "sqlite3.connect"
_RAW_THREAD = "_thread.start_new_thread"  # Python 3.12+ (threading.Thread.start raises it too)
_IMPORT = "import"  # a module about to be loaded (not raised for one in sys.modules)
# events whose outcome depends on the world outside the process: never keyable
_UNKEYABLE = {
    "socket.connect": "connects a socket",
    "socket.sendto": "sends on a socket",
    "urllib.Request": "opens a URL",
    "subprocess.Popen": "starts a subprocess",
    "os.system": "runs a shell command",
    "os.posix_spawn": "starts a process",
    "os.exec": "runs a program",
    "os.spawn": "starts a process",
}
_WATCHED = _READS | {_DATABASE, _RAW_THREAD, _IMPORT} | frozenset(_UNKEYABLE)

# a file changed this recently is always read again (racy): on a file system with whole-second
# times, and on one with finer times
_RACY_NS, _RACY_FINE_NS = 2_000_000_000, 50_000_000
_CHUNK = 1 << 20

_hook_installed = False


def _install_hook() -> None:
    """Add kiln's audit hook, once per process (audit hooks cannot be removed: while no
    recording is open the hook returns after one set lookup)."""
    global _hook_installed
    with _state._active_lock:
        if not _hook_installed:
            sys.addaudithook(_hook)
            _hook_installed = True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _WATCHED or not _state._active:
        return
    me = threading.get_ident()
    own = _state._active.get(me)
    recorders, borrowed = (tuple(own), False) if own else (_state._borrowed(), True)
    if not recorders or me in _state._busy:
        return  # (none; or kiln's own recording code: a directory tree walked for a reader)
    try:
        _record(event, args, recorders, borrowed)
    except Exception:  # noqa: BLE001 - an audit hook that raises would fail the user's call
        _state._give_up(recorders, f"kiln could not record a {event} event while tracing")


def _record(event: str, args: tuple[Any, ...], recorders: tuple[ReadRecorder, ...],
            borrowed: bool = False) -> None:
    if event == _IMPORT:
        if not borrowed and args[0] in _READER_MODULES:
            if _inside_reader(sys._getframe(2)):
                _late.add(args[0])  # a reader importing its own parts (pq.read_table imports
                # pyarrow.dataset): this call is keyed; its module is wrapped when it returns
            else:
                _state._give_up(recorders, f"the trace imports {args[0]}, whose file reads kiln "
                                "keys only when it was imported before the trace (import "
                                "it at the top of the module)")
        return
    if borrowed and event not in _READS and event != _DATABASE:
        return  # (see _state._borrowed)
    caller = _state._frame(2)  # _record <- _hook <- (the audited call, in C) <- its caller
    if event in _UNKEYABLE:
        if _state._caller_is_machinery(caller):
            return  # kiln's own connection (a Redis store read by a nested kiln call)
        _state._give_up(recorders, f"the trace {_UNKEYABLE[event]} ({event})")
        return
    if event == _RAW_THREAD:
        if isinstance(getattr(args[0], "__self__", None), threading.Thread):
            return  # threading.Thread.start: followed by its wrapper (_state._start_followed)
        if not _state._caller_is_machinery(caller):
            _state._give_up(recorders, f"the trace starts a thread kiln cannot follow ({event})")
        return
    if event == _DATABASE:
        paths = _database_files(args[0])
        if paths and not _state._caller_is_machinery(caller):
            for path in paths:
                _state._note(path, FILE, os.O_RDONLY, recorders)
        return
    path = args[0]
    access = os.O_RDONLY
    if event == "open":
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else os.O_RDONLY
        access = flags & os.O_ACCMODE
    elif path is None:
        path = "."
    if isinstance(path, int):
        if access == os.O_WRONLY or _state._caller_is_machinery(caller):
            return  # (a written fd is an output; os.fdopen in kiln's store writes)
        _state._give_up(recorders, f"the trace reads file descriptor {path} ({event})")
        return
    path = os.fsdecode(path)
    kind = FILE if event == "open" else DIR
    if access == os.O_RDONLY and all((path, kind) in r.seen for r in recorders):
        return  # read before, and recorded then (nothing to add; no frames to walk)
    full = _state._abspath(path)
    if _state._is_library_path(full) or _state._caller_is_machinery(caller):
        return
    _state._note(path, kind, access, recorders, full)


def _database_files(database: Any) -> list[str]:
    """The files a ``sqlite3.connect(database)`` reads (see the module doc). A ``file:`` URI
    (``uri=True``) names its path; as the audit event does not say whether ``uri=True`` was
    passed, the name as given is keyed too (SQLite opens it as a plain file name otherwise)."""
    if not isinstance(database, str | bytes | os.PathLike):
        return []
    name = os.fsdecode(database)
    names = [name]
    if name.startswith("file:"):
        rest, _, query = name[5:].partition("#")[0].partition("?")
        if rest.startswith("//"):  # file://[localhost]/abs/path
            rest = "/" + rest[2:].partition("/")[2]
        path = urllib.parse.unquote(rest)
        memory = "memory" in urllib.parse.parse_qs(query).get("mode", ())
        names = [] if memory or path in ("", ":memory:") else [path]
        names.append(name)
    return [n + suffix for n in names if n not in ("", ":memory:")
            for suffix in ("", "-wal", "-journal")]


def _wrap() -> None:
    """Put the wrappers in place (the first recording opened; under ``_state._active_lock``)."""
    _state._swap(_state._WRAPPERS, True)


def _unwrap() -> None:
    """Take the wrappers out again (the last recording closed; under ``_state._active_lock``)."""
    _state._swap((*_state._WRAPPERS, *_reader_wrappers.values()), False)


class ReadRecorder:
    """Records the files and directories this thread's trace reads, and the paths it checks
    (see the module doc), with those of the threads it starts while recording.

    Use as a context manager around the trace; nests. After exit, :meth:`items` gives the
    manifest items, or :attr:`unkeyable` says why there can be none.

    Args:
        ignore: directories whose files are not inputs of the program (kiln's store, JAX's
            cache directory).
    """

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = tuple(os.path.abspath(p) + os.sep for p in ignore)
        self.seen: dict[tuple[str, str], tuple[int, int, int, int, int] | None] = {}
        self.checked: dict[tuple[str, str], str] = {}  # (path, how) -> value
        self.written: set[str] = set()
        self.unkeyable: str | None = None
        self.thread = threading.get_ident()
        self.recording = False

    def __enter__(self) -> ReadRecorder:
        _install_hook()
        with _state._active_lock:
            self.recording = True
            _state._active.setdefault(self.thread, []).append(self)
            _state._open += 1
            if _state._open == 1:
                _wrap()
            _wrap_readers()  # (every time: a reader's library imported since the last one)
        _state._reading.set((*_state._reading.get(), self))
        return self

    def __exit__(self, *exc: Any) -> None:
        with _state._active_lock:
            if not self.recording:
                return
            self.recording = False
            for ident, stack in list(_state._active.items()):
                if self in stack:
                    stack.remove(self)
                if not stack:
                    del _state._active[ident]
            _state._open -= 1
            if _state._open == 0:
                _unwrap()
        _state._reading.set(tuple(r for r in _state._reading.get() if r is not self))

    def items(self) -> list[list[str]]:
        """Manifest items for what was read (sorted), checking that nothing changed since.

        Sets :attr:`unkeyable` (and returns ``[]``) when some read cannot be keyed.
        """
        out = []
        for (path, kind), before in sorted(list(self.seen.items())):
            full = os.path.abspath(path)
            now = _state._stat(full)
            if before != now or (kind == FILE and full in self.written):
                self.unkeyable = f"{path} changed while the function was traced"
            elif (reason := _unkeyable_path(full, now, kind)) is not None:
                self.unkeyable = f"the trace reads {path}: {reason}"
            if self.unkeyable:
                return []
            digest = content_digest(full, kind) if now is not None else "absent"
            out.append([path, kind, digest, _stat_text(now)])
        for (path, how), value in sorted(list(self.checked.items())):
            if _state._observe(how, os.path.abspath(path)) != value:
                self.unkeyable = f"{path} changed while the function was traced"
                return []
            out.append([path, STAT, value, how])
        return out


def _unkeyable_path(full: str, st: tuple[int, int, int, int, int] | None,
                    kind: str) -> str | None:
    if st is None:
        return None
    mode = st[0]
    if full.startswith(("/proc/", "/sys/")):
        return "its content is the system's state, not a file's"
    if kind == DIR:
        return None if stat.S_ISDIR(mode) else "it is not a directory"
    if stat.S_ISREG(mode) or full == os.devnull:
        return None
    what = ("a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    return f"it is {what}; its content cannot be keyed"


def racy(mtime_ns: int, ctime_ns: int) -> bool:
    """A file changed so recently that another change in the same clock tick would leave its
    stat as it is (git's "racy" entries): read it rather than trust its stat. The tick is the
    file system's: a whole second where its times have no fraction (FAT, HFS+, some network
    file systems: 2 s allowed), else a few milliseconds (50 ms allowed: ext4, XFS, tmpfs stamp
    times from the kernel's coarse clock)."""
    coarse = mtime_ns % 1_000_000_000 == 0 and ctime_ns % 1_000_000_000 == 0
    return time.time_ns() - max(mtime_ns, ctime_ns) < (_RACY_NS if coarse else _RACY_FINE_NS)


def _stat_text(st: tuple[int, int, int, int, int] | None) -> str:
    """``size:mtime_ns:inode:ctime_ns`` (a file replaced by another of the same size and
    modification time has another inode or change time), or ``""`` for a racy one."""
    if st is None or racy(st[2], st[4]):
        return ""
    return f"{st[1]}:{st[2]}:{st[3]}:{st[4]}"


def content_digest(full: str, kind: str = FILE) -> str:
    """The xxh3-128 digest of a file's content, or of a folder's sorted names (``DIR``)."""
    h = xxhash.xxh3_128()
    if kind == DIR:
        for name in sorted(os.listdir(full)):
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
    elif full != os.devnull:
        with open(full, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def check_read(path: str, kind: str, digest: str, stat_text: str) -> str | None:
    """None if ``path`` still reads as it did when the entry was made, else what changed (its
    content or listing is digested again unless its size and mtime are still ``stat_text``)."""
    full = os.path.abspath(path)
    now = _state._stat(full)
    if now is None:
        return None if digest == "absent" else f"{path} no longer exists"
    if digest == "absent":
        return f"{path} exists now (absent when the entry was made)"
    if stat_text and stat_text == _stat_text(now):
        return None
    try:
        if content_digest(full, kind) == digest:
            return None
    except OSError as e:
        return f"{path} cannot be read ({e})"
    return f"{'listing of ' if kind == DIR else ''}{path} changed"
