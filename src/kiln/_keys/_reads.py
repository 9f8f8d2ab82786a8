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
its ``run`` recorded), and after the trace turns them into manifest items
(:func:`kiln._keys._manifest.check_manifest` re-checks them on a warm lookup):

- ``[path, "<file>", digest, stat]``: a file the trace opened for reading, by the xxh3-128
  digest of its content (``"absent"`` when it did not exist: a trace that falls back to a
  default when the file is missing). ``stat`` is ``"size:mtime_ns"``; a warm lookup stats the
  file and reads it again only when size or mtime moved. A file modified less than 2 seconds
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

Not seen (docs/never-stale.md, "What kiln cannot see"): reads that do not go through Python's
audited or wrapped calls (a C library calling ``fopen`` itself: HDF5 through h5py; ``os.stat``
bound before the recording, ``from os import stat``; ``os.fstat``, ``os.readlink``,
``os.DirEntry.stat``), and reads by threads that were running before the trace started (a
``ThreadPoolExecutor`` whose workers an earlier call started).
"""

from __future__ import annotations

import genericpath
import os
import pathlib
import posixpath
import stat
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import xxhash

from ._libraries import KILN_ROOT, LIB_ROOTS

__all__ = ["DIR", "FILE", "is_probe", "STAT", "ReadRecorder", "check_read", "check_stat"]

FILE = "<file>"
DIR = "<dir>"
STAT = "<stat>"

_READS = frozenset({"open", "os.listdir", "os.scandir"})
_DATABASE = "sqlite3.connect"
_RAW_THREAD = "_thread.start_new_thread"  # Python 3.12+ (threading.Thread.start raises it too)
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
_WATCHED = _READS | {_DATABASE, _RAW_THREAD} | frozenset(_UNKEYABLE)
# stdlib modules whose reads are never a program's input: source shown in a warning or a
# traceback, and package metadata (importlib.metadata scans sys.path for distributions: what
# kiln counts by version)
_SOURCE_READERS = (f"{os.sep}linecache.py", f"{os.sep}tokenize.py",
                   f"{os.sep}importlib{os.sep}metadata{os.sep}__init__.py",
                   f"{os.sep}importlib{os.sep}metadata{os.sep}_adapters.py")
_IMPORT_SYSTEM = ("<frozen importlib", "<frozen zipimport")
_RACY_NS = 2_000_000_000  # a file modified this recently is always re-read (mtime granularity)
_CHUNK = 1 << 20

# the functions kiln wraps while a recording is open, as they were when kiln was imported
# (kiln's own checks call these, never its wrappers)
_os_stat, _os_lstat, _os_access = os.stat, os.lstat, os.access
_thread_start = threading.Thread.start

_active: dict[int, list[ReadRecorder]] = {}  # thread id -> recorders that thread reads for
_active_lock = threading.Lock()  # changes of _active, _open and the wrappers
_open = 0  # recordings open in the process: the wrappers are in place while > 0
_busy: set[int] = set()  # threads inside kiln's own recording code (it stats too)
_hook_installed = False


def _install_hook() -> None:
    """Add kiln's audit hook, once per process (audit hooks cannot be removed: while no
    recording is open the hook returns after one set lookup)."""
    global _hook_installed
    with _active_lock:
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
        _record(event, args, tuple(recorders))
    except Exception:  # noqa: BLE001 - an audit hook that raises would fail the user's call
        _give_up(tuple(recorders), f"kiln could not record a {event} event while tracing")


def _give_up(recorders: tuple[ReadRecorder, ...], reason: str) -> None:
    for r in recorders:
        r.unkeyable = r.unkeyable or reason


def _caller_is_machinery(frame: Any) -> bool:
    """The audited call is made for the import system importing a module, for kiln itself
    (its store: files, locks, a Redis connection, even through a library such as redis-py or
    filelock), by ``linecache`` reading source to show it (a warning, a formatted traceback),
    or by ``importlib.metadata`` looking up a distribution: the nearest frame outside the
    stdlib and site-packages is kiln's, or the way there passes the import system or
    ``linecache``. ``frame``: the frame that made the call. A library called by user code
    (``np.load``) is the user's read, and so is a loader's ``get_data`` called from outside
    the import system (``pkgutil.get_data(__name__, "coeffs.txt")``, a resource reader): the
    package data it returns is the program's input, not a module being imported."""
    for _ in range(64):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name.startswith(_IMPORT_SYSTEM):
            top = frame  # the import system's outermost frame on this way
            while top.f_back is not None and top.f_back.f_code.co_filename.startswith(
                    _IMPORT_SYSTEM):
                top = top.f_back
            if top.f_code.co_name != "get_data":
                return True
            frame = top.f_back
            continue
        if name.endswith(_SOURCE_READERS) and name.startswith(LIB_ROOTS):
            return True
        if frame.f_code is _RUN_RECORDED:
            return False  # the bottom of a thread the trace started (_follow): the trace's
        if not (name.startswith("<frozen ") or name.startswith(LIB_ROOTS)):
            return name.startswith(KILN_ROOT)
        frame = frame.f_back
    return False


