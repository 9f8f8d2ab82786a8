"""What a trace reads from outside Python: files opened and directories listed (issue 20).

A function that reads a file while it traces (``json.load(open("cfg.json"))``,
``np.load("w.npy")``) bakes the file's content into the program. The static walk cannot see
that; the trace can. CPython's audit hooks (PEP 578, ``sys.addaudithook``) report every
``open`` (the builtin, ``io.open_code``, ``os.open``), ``os.listdir`` and ``os.scandir``
(``glob``, ``pathlib.Path.iterdir`` and ``os.walk`` use them) before it happens. While kiln
traces, a :class:`ReadRecorder` collects the events of the tracing thread only, and after the
trace turns them into manifest items (:func:`kiln._keys._manifest.check_manifest` re-checks them
on a warm lookup):

- ``[path, "<file>", digest, stat]``: a file the trace opened for reading, by the xxh3-128
  digest of its content (``"absent"`` when it did not exist: a trace that falls back to a
  default when the file is missing). ``stat`` is ``"size:mtime_ns"``; a warm lookup stats the
  file and reads it again only when size or mtime moved. A file modified less than 2 seconds
  before the trace gets an empty ``stat`` and is always read (a later write within the same
  mtime tick would not move it: git's "racy" entries);
- ``[path, "<dir>", digest, stat]``: a directory the trace listed, by its sorted names.

``path`` is the path as the trace passed it: a relative path is checked relative to the
working directory of the process that looks the entry up, where the trace would open it.

Not recorded: reads of installed libraries' files (stdlib, site-packages: they count by
version), the import system's own reads (a user module imported while tracing is a manifest
item of its own), the source file of a loaded module (``linecache`` formatting a warning: code
is fingerprinted by the walk), kiln's store and JAX's cache directory, and files opened for
writing only.

What cannot be keyed makes the recording *unkeyable* (the function then takes the verify
path, with the reason): a socket, a pipe or a device (``/dev/urandom``; ``os.devnull`` is
fine), a file under ``/proc`` or ``/sys``, a file descriptor opened elsewhere, a file that
changed during the trace, a network connection or a subprocess started while tracing.

Reads that do not go through Python's audited calls (a C library calling ``fopen`` itself,
``os.stat`` / ``os.path.exists`` checks) are not seen: see README, "What kiln cannot see".
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from typing import Any

import xxhash

from ._libraries import KILN_ROOT, LIB_ROOTS

__all__ = ["DIR", "FILE", "ReadRecorder", "check_read"]

FILE = "<file>"
DIR = "<dir>"

_READS = frozenset({"open", "os.listdir", "os.scandir"})
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
_WATCHED = _READS | frozenset(_UNKEYABLE)
# stdlib modules whose reads are never a program's input: source shown in a warning or a
# traceback, and package metadata (importlib.metadata scans sys.path for distributions: what
# kiln counts by version)
_SOURCE_READERS = (f"{os.sep}linecache.py", f"{os.sep}tokenize.py",
                   f"{os.sep}importlib{os.sep}metadata{os.sep}__init__.py",
                   f"{os.sep}importlib{os.sep}metadata{os.sep}_adapters.py")
_RACY_NS = 2_000_000_000  # a file modified this recently is always re-read (mtime granularity)
_CHUNK = 1 << 20

_active: dict[int, list[ReadRecorder]] = {}  # thread id -> recorders open in that thread
_hook_lock = threading.Lock()
_hook_installed = False


def _install_hook() -> None:
    """Add kiln's audit hook, once per process (audit hooks cannot be removed: while no
    recording is open the hook returns after one set lookup)."""
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            sys.addaudithook(_hook)
            _hook_installed = True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _WATCHED or not _active:
        return
    recorders = _active.get(threading.get_ident())
    if not recorders:
        return
    try:
        _record(event, args, recorders)
    except Exception:  # noqa: BLE001 - an audit hook that raises would fail the user's call
        for r in recorders:
            r.unkeyable = r.unkeyable or f"kiln could not record a {event} event while tracing"


def _caller_is_machinery() -> bool:
    """The audited call is made for the import system, for kiln itself (its store: files,
    locks, a Redis connection, even through a library such as redis-py or filelock), by
    ``linecache`` reading source to show it (a warning, a formatted traceback), or by
    ``importlib.metadata`` looking up a distribution: the nearest
    frame outside the stdlib and site-packages is kiln's, or the way there passes the import
    system or ``linecache``. A library called by user code (``np.load``) is the user's read."""
    try:
        frame: Any = sys._getframe(3)  # _caller_is_machinery <- _record <- _hook <- the call
    except ValueError:  # called from C with no Python frame above
        return False
    for _ in range(64):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name.startswith(("<frozen importlib", "<frozen zipimport")) or (
                name.endswith(_SOURCE_READERS) and name.startswith(LIB_ROOTS)):
            return True
        if not (name.startswith("<frozen ") or name.startswith(LIB_ROOTS)):
            return name.startswith(KILN_ROOT)
        frame = frame.f_back
    return False


