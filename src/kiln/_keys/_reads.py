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

Files a C library opens itself raise no audit event. For the readers kiln knows, the opener is
wrapped while a recording is open (only when its library is already imported: kiln imports
none of them), and the file it names is keyed as a Python read is: h5py (``h5py.File``:
``h5py._hl.files.make_fid``), netCDF4 (``netCDF4.Dataset``, ``netCDF4.MFDataset``), pyarrow
(``pyarrow.parquet``: ``ParquetFile``, ``ParquetDataset``, so ``read_table`` and
``read_pandas``; ``read_metadata``, ``read_schema``; ``pyarrow.memory_map``,
``pyarrow.OSFile``, ``pyarrow.input_stream``, ``pyarrow.feather.read_table`` /
``read_feather``, ``pyarrow.csv.read_csv`` / ``open_csv``, ``pyarrow.json.read_json``,
``pyarrow.ipc``'s readers, ``pyarrow.orc.ORCFile`` / ``read_table``,
``pyarrow.dataset.dataset``); a directory given to one of them (a partitioned dataset) by its
whole tree (each directory's listing, each file's content). A wrapped function that a module
imported while a recording was open holds for good is taken for the original by the walk
(:func:`is_probe`). A source that is not a local file (an ``s3://`` URL, an OPeNDAP address,
pyarrow's S3 file system, an HDF5 driver that reads several files or a remote one) makes the
recording unkeyable, and so does the first import of one of these modules while tracing (its
opener is not wrapped yet), unless a wrapped reader imports it (``pq.read_table`` imports
``pyarrow.dataset``: that call is keyed, and the module is wrapped when it returns).

Not seen (docs/never-stale.md, "What kiln cannot see"): reads that do not go through Python's
audited or wrapped calls (another C library calling ``fopen`` itself: GDAL, HDF5's external
links; a C-level reader bound by name before the recording, ``from netCDF4 import Dataset``,
``from pyarrow.csv import read_csv``, as ``from os import stat`` is; ``os.fstat``,
``os.readlink``, ``os.DirEntry.stat``), and reads by threads that were running before the trace
started (a ``ThreadPoolExecutor`` whose workers an earlier call started) unless asyncio carried
the trace's context there.
"""

from __future__ import annotations

import contextvars
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
from typing import Any, NamedTuple

import xxhash

from ._libraries import KILN_ROOT, LIB_ROOTS

__all__ = ["DIR", "FILE", "is_probe", "STAT", "ReadRecorder", "check_read", "check_stat"]

FILE = "<file>"
DIR = "<dir>"
STAT = "<stat>"

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
# the recorders of the thread that set it, in its context: asyncio carries a context to another
# thread (asyncio.to_thread, a task run on another thread's event loop), and the file reads made
# there count for those recorders (zarr's local store reads in its own loop thread and pool)
_reading: contextvars.ContextVar[tuple[ReadRecorder, ...]] = contextvars.ContextVar(
    "kiln_reading", default=())
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
    me = threading.get_ident()
    own = _active.get(me)
    if own:
        recorders, borrowed = tuple(own), False
    else:
        recorders, borrowed = _borrowed(), True
        if not recorders:
            return
    if me in _busy:
        return  # kiln's own recording code (a directory tree walked for a reader)
    try:
        _record(event, args, recorders, borrowed)
    except Exception:  # noqa: BLE001 - an audit hook that raises would fail the user's call
        _give_up(recorders, f"kiln could not record a {event} event while tracing")


def _borrowed() -> tuple[ReadRecorder, ...]:
    """The recordings this thread reads for through its context (see ``_reading``): work the
    trace handed over through asyncio. Only its file reads count (a socket its loop connects
    may be kiln's own store's, reached through fsspec while the trace runs)."""
    rs = _reading.get()
    return tuple(r for r in rs if r.recording) if rs else ()


def _recorders_here(me: int) -> tuple[ReadRecorder, ...]:
    """The recordings the thread ``me`` reads for, its own or through its context."""
    own = _active.get(me)
    return tuple(own) if own else _borrowed()


def _give_up(recorders: tuple[ReadRecorder, ...], reason: str) -> None:
    for r in recorders:
        r.unkeyable = r.unkeyable or reason


# What a frame's code is, for the walk of _caller_is_machinery, by its file. A frame's code
# (``frame.f_code``) raises an audit event ("object.__getattr__") that calls every audit hook in
# the process, ~0.25 us a frame; its globals do not: a frame of a module's code is known by
# its module's globals (two dict lookups; ``id()`` raises an audit event too), and only other
# frames (``exec``-ed code, ``python -c``) by their code's file name. Code a module generates (a
# dataclass's ``__init__``, file "<string>") counts as that module's.
_LIB, _IMPORTING, _SOURCE, _KILN, _USER = range(5)
_kinds: dict[str, int] = {}  # file name -> kind
_module_kinds: dict[Any, tuple[dict[str, Any], int]] = {}  # module name -> (its globals, kind)
_MAX_KINDS = 1 << 16
_IMPORT_MODULES = frozenset({"importlib._bootstrap", "importlib._bootstrap_external",
                             "zipimport"})


def _file_kind(name: str) -> int:
    kind = _kinds.get(name)
    if kind is None:
        if name.startswith(_IMPORT_SYSTEM):
            kind = _IMPORTING
        elif name.endswith(_SOURCE_READERS) and name.startswith(LIB_ROOTS):
            kind = _SOURCE
        elif name.startswith("<frozen ") or name.startswith(LIB_ROOTS):
            kind = _LIB
        elif name.startswith(KILN_ROOT):
            kind = _KILN
        else:
            kind = _USER
        if len(_kinds) < _MAX_KINDS:
            _kinds[name] = kind
    return kind


def _frame_kind(frame: Any) -> int:
    g: dict[str, Any] = frame.f_globals
    name = g.get("__name__")
    known = _module_kinds.get(name)
    if known is not None and known[0] is g:
        return known[1]
    module = sys.modules.get(name) if isinstance(name, str) else None
    file = g.get("__file__")
    if module is None or getattr(module, "__dict__", None) is not g:
        return _file_kind(frame.f_code.co_filename)  # not a module's own globals
    if name in _IMPORT_MODULES:
        kind = _IMPORTING
    elif isinstance(file, str):
        kind = _file_kind(file)
    else:
        return _file_kind(frame.f_code.co_filename)
    if len(_module_kinds) < _MAX_KINDS:
        _module_kinds[name] = (g, kind)
    return kind


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
    modules = _module_kinds
    for _ in range(64):
        if frame is None:
            return False
        g = frame.f_globals
        known = modules.get(g.get("__name__"))
        kind = known[1] if known is not None and known[0] is g else _frame_kind(frame)
        if kind == _LIB:
            frame = frame.f_back
            continue
        if kind == _IMPORTING:
            top = frame  # the import system's outermost frame on this way
            while top.f_back is not None and _frame_kind(top.f_back) == _IMPORTING:
                top = top.f_back
            if top.f_code.co_name != "get_data":
                return True
            frame = top.f_back
            continue
        if kind == _SOURCE:
            return True
        if kind == _KILN and frame.f_code is _RUN_RECORDED:
            return False  # the bottom of a thread the trace started (_follow): the trace's
        return kind == _KILN
    return False


def _record(event: str, args: tuple[Any, ...], recorders: tuple[ReadRecorder, ...],
            borrowed: bool = False) -> None:
    if event == _IMPORT:
        if not borrowed and args[0] in _READER_MODULES:
            if _inside_reader(sys._getframe(2)):
                _late.add(args[0])  # a reader importing its own parts (pq.read_table imports
                # pyarrow.dataset): this call is keyed; its module is wrapped when it returns
            else:
                _give_up(recorders, f"the trace imports {args[0]}, whose file reads kiln keys "
                                    "only when it was imported before the trace (import it "
                                    "at the top of the module)")
        return
    if borrowed and event not in _READS and event != _DATABASE:
        return  # (see _borrowed)
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
    kind = FILE if event == "open" else DIR
    if access == os.O_RDONLY and all((path, kind) in r.seen for r in recorders):
        return  # read before, and recorded then (nothing to add; no frames to walk)
    full = _abspath(path)
    if _is_library_path(full) or _caller_is_machinery(caller):
        return
    _note(path, kind, access, recorders, full)


def _abspath(path: str) -> str:
    """``os.path.abspath(path)``, without its work for a path that is absolute and normal."""
    return path if _is_normal(path) else os.path.abspath(path)


def _is_normal(path: str) -> bool:
    """``path`` is absolute and normal: ``os.path.abspath`` would return it unchanged."""
    return (path[:1] == os.sep and _DOUBLE_SEP not in path and _DOT not in path
            and _DOTDOT not in path and not path.endswith(_NOT_AT_END))


_DOUBLE_SEP, _DOT, _DOTDOT = os.sep * 2, f"{os.sep}.{os.sep}", f"{os.sep}..{os.sep}"
_NOT_AT_END = (os.sep, f"{os.sep}.", f"{os.sep}..")
_PYCACHE = f"{os.sep}__pycache__{os.sep}"


def _is_library_path(full: str) -> bool:
    return full.startswith(LIB_ROOTS) or _PYCACHE in full


def _note(path: str, kind: str, access: int, recorders: tuple[ReadRecorder, ...],
          full: str | None = None) -> None:
    """Record that the trace read ``path`` (the machinery and library checks are done);
    ``full``: its absolute path, where the caller has it."""
    if full is None:
        full = _abspath(path)
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
        if _active and not (path.__class__ is str and path.startswith(LIB_ROOTS)
                            and _is_normal(path)):  # (an installed library's file)
            me = threading.get_ident()
            if me not in _busy:
                recorders = _recorders_here(me)
                if recorders:
                    return _probed(original, kind, path, args, kwargs, recorders, me)
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
    """``fn`` is one of the wrappers of ``os.stat`` / ``lstat`` / ``access``, or of a C
    library's reader (``pyarrow.csv.read_csv``; its ``__wrapped__`` is the original: a module
    that imported it while a recording was open holds the wrapper for good)."""
    code = getattr(fn, "__code__", None)
    return code is _PROBE_CODE or code is _READER_CODE


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
        full = _abspath(path)
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
        if all((path, how) in r.checked for r in recorders):
            return  # checked before, and recorded then (jax's traceback filter compares the
            # same directories thousands of times in a trace: no frames to walk for those)
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
        _reading.set(tuple(live))  # (this thread's own context: work it hands on through asyncio)
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
    for owner, name, original, wrapper in _reader_wrappers.values():
        if owner.__dict__.get(name) is wrapper:
            setattr(owner, name, original)


# -- files C libraries open themselves: their known openers, wrapped while recording ---------


class _NotLocal(Exception):
    """A reader's source is not a local file (a URL, a remote file system)."""