def _record(event: str, args: tuple[Any, ...], recorders: tuple[ReadRecorder, ...]) -> None:
    try:
        caller = sys._getframe(2)  # _record <- _hook <- (the audited call, in C) <- its caller
    except ValueError:  # called from C with no Python frame above
        caller = None
    if event in _UNKEYABLE:
        if _caller_is_machinery(caller):
            return  # kiln's own connection (a Redis store read by a nested kiln call)
        _give_up(recorders, f"the trace {_UNKEYABLE[event]} ({event})")
        return
    if event == _RAW_THREAD:
        if isinstance(getattr(args[0], "__self__", None), threading.Thread):
            return  # threading.Thread.start: followed by its wrapper (_start_followed)
        if not _caller_is_machinery(caller):
            _give_up(recorders, f"the trace starts a thread kiln cannot follow ({event})")
        return
    if event == _DATABASE:
        paths = _database_files(args[0])
        if paths and not _caller_is_machinery(caller):
            for path in paths:
                _note(path, FILE, os.O_RDONLY, recorders)
        return
    path = args[0]
    access = os.O_RDONLY
    if event == "open":
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else os.O_RDONLY
        access = flags & os.O_ACCMODE
    elif path is None:
        path = "."
    if isinstance(path, int):
        if access == os.O_WRONLY or _caller_is_machinery(caller):
            return  # (a written fd is an output; os.fdopen in kiln's store writes)
        _give_up(recorders, f"the trace reads file descriptor {path} ({event})")
        return
    path = os.fsdecode(path)
    if _is_library_path(os.path.abspath(path)) or _caller_is_machinery(caller):
        return
    _note(path, FILE if event == "open" else DIR, access, recorders)


def _is_library_path(full: str) -> bool:
    return full.startswith(LIB_ROOTS) or f"{os.sep}__pycache__{os.sep}" in full


def _note(path: str, kind: str, access: int, recorders: tuple[ReadRecorder, ...]) -> None:
    """Record that the trace read ``path`` (the machinery and library checks are done)."""
    full = os.path.abspath(path)
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