def _record(event: str, args: tuple[Any, ...], recorders: list[ReadRecorder]) -> None:
    if event in _UNKEYABLE:
        if _caller_is_machinery():
            return  # kiln's own connection (a Redis store read by a nested kiln call)
        for r in recorders:
            r.unkeyable = r.unkeyable or f"the trace {_UNKEYABLE[event]} ({event})"
        return
    path = args[0]
    access = os.O_RDONLY
    if event == "open":
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else os.O_RDONLY
        access = flags & os.O_ACCMODE
    elif path is None:
        path = "."
    if isinstance(path, int):
        if access == os.O_WRONLY or _caller_is_machinery():
            return  # (a written fd is an output; os.fdopen in kiln's store writes)
        for r in recorders:
            r.unkeyable = r.unkeyable or f"the trace reads file descriptor {path} ({event})"
        return
    path = os.fsdecode(path)
    full = os.path.abspath(path)
    if full.startswith(LIB_ROOTS) or f"{os.sep}__pycache__{os.sep}" in full:
        return
    if _caller_is_machinery():
        return
    kind = FILE if event == "open" else DIR
    if kind == FILE and full.endswith(".py") and _is_module_source(full):
        return  # source of loaded code (linecache, a warning's source line): code is walked
    for r in recorders:
        if full.startswith(r.ignore):
            continue
        if access != os.O_RDONLY:
            # written: an output of the trace, unless the trace also reads it (then what a
            # warm start would read is what this trace left behind, not what it found)
            r.written.add(full)
        if access != os.O_WRONLY and (path, kind) not in r.seen:
            r.seen[(path, kind)] = _stat(full)


def _is_module_source(full: str) -> bool:
    real = os.path.realpath(full)
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and (f == full or os.path.realpath(f) == real):
            return True
    return False


def _stat(full: str) -> tuple[int, int, int, int] | None:
    """(mode, size, mtime_ns, inode), or None when nothing is there."""
    try:
        st = os.stat(full)
    except OSError:
        return None
    return st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino


class ReadRecorder:
    """Records the files and directories this thread's trace reads (see the module doc).

    Use as a context manager around the trace; nests. After exit, :meth:`items` gives the
    manifest items, or :attr:`unkeyable` says why there can be none.

    Args:
        ignore: directories whose files are not inputs of the program (kiln's store, JAX's
            cache directory).
    """

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = tuple(os.path.abspath(p) + os.sep for p in ignore)
        self.seen: dict[tuple[str, str], tuple[int, int, int, int] | None] = {}
        self.written: set[str] = set()
        self.unkeyable: str | None = None
        self.thread = threading.get_ident()

    def __enter__(self) -> ReadRecorder:
        _install_hook()
        _active.setdefault(self.thread, []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _active.get(self.thread, [])
        if self in stack:
            stack.remove(self)
        if not stack:
            _active.pop(self.thread, None)

    def items(self) -> list[list[str]]:
        """Manifest items for what was read (sorted), checking that nothing changed since.

        Sets :attr:`unkeyable` (and returns ``[]``) when some read cannot be keyed.
        """
        out = []
        for (path, kind), before in sorted(self.seen.items()):
            full = os.path.abspath(path)
            now = _stat(full)
            if before != now or (kind == FILE and full in self.written):
                self.unkeyable = f"{path} changed while the function was traced"
            elif (reason := _unkeyable_path(full, now, kind)) is not None:
                self.unkeyable = f"the trace reads {path}: {reason}"
            if self.unkeyable:
                return []
            digest = _content_digest(full, kind) if now is not None else "absent"
            out.append([path, kind, digest, _stat_text(now)])
        return out


def _unkeyable_path(full: str, st: tuple[int, int, int, int] | None, kind: str) -> str | None:
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


def _stat_text(st: tuple[int, int, int, int] | None) -> str:
    if st is None or time.time_ns() - st[2] < _RACY_NS:
        return ""
    return f"{st[1]}:{st[2]}"


def _content_digest(full: str, kind: str) -> str:
    h = xxhash.xxh3_128()
    if kind == DIR:
        for name in sorted(os.listdir(full)):
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
        return h.hexdigest()
    if full == os.devnull:
        return h.hexdigest()
    with open(full, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_read(path: str, kind: str, digest: str, stat_text: str) -> str | None:
    """None if ``path`` still reads as it did when the entry was made, else what changed.

    A stat first: an unchanged size and mtime (``stat_text``) means unchanged content;
    otherwise the content (or listing) is digested again.
    """
    full = os.path.abspath(path)
    now = _stat(full)
    if now is None:
        return None if digest == "absent" else f"{path} no longer exists"
    if digest == "absent":
        return f"{path} exists now (absent when the entry was made)"
    if stat_text and stat_text == f"{now[1]}:{now[2]}":
        return None
    try:
        if _content_digest(full, kind) == digest:
            return None
    except OSError as e:
        return f"{path} cannot be read ({e})"
    return f"{'listing of ' if kind == DIR else ''}{path} changed"