_Reads = list[tuple[str, int]]  # (path, access): what one call of a reader opens


class _Reader(NamedTuple):
    """An opener of a C library: the attribute ``name`` of ``module`` (of its class ``owner``,
    when given), whose calls open what ``reads(args, kwargs)`` says."""

    module: str
    owner: str
    name: str
    reads: Callable[[tuple[Any, ...], dict[str, Any]], _Reads]


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int | None, name: str,
         default: Any = None) -> Any:
    if at is not None and len(args) > at:
        return args[at]
    return kwargs.get(name, default)


def _local(source: Any, *, expand: bool = False) -> str | None:
    """The local path a reader's ``source`` names, None for what is no path (an open file, a
    buffer: read through Python, or in memory). A ``scheme://`` name that is no local file is
    a URL: a ``file://`` one names a local path, any other raises :class:`_NotLocal`.
    ``expand``: the reader expands ``~`` (pyarrow)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, bytes):
        source = os.fsdecode(source)
    if not isinstance(source, str):
        return None
    if expand:
        source = os.path.expanduser(source)
    if "://" in source and _stat(_abspath(source)) is None:
        if source[:7].lower() != "file://":
            raise _NotLocal(source)
        source = urllib.parse.unquote(urllib.parse.urlsplit(source).path)
    return source


def _access(mode: Any) -> int:
    """What an HDF5 or netCDF ``mode`` does to the file: ``"r"`` reads, ``"w"``, ``"w-"``,
    ``"x"`` create it, ``"r+"``, ``"a"`` read and write it (``"s"``: shared, the same)."""
    mode = str(mode or "r")
    if mode in ("r", "rs"):
        return os.O_RDONLY
    return os.O_WRONLY if mode.startswith(("w", "x")) else os.O_RDWR


def _h5py_fid(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reads:
    """``h5py._hl.files.make_fid(name, mode, userblock_size, fapl, ...)``, which every
    ``h5py.File(name, mode)`` of a file name calls (a Python file object is read through
    Python; ``File.in_memory`` opens no file)."""
    name, mode, fapl = (_arg(args, kwargs, 0, "name"), _arg(args, kwargs, 1, "mode"),
                        _arg(args, kwargs, 3, "fapl"))
    h5fd = sys.modules.get("h5py.h5fd")
    if h5fd is not None and fapl is not None:
        driver = fapl.get_driver()
        if driver == h5fd.fileobj_driver:
            return []
        one_file = {getattr(h5fd, n, None) for n in ("SEC2", "STDIO", "CORE", "DIRECT", "LOG",
                                                     "WINDOWS")}
        if driver not in one_file:
            named = next((n.lower() for n in ("FAMILY", "MULTI", "MPIO", "MPIPOSIX", "ROS3D")
                          if getattr(h5fd, n, None) == driver), str(driver))
            raise _NotLocal(f"{os.fsdecode(name)!r} (HDF5 driver {named})")
    if not isinstance(name, bytes | str):
        return []
    return [(os.fsdecode(name), _access(mode))]  # (a name, never a URL, for these drivers)


def _netcdf_dataset(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reads:
    """``netCDF4.Dataset(filename, mode="r", ..., memory=None, ...)``: an OPeNDAP or NCZarr
    address is no local file; ``memory`` is a file in memory."""
    if _arg(args, kwargs, 7, "memory") is not None:
        return []
    path = _local(_arg(args, kwargs, 0, "filename"))
    return [(path, _access(_arg(args, kwargs, 1, "mode", "r")))] if path else []


def _netcdf_mfdataset(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reads:
    """``netCDF4.MFDataset.__init__(self, files, check, aggdim, exclude, master_file)``:
    ``files`` a list of names or a pattern (MFDataset globs it; its listing is recorded as
    it lists)."""
    import glob

    files = _arg(args, kwargs, 1, "files")
    if isinstance(files, str | bytes | os.PathLike):
        files = sorted(glob.glob(os.fsdecode(files)))
    names = [*(files or ()), _arg(args, kwargs, 5, "master_file")]
    return [(p, os.O_RDONLY) for n in names if (p := _local(n)) is not None]


def _pyarrow_prefix(fs: Any) -> str:
    """The local folder a file system given to pyarrow reads under ("" for the local file
    system itself); raises :class:`_NotLocal` for any other (S3, GCS, HDFS, a remote fsspec
    file system)."""
    fsmod = sys.modules.get("pyarrow._fs")
    if fsmod is not None and isinstance(fs, fsmod.FileSystem):
        if isinstance(fs, fsmod.LocalFileSystem):
            return ""
        if isinstance(fs, fsmod.SubTreeFileSystem):
            return os.path.join(_pyarrow_prefix(fs.base_fs) or os.sep, fs.base_path)
        if isinstance(fs, fsmod.PyFileSystem):  # (FSSpecHandler(fs))
            return _pyarrow_prefix(getattr(fs.handler, "fs", None))
    protocol = getattr(fs, "protocol", None)  # an fsspec file system
    if protocol is not None and {"file", "local"} & set(
            (protocol,) if isinstance(protocol, str) else protocol):
        return ""
    raise _NotLocal(f"a file on {type(fs).__name__}")


def _pyarrow_source(at: int, name: str, *, fs_at: int | None = None,
                    mode_at: int | None = None) -> Callable[..., _Reads]:
    """What a pyarrow reader whose source is argument ``at`` (``name``) opens: a path, a
    ``file://`` URL, a list of them (a dataset), under its ``filesystem`` argument if any."""

    def reads(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reads:
        source = _arg(args, kwargs, at, name)
        fs = _arg(args, kwargs, fs_at, "filesystem")
        mode = str(_arg(args, kwargs, mode_at, "mode", "r") if mode_at is not None else "r")
        # "r" / "rb" read, "w" / "wb" / "a" / "ab" write, "r+" (memory_map) both
        access = (os.O_RDONLY if mode in ("r", "rb") else os.O_RDWR if "+" in mode
                  else os.O_WRONLY)
        out = []
        for s in source if isinstance(source, list | tuple) else (source,):
            if fs is None:
                path = _local(s, expand=True)
            else:
                prefix, path = _pyarrow_prefix(fs), _local(s)
                if path is not None and prefix:
                    path = os.path.join(prefix, path.lstrip(os.sep))
            if path is not None:
                out.append((path, access))
        return out

    return reads


_READERS = (
    _Reader("h5py._hl.files", "", "make_fid", _h5py_fid),
    _Reader("netCDF4", "", "Dataset", _netcdf_dataset),
    _Reader("netCDF4", "MFDataset", "__init__", _netcdf_mfdataset),
    # ParquetFile and ParquetDataset: pq.read_table, read_pandas, ParquetFile
    _Reader("pyarrow.parquet.core", "ParquetFile", "__init__", _pyarrow_source(1, "source")),
    _Reader("pyarrow.parquet.core", "ParquetDataset", "__init__",
            _pyarrow_source(1, "path_or_paths", fs_at=2)),
    # these open the file through the file system first (pyarrow.parquet re-exports them)
    *(_Reader(module, "", name, _pyarrow_source(0, "where", fs_at=3))
      for module in ("pyarrow.parquet", "pyarrow.parquet.core")
      for name in ("read_metadata", "read_schema")),
    # pyarrow.lib's own: its readers look memory_map up there (feather, csv, json, ipc)
    *(_Reader(module, "", name, _pyarrow_source(0, arg, mode_at=mode_at))
      for module in ("pyarrow", "pyarrow.lib")
      for name, arg, mode_at in (("memory_map", "path", 1), ("OSFile", "path", 1),
                                 ("input_stream", "source", None))),
    *(_Reader("pyarrow.feather", "", name, _pyarrow_source(0, "source"))
      for name in ("read_table", "read_feather", "_read_table_internal")),
    _Reader("pyarrow.csv", "", "read_csv", _pyarrow_source(0, "input_file")),
    _Reader("pyarrow.csv", "", "open_csv", _pyarrow_source(0, "input_file")),
    _Reader("pyarrow.json", "", "read_json", _pyarrow_source(0, "input_file")),
    _Reader("pyarrow.ipc", "RecordBatchFileReader", "__init__", _pyarrow_source(1, "source")),
    _Reader("pyarrow.ipc", "RecordBatchStreamReader", "__init__", _pyarrow_source(1, "source")),
    _Reader("pyarrow.orc", "ORCFile", "__init__", _pyarrow_source(1, "source")),
    _Reader("pyarrow.orc", "", "read_table", _pyarrow_source(0, "source", fs_at=2)),
    _Reader("pyarrow.dataset", "", "dataset", _pyarrow_source(0, "source", fs_at=3)),
)
# a module of these imported while a recording is open: its readers are not wrapped yet
_READER_MODULES = frozenset(r.module for r in _READERS)
# (module, owner, name) -> (owner object, name, original, wrapper)
_reader_wrappers: dict[tuple[str, str, str], tuple[Any, str, Any, Any]] = {}
_wrapper_of: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, its wrapper)
_late: set[str] = set()  # reader modules a reader imported while it ran: to be wrapped


