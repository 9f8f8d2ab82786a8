"""What the recordings of file reads share: which threads read for which recordings, what
is kiln's or the import system's doing rather than the program's (:func:`_caller_is_machinery`),
the threads a trace starts, noting a read, and the checks that open nothing (``os.stat``,
``os.lstat``, ``os.access``: ``os.path.exists``, ``pathlib.Path.exists``, ...), seen by wrapping
those functions while a recording is open, each keyed by what the check could see."""

from __future__ import annotations

import contextvars
import genericpath
import os
import pathlib
import posixpath
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._libraries import KILN_ROOT, LIB_ROOTS

if TYPE_CHECKING:
    from . import ReadRecorder

FILE = "<file>"
DIR = "<dir>"
STAT = "<stat>"

# stdlib modules whose reads are never a program's input: source shown in a warning or a
# traceback, and package metadata (importlib.metadata scans sys.path for distributions: what
# kiln counts by version)
# (linecache is not one: a data file it reads, ``linecache.getline("coeffs.txt", 2)``, is the
# program's input; the source of a loaded module it reads for a traceback is code, left out
# by _note)
_SOURCE_READERS = (f"{os.sep}importlib{os.sep}metadata{os.sep}__init__.py",
                   f"{os.sep}importlib{os.sep}metadata{os.sep}_adapters.py")
_IMPORT_SYSTEM = ("<frozen importlib", "<frozen zipimport")

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


def _frame(depth: int) -> Any:
    """``sys._getframe(depth)`` as the calling function would call it, or None when there is no
    Python frame that far up (a call from C)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def _swap(wrappers: Iterable[tuple[Any, str, Any, Any]], on: bool) -> None:
    """Put each ``(owner, name, original, wrapper)`` in place (``on``), or its original back,
    where the owner still holds the other: one that someone else replaced since kiln was
    imported is left as it is (what it does is then not seen)."""
    for owner, name, original, wrapper in wrappers:
        if owner.__dict__.get(name) is (original if on else wrapper):
            setattr(owner, name, wrapper if on else original)


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
    filelock), or by ``importlib.metadata`` looking up a distribution: the nearest frame
    outside the stdlib and site-packages is kiln's, or the way there passes the import system
    or ``importlib.metadata``. ``frame``: the frame that made the call. (``linecache`` reading
    a data file, ``linecache.getline("coeffs.txt", 2)``, is the program's read; the source
    of a loaded module it reads for a traceback is left out by :func:`_note`.) A library
    called by user code (``np.load``) is the user's read, and so is a loader's ``get_data``
    called from outside the import system (``pkgutil.get_data(__name__, "coeffs.txt")``, a
    resource reader): the package data it returns is the program's input, not a module being
    imported."""
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


# -- threads the trace starts -------------------------------------------------------------


def _start_followed(self: threading.Thread) -> None:
    """``threading.Thread.start`` while a recording is open: a thread started by a thread that
    reads for a recording reads for it too, from its first instruction (its ``run`` is
    wrapped before it starts) until the recording closes."""
    if _active:
        recorders = _active.get(threading.get_ident())
        if recorders and not _caller_is_machinery(_frame(1)):
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


_RUN_RECORDED = next(c for c in _follow.__code__.co_consts
                     if getattr(c, "co_name", None) == "run_recorded")


def _is_module_source(full: str) -> bool:
    real = os.path.realpath(full)
    files = (getattr(mod, "__file__", None) for mod in list(sys.modules.values()))
    return any(isinstance(f, str) and (f == full or os.path.realpath(f) == real) for f in files)


def _stat(full: str) -> tuple[int, int, int, int, int] | None:
    """(mode, size, mtime_ns, inode, ctime_ns), or None when nothing is there."""
    try:
        st = _os_stat(full)
    except OSError:
        return None
    return st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


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


def _probed(original: Callable[..., Any], kind: str, path: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], recorders: tuple[ReadRecorder, ...], me: int) -> Any:
    caller = _frame(2)  # _probed <- probe <- the caller of os.stat
    try:
        result = original(path, *args, **kwargs)
    except OSError as e:
        _note_check(kind, path, args, kwargs, None, e, recorders, caller, me)
        raise
    _note_check(kind, path, args, kwargs, result, None, recorders, caller, me)
    return result


def _note_check(kind: str, path: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any, error: OSError | None, recorders: tuple[ReadRecorder, ...],
                caller: Any, me: int) -> None:
    _busy.add(me)  # (kiln's own calls below stat too)
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
        if _caller_is_machinery(caller) or full.endswith(".py") and _is_module_source(full):
            return
        for r in recorders:
            if not (full + os.sep).startswith(r.ignore):
                r.checked.setdefault((path, how), value)
    except Exception:  # noqa: BLE001 - never into the user's call
        _give_up(recorders, f"kiln could not record a check of {path!r} while tracing")
    finally:
        _busy.discard(me)


_PROBE_CODE = next(c for c in _probe.__code__.co_consts
                   if getattr(c, "co_name", None) == "probe")


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


# what is wrapped while a recording is open (the face's _wrap): (owner, name, original, wrapper)
_WRAPPERS: list[tuple[Any, str, Any, Any]] = [
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