def _database_files(database: Any) -> list[str]:
    """The files a ``sqlite3.connect(database)`` reads: the database and its ``-wal`` and
    ``-journal`` companions; none for an in-memory or a temporary database. A ``file:`` URI
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


# -- checks that open nothing: os.stat, os.lstat, os.access -----------------------------------


def _codes(*fns: Any) -> frozenset[Any]:
    return frozenset(c for f in fns if (c := getattr(f, "__code__", None)) is not None)


# callers that look at the type of what is there only (exists, isfile, ...): keyed by that type
_TYPE_CHECKS = _codes(
    genericpath.exists, genericpath.isfile, genericpath.isdir,
    getattr(genericpath, "islink", None), posixpath.islink, posixpath.lexists,
    posixpath.realpath, getattr(posixpath, "_joinrealpath", None),  # (lstat: is it a link?)
    *(getattr(pathlib.Path, n, None) for n in (
        "exists", "is_file", "is_dir", "is_symlink", "is_block_device", "is_char_device",
        "is_fifo", "is_socket")),
)
# callers that compare what two paths are (samefile, ismount): keyed by type, device and inode
_IDENT_CHECKS = _codes(genericpath.samefile, posixpath.ismount)
_PASS_THROUGH = _codes(pathlib.Path.stat, pathlib.Path.lstat)  # the caller's caller decides
_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link",
          stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char-device",
          stat.S_IFBLK: "block-device"}


def _stat_value(how: str, st: os.stat_result) -> str:
    kind = _TYPES.get(stat.S_IFMT(st.st_mode), "other")
    if how in ("type", "ltype"):
        return kind
    if how in ("ident", "lident") or kind == "dir":
        # what a path is, not what it holds: a directory's size, mtime and link count move
        # whenever an entry is added (a listing is recorded apart, by its names), and jax's
        # traceback filter compares paths with os.path.samefile while tracing (jax 0.12)
        return f"{kind}:{st.st_dev}:{st.st_ino}"
    return (f"{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}:"
            f"{st.st_nlink}:{st.st_uid}:{st.st_gid}")


def _error_value(how: str, e: OSError) -> str:
    return "absent" if how in ("type", "ltype", "ident", "lident") else f"error:{e.errno}"


def _observe(how: str, full: str) -> str:
    """What a check ``how`` of ``full`` sees now (kiln's own, unwrapped calls)."""
    if how.startswith("access:"):
        _, mode, effective, follow = how.split(":")
        return str(int(_os_access(full, int(mode), effective_ids=effective == "1",
                                  follow_symlinks=follow == "1")))
    try:
        st = _os_stat(full) if how in ("type", "stat", "ident") else _os_lstat(full)
    except OSError as e:
        return _error_value(how, e)
    return _stat_value(how, st)


def _probe(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """``original`` (``os.stat``, ``os.lstat`` or ``os.access``), recording for the threads that
    read for a recording what the call saw (``kind``: ``"stat"``, ``"lstat"`` or
    ``"access"``); every other call costs a dict lookup."""

    def probe(path: Any, *args: Any, **kwargs: Any) -> Any:
        if _active:
            me = threading.get_ident()
            recorders = _active.get(me)
            if recorders and me not in _busy:
                return _probed(original, kind, path, args, kwargs, tuple(recorders), me)
        return original(path, *args, **kwargs)

    # named as ``os.<name>``, which it is while a recording is open, so pickle finds it
    # there; kiln's walk takes it for the original (``is_probe``: a module that imported it
    # while tracing, ``from os import stat``, holds the probe for good)
    probe.__name__ = probe.__qualname__ = original.__name__
    probe.__module__ = "os"
    probe.__doc__ = original.__doc__
    probe.__wrapped__ = original  # type: ignore[attr-defined]
    return probe


def is_probe(fn: Any) -> bool:
    """``fn`` is one of the wrappers of ``os.stat`` / ``lstat`` / ``access`` (its
    ``__wrapped__`` is the original)."""
    return getattr(fn, "__code__", None) is _PROBE_CODE


def _probed(original: Callable[..., Any], kind: str, path: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], recorders: tuple[ReadRecorder, ...], me: int) -> Any:
    try:
        caller = sys._getframe(2)  # _probed <- probe <- the caller of os.stat
    except ValueError:
        caller = None
    try:
        result = original(path, *args, **kwargs)
    except OSError as e:
        _busy.add(me)
        try:
            _note_check(kind, path, args, kwargs, None, e, recorders, caller)
        finally:
            _busy.discard(me)
        raise
    _busy.add(me)
    try:
        _note_check(kind, path, args, kwargs, result, None, recorders, caller)
    finally:
        _busy.discard(me)
    return result


def _note_check(kind: str, path: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any, error: OSError | None, recorders: tuple[ReadRecorder, ...],
                caller: Any) -> None:
    try:
        if isinstance(path, int) or not isinstance(path, str | bytes | os.PathLike):
            return  # a file descriptor (os.fstat): what it reads was recorded when opened
        path = os.fsdecode(path)
        full = os.path.abspath(path)
        if _is_library_path(full):
            return
        if kwargs.get("dir_fd") is not None and not os.path.isabs(path):
            if not _caller_is_machinery(caller):
                _give_up(recorders, f"the trace checks {path} relative to a directory "
                                    "descriptor (dir_fd)")
            return
        if kind == "access":
            mode = args[0] if args else kwargs.get("mode", 0)
            how = (f"access:{int(mode)}:{int(bool(kwargs.get('effective_ids', False)))}:"
                   f"{int(bool(kwargs.get('follow_symlinks', True)))}")
            value = str(int(bool(result)))
        else:
            follow = kind == "stat" and kwargs.get("follow_symlinks", True)
            frame = caller
            while frame is not None and frame.f_code in _PASS_THROUGH:
                frame = frame.f_back
            typed = frame is not None and frame.f_code in _TYPE_CHECKS
            ident = frame is not None and frame.f_code in _IDENT_CHECKS
            how = ("" if follow else "l") + ("type" if typed else "ident" if ident else "stat")
            value = _error_value(how, error) if error is not None else _stat_value(how, result)
        if _caller_is_machinery(caller):
            return
        if full.endswith(".py") and _is_module_source(full):
            return
        for r in recorders:
            if not (full + os.sep).startswith(r.ignore):
                r.checked.setdefault((path, how), value)
    except Exception:  # noqa: BLE001 - never into the user's call
        _give_up(recorders, f"kiln could not record a check of {path!r} while tracing")


# -- threads the trace starts -------------------------------------------------------------


def _start_followed(self: threading.Thread) -> None:
    """``threading.Thread.start`` while a recording is open: a thread started by a thread that
    reads for a recording reads for it too, from its first instruction (its ``run`` is
    wrapped before it starts) until the recording closes."""
    if _active:
        recorders = _active.get(threading.get_ident())
        if recorders:
            try:
                caller = sys._getframe(1)
            except ValueError:
                caller = None
            if not _caller_is_machinery(caller):
                _follow(self, tuple(recorders))
    _thread_start(self)


def _follow(thread: threading.Thread, recorders: tuple[ReadRecorder, ...]) -> None:
    run = thread.run

    def run_recorded() -> None:
        me = threading.get_ident()
        with _active_lock:
            live = [r for r in recorders if r.recording]
            if live:
                _active.setdefault(me, []).extend(live)
        try:
            run()
        finally:
            with _active_lock:
                stack = _active.get(me, [])
                for r in live:
                    if r in stack:
                        stack.remove(r)
                if not stack:
                    _active.pop(me, None)
            thread.__dict__.pop("run", None)

    try:
        thread.run = run_recorded  # type: ignore[method-assign]
    except AttributeError:
        _give_up(recorders, f"the trace starts a thread kiln cannot follow ({thread!r})")


_PROBE_CODE = next(c for c in _probe.__code__.co_consts
                   if getattr(c, "co_name", None) == "probe")
_RUN_RECORDED = next(c for c in _follow.__code__.co_consts
                     if getattr(c, "co_name", None) == "run_recorded")


_WRAPPERS: list[tuple[Any, str, Any, Any]] = [  # (owner, name, original, wrapper)
    (os, "stat", _os_stat, _probe(_os_stat, "stat")),
    (os, "lstat", _os_lstat, _probe(_os_lstat, "lstat")),
    (os, "access", _os_access, _probe(_os_access, "access")),
    (threading.Thread, "start", _thread_start, _start_followed),
]
for _owner, _name, _original, _wrapper in _WRAPPERS:
    if _owner is os:
        # os.supports_dir_fd and friends list the functions that take those arguments
        # (shutil.rmtree picks its safe, descriptor-based walk by them)
        for _set in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks,
                     os.supports_effective_ids):
            if _original in _set:
                _set.add(_wrapper)