def _reader_reads(what: str, reads: Callable[..., _Reads], args: tuple[Any, ...],
                  kwargs: dict[str, Any], recorders: tuple[ReadRecorder, ...], caller: Any,
                  me: int) -> None:
    """Record what a call of a reader (``what``) opens, as the audit hook records a Python
    ``open``: a file by its content; a directory (a partitioned dataset) by its tree."""
    _busy.add(me)
    try:
        try:
            paths = reads(args, kwargs)
        except _NotLocal as e:
            if not _caller_is_machinery(caller):
                _give_up(recorders, f"the trace reads {e} through {what}; kiln keys local "
                                    "files only")
            return
        if not paths or _caller_is_machinery(caller):
            return
        for path, access in paths:
            full = _abspath(path)
            if _is_library_path(full):
                continue
            st = _stat(full)
            if access != os.O_WRONLY and st is not None and stat.S_ISDIR(st[0]):
                _note_tree(path, recorders)
            else:
                _note(path, FILE, access, recorders, full)
    except Exception:  # noqa: BLE001 - never into the user's call
        _give_up(recorders, f"kiln could not record a read through {what} while tracing")
    finally:
        _busy.discard(me)


def _note_tree(top: str, recorders: tuple[ReadRecorder, ...]) -> None:
    """A directory a reader reads whole: each directory's listing and each file."""
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        _note(folder, DIR, os.O_RDONLY, recorders)
        for name in sorted(files):
            _note(os.path.join(folder, name), FILE, os.O_RDONLY, recorders)