def _wrap() -> None:
    """Put the wrappers in place (the first recording opened; under ``_active_lock``). One
    that someone else replaced since kiln was imported is left as it is (that check is then
    not seen)."""
    for owner, name, original, wrapper in _WRAPPERS:
        if owner.__dict__.get(name) is original:
            setattr(owner, name, wrapper)


def _unwrap() -> None:
    """Take the wrappers out again (the last recording closed; under ``_active_lock``)."""
    for owner, name, original, wrapper in _WRAPPERS:
        if owner.__dict__.get(name) is wrapper:
            setattr(owner, name, original)


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
        st = _os_stat(full)
    except OSError:
        return None
    return st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino


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
        self.seen: dict[tuple[str, str], tuple[int, int, int, int] | None] = {}
        self.checked: dict[tuple[str, str], str] = {}  # (path, how) -> value
        self.written: set[str] = set()
        self.unkeyable: str | None = None
        self.thread = threading.get_ident()
        self.recording = False

    def __enter__(self) -> ReadRecorder:
        global _open
        _install_hook()
        with _active_lock:
            self.recording = True
            _active.setdefault(self.thread, []).append(self)
            _open += 1
            if _open == 1:
                _wrap()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _open
        with _active_lock:
            if not self.recording:
                return
            self.recording = False
            for ident, stack in list(_active.items()):
                if self in stack:
                    stack.remove(self)
                if not stack:
                    del _active[ident]
            _open -= 1
            if _open == 0:
                _unwrap()

    def items(self) -> list[list[str]]:
        """Manifest items for what was read (sorted), checking that nothing changed since.

        Sets :attr:`unkeyable` (and returns ``[]``) when some read cannot be keyed.
        """
        out = []
        for (path, kind), before in sorted(list(self.seen.items())):
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
        for (path, how), value in sorted(list(self.checked.items())):
            if _observe(how, os.path.abspath(path)) != value:
                self.unkeyable = f"{path} changed while the function was traced"
                return []
            out.append([path, STAT, value, how])
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


def check_stat(path: str, value: str, how: str) -> str | None:
    """None if a check ``how`` of ``path`` (an ``os.path.exists``, an ``os.stat``) still sees
    ``value``, as the trace saw it when the entry was made, else what changed."""
    try:
        now = _observe(how, os.path.abspath(path))
    except (OSError, ValueError) as e:
        return f"{path} cannot be checked ({e})"
    if now == value:
        return None
    if value == "absent":
        return f"{path} exists now (absent when the entry was made)"
    if now == "absent":
        return f"{path} no longer exists"
    return f"{path} changed ({how}: {value} -> {now})"