def _reader_wrapper(original: Callable[..., Any], reads: Callable[..., _Reads],
                    what: str) -> Callable[..., Any]:
    """``original`` (a function, or a method set on its class), recording what its calls
    open for the threads that read for a recording; every other call costs a dict lookup."""

    def reader(*args: Any, **kwargs: Any) -> Any:
        if _active:
            me = threading.get_ident()
            if me not in _busy:
                recorders = _recorders_here(me)
                if recorders:
                    _reader_reads(what, reads, args, kwargs, recorders, sys._getframe(1), me)
                    try:
                        return original(*args, **kwargs)
                    finally:
                        if _late:
                            _wrap_late()
        return original(*args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(reader, attr, getattr(original, attr))
        except (AttributeError, TypeError):
            pass
    reader.__wrapped__ = original  # type: ignore[attr-defined]
    return reader


class _StandInType(type):
    """The metaclass of a stand-in for a C extension class (``netCDF4.Dataset``, whose
    ``__init__`` cannot be replaced): an instance or subclass of the class counts as the
    stand-in's, so ``isinstance(ds, netCDF4.Dataset)`` holds while a recording is open."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.__wrapped__)  # type: ignore[attr-defined]

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls.__wrapped__)  # type: ignore[attr-defined]


def _stand_in(original: type, reads: Callable[..., _Reads], what: str) -> type:
    """A subclass of ``original`` that records what its calls open and returns an instance of
    ``original`` itself (its ``__init__`` then does not run again)."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _active:
            me = threading.get_ident()
            if me not in _busy:
                recorders = _recorders_here(me)
                if recorders:
                    _reader_reads(what, reads, args, kwargs, recorders, sys._getframe(1), me)
                    try:
                        return original(*args, **kwargs)
                    finally:
                        if _late:
                            _wrap_late()
        return original(*args, **kwargs)

    return _StandInType(original.__name__, (original,), {
        "__new__": __new__, "__module__": original.__module__,
        "__qualname__": original.__qualname__, "__doc__": original.__doc__,
        "__wrapped__": original, "__slots__": ()})


def _wrap_readers() -> None:
    """Put the wrappers of the known readers in place, for each library that is imported
    (under ``_active_lock``; kiln imports none). One that someone else replaced since kiln
    first wrapped it is left as it is."""
    for spec in _READERS:
        mod = sys.modules.get(spec.module)
        if mod is None:
            continue
        owner = getattr(mod, spec.owner, None) if spec.owner else mod
        current = getattr(owner, "__dict__", {}).get(spec.name)
        if current is None:
            continue
        key = (spec.module, spec.owner, spec.name)
        known = _reader_wrappers.get(key)
        if known is not None and known[0] is owner:
            if current is known[2]:
                setattr(owner, spec.name, known[3])
            continue
        if is_probe(current) or isinstance(current, _StandInType):
            continue  # a wrapper of ours (the same function under another module's name)
        shared = _wrapper_of.get(id(current))
        if shared is not None and shared[0] is current:
            wrapper = shared[1]
        else:
            what = f"{spec.module}.{spec.owner or spec.name}"
            try:
                wrapper = (_stand_in(current, spec.reads, what) if isinstance(current, type)
                           else _reader_wrapper(current, spec.reads, what))
            except TypeError:  # a class that cannot be subclassed
                continue
            _wrapper_of[id(current)] = (current, wrapper)
        try:
            setattr(owner, spec.name, wrapper)
        except (AttributeError, TypeError):
            continue
        _reader_wrappers[key] = (owner, spec.name, current, wrapper)


def _inside_reader(frame: Any) -> bool:
    """A wrapped reader's call is on the stack of ``frame``."""
    while frame is not None:
        if frame.f_code in _READER_CODES:
            return True
        frame = frame.f_back
    return False


def _wrap_late() -> None:
    """Wrap the readers of the modules a reader imported while it ran (a recording is open)."""
    with _active_lock:
        _late.clear()
        if _open:
            _wrap_readers()


_READER_CODE = next(c for c in _reader_wrapper.__code__.co_consts
                    if getattr(c, "co_name", None) == "reader")
_READER_CODES = frozenset({_READER_CODE, *(
    c for c in _stand_in.__code__.co_consts if getattr(c, "co_name", None) == "__new__")})


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
            _wrap_readers()  # (every time: a reader's library imported since the last one)
        _reading.set((*_reading.get(), self))
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
        _reading.set(tuple(r for r in _reading.get() if r is not self))

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
