"""The process's inputs, recorded from its start: what kiln's guard is made of
(``kiln._keys._guard`` turns this record into an entry's guard and checks one).

A trace can depend on state that code set up before it (a library's settings container, a
registry filled at import, ``decimal.getcontext()``, a memo) from something outside the
process. The record holds what could have shaped that state, as it was *first seen* by the
process (what the process later does to it is its own work, the same in every run that starts
from the same inputs):

- **files read** by any code (``open``, ``io.open_code``, ``os.open``: CPython's audit hooks,
  PEP 578), by their path and their ``os.stat`` identity when first opened (device, inode,
  size, modification and change times); a small file's content (at most 1 MiB) is digested
  then, a larger one's when a guard is made (``kiln._keys._guard``, by its identity), or at once
  where the process is about to overwrite, rename over or remove a file it has read and not
  digested yet (:func:`set_overwrite_hook`);
- **directories listed** (``os.listdir``, ``os.scandir``: ``glob``, ``pathlib``), by their
  sorted names when first listed, less what the run writes or makes there at any time (its own
  outputs: ``.pytest_cache`` made on the first run is in the folder's listing from the second
  run on, and made again then);
- **environment variables read by user code** (``os.environ[...]``, ``.get``, ``os.getenv``,
  ``in``), by their first value; where user code iterates the environment, the names it holds
  (in its order; each value it then reads, ``items()``, ``dict(os.environ)``, is a read by
  name as above).

Not recorded: the installed code and data of the stdlib and site-packages (they count by
version and by their ``RECORD``), kiln's own files, ``__pycache__``, ``/proc``, ``/sys`` and
``/dev`` (the process's and the machine's state, not files), pipes, sockets and devices (what
comes through them is no file's content: the network's), files first opened for writing by the
process and everything under folders it created (its outputs: logs, temporary folders), the
import system's listings of ``sys.path`` folders, and kiln's own variables (``KILN_*``). A
thread recording a trace (``kiln._keys.TraceRecorder``) is paused here: what the trace reads is
its entry's manifest, which kiln merges in when the trace ends (:func:`merge`).

Standard library only (``kiln run`` starts it before the program's first line, where no jax is
imported), and never raises: an audit hook that raised would fail the user's call.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KILN_ROOT", "LIB_ROOTS", "Observed", "env_reads", "environ_value", "environment",
           "files", "is_user_file", "listings", "merge", "merged", "modules_before_env_write",
           "pause", "made", "resume", "set_overwrite_hook", "sizes", "start", "started",
           "whole_environment"]

# installed code: the interpreter's stdlib and site-packages (libraries count by version); by
# real path, and as sys.path names them (a virtual environment's folders may be links)
_SITE = {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
_PATHS = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
LIB_ROOTS = tuple(os.path.realpath(p) + os.sep for p in _PATHS | _SITE)
_LIB_NAMES = tuple({*LIB_ROOTS, *(os.path.abspath(p) + os.sep for p in _PATHS | _SITE)})
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                 for k in ("stdlib", "platstdlib")})
_SITE_REAL = tuple({os.path.realpath(p) + os.sep
                    for p in _SITE | {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}})
# kiln's own code: the package and its top-level helpers beside it (the early start JAX
# imports, the command line's entry, the pytest plugin); their file reads and checks are kiln's,
# never the program's (a marker kiln_early checks while a noinline function is made in a trace)
_SRC = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
KILN_ROOT = tuple(os.path.join(_SRC, name) + os.sep
                  for name in ("kiln", "kiln_early", "kiln_jax_plugin", "kiln_cli", "kiln_pytest",
                               "kiln_server", "kiln_warm"))
_NOT_FILES = ("/proc/", "/sys/", "/dev/")
_PYCACHE = f"{os.sep}__pycache__{os.sep}"
_IMPORT_SYSTEM = frozenset({"importlib._bootstrap", "importlib._bootstrap_external", "zipimport"})
# installed distributions' metadata: a guard counts every distribution by its RECORD instead
_METADATA = ("importlib.metadata", "importlib_metadata")


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """True if ``filename`` is user code: any Python file outside the interpreter's stdlib and
    site-packages and outside kiln, and code compiled from a string (``python -c``, ``exec``,
    ``<stdin>``, notebook cells; not the stdlib's frozen modules, ``<frozen os>``)."""
    if not filename:
        return True
    if filename.startswith("<"):
        return not filename.startswith("<frozen ")
    if not os.path.isabs(filename) and not os.path.exists(filename):
        # a compiled extension's code: Cython names its functions' code by the build-time
        # relative path of their source (netCDF4's ``src/netCDF4/_netCDF4.pyx``), and on
        # Python 3.12 the trace recorder sees them run; keyed with their library
        return False
    real = _realpath(filename)
    return not real.startswith(LIB_ROOTS) and not real.startswith(KILN_ROOT)


@functools.lru_cache(maxsize=1024)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def _realpath(filename: str) -> str:
    """``os.path.realpath(filename)``, its folder's resolved once (modules share a few hundred
    folders: ~50 us a file otherwise)."""
    if os.path.islink(filename):
        return os.path.realpath(filename)
    folder, name = os.path.split(os.path.abspath(filename))
    return os.path.join(_real_folder(folder), name)


Identity = tuple[int, int, int, int, int]  # (device, inode, size, mtime_ns, ctime_ns)


class Observed:
    """A file as the process first saw it: its identity then (None: it did not exist) and,
    once taken, its content digest (``kiln._keys._guard`` fills ``digest``; ``lost``: the file
    changed before it could be digested, so what the process read is unknown)."""

    __slots__ = ("digest", "identity", "lost")

    def __init__(self, identity: Identity | None, digest: str | None = None) -> None:
        self.identity = identity
        self.digest = digest
        self.lost = False


_lock = threading.RLock()
_files: dict[str, Observed] = {}  # absolute path -> as first read
_listings: dict[str, tuple[str, ...] | None] = {}  # absolute path -> names when first listed
_written: set[str] = set()  # files first opened for writing (and folders created) here
_made: set[str] = set()  # every path the run wrote, made, or made again (makedirs exist_ok)
_env: dict[str, str | None] = {}  # variable read by user code -> its first value
_whole_env: list[str] | None = None  # the environment's names, first iterated by user code
_merged: dict[tuple[str, str], list[str]] = {}  # (name, kind) -> a trace's manifest item
_paused: dict[int, int] = {}  # thread id -> open trace recordings (their reads are the trace's)
_overwrite: list[Callable[[str, Observed], None]] = []  # digests a file about to change
_state = {"started": False}
# the modules imported when user code first set or removed an environment variable: what a
# warm process may import before the program runs (kiln_server.imported_modules)
_before_env_write: list[frozenset[str]] = []

_WATCHED = frozenset({"open", "os.listdir", "os.scandir", "os.rename", "os.remove",
                      "os.truncate", "os.mkdir"})


def started() -> bool:
    """Whether this process records its inputs (:func:`start` ran)."""
    return _state["started"]


def start() -> None:
    """Record the process's inputs from now on (once per process; see the module doc)."""
    with _lock:
        if _state["started"]:
            return
        _state["started"] = True
        sys.addaudithook(_hook)
        _wrap_environ()


def pause() -> None:
    """This thread's reads are a trace's from now on (its manifest), until :func:`resume`."""
    me = threading.get_ident()
    with _lock:
        _paused[me] = _paused.get(me, 0) + 1


def resume() -> None:
    me = threading.get_ident()
    with _lock:
        n = _paused.get(me, 0) - 1
        if n > 0:
            _paused[me] = n
        else:
            _paused.pop(me, None)


def set_overwrite_hook(hook: Callable[[str, Observed], None]) -> None:
    """``hook(path, observed)`` runs before the process overwrites, truncates, renames over or
    removes a file it read and has not digested yet (kiln digests it then, as it was read)."""
    with _lock:
        _overwrite[:] = [hook]


def merge(items: Iterable[list[str]]) -> None:
    """Add a trace's manifest items (files, listings, variables it read: a trace run here or
    an entry loaded in its place) as first seen, where the process had not seen them yet."""
    with _lock:
        for item in items:
            if (isinstance(item, list) and len(item) >= 3
                    and item[1] in ("<file>", "<dir>", "<env>")
                    and all(isinstance(p, str) for p in item)
                    and item[3:4] != ["all"]):  # (a trace that iterated the whole environment
                # misses on any change of it itself; its every variable is no later one's input)
                kind = item[1]
                name = item[0] if kind == "<env>" else os.path.abspath(item[0])
                # (a file by its content, its identity left out; a variable as the trace had it)
                _merged.setdefault((name, kind), [name, kind, item[2], ""] if kind == "<file>"
                                   else [name, kind, item[2]] if kind == "<dir>"
                                   else [name, kind, *item[2:4]])


# -- what a guard reads: copies, taken under the lock -------------------------------------
def files() -> dict[str, Observed]:
    with _lock:
        return dict(_files)


def listings() -> dict[str, tuple[str, ...] | None]:
    with _lock:
        return dict(_listings)


def env_reads() -> dict[str, str | None]:
    with _lock:
        return dict(_env)


def whole_environment() -> list[str] | None:
    """The environment's names (less ``KILN_*``) when user code first iterated it, or None."""
    return _whole_env


def sizes() -> tuple[int, ...]:
    """How much has been recorded (a guard made at the same sizes is the same)."""
    return (len(_files), len(_listings), len(_env), _whole_env is not None, len(_merged),
            len(_made))


def environ_value(name: str) -> str | None:
    """``os.environ[name]`` now (None: unset), read without being recorded."""
    try:
        return _original("__getitem__")(os.environ, name)  # type: ignore[no-any-return]
    except KeyError:
        return None


def environment(*, kiln: bool = False) -> list[tuple[str, str]]:
    """The whole environment now, in its order (``kiln``: with kiln's own ``KILN_*``), read
    without being recorded."""
    getitem, iterate = _original("__getitem__"), _original("__iter__")
    pairs = []
    for name in list(iterate(os.environ)):
        if name.startswith("KILN_") and not kiln:
            continue
        try:
            pairs.append((name, getitem(os.environ, name)))
        except KeyError:  # (unset by another thread meanwhile)
            continue
    return pairs


def made() -> set[str]:
    """Every path the run wrote or made, at any time (makedirs of a folder that was there
    already included): a folder's listing leaves them out, the run's own outputs."""
    with _lock:
        return set(_made)


def merged() -> list[list[str]]:
    with _lock:
        return list(_merged.values())


# -- the audit hook ---------------------------------------------------------------------------
def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _WATCHED:
        return
    try:
        if _paused and threading.get_ident() in _paused:
            return
        _record(event, args)
    except Exception:  # noqa: BLE001, S110 - never fail the user's call over a record
        pass


def _skipped(full: str) -> bool:
    probe = full + os.sep  # (a listing of a root itself)
    return (probe.startswith(_LIB_NAMES) or probe.startswith(KILN_ROOT) or _PYCACHE in full
            or probe.startswith(_NOT_FILES))


def _machinery(frame: Any) -> bool:
    """The audited call is kiln's own (its store, its guard's reads), the import system's
    (loading a module, probing ``sys.path``; not a loader's ``get_data`` called from outside
    it: package data is the program's input), or a lookup of installed distributions'
    metadata: the nearest frame outside the stdlib is kiln's, or the way there passes the
    import system or ``importlib.metadata``."""
    importing = None
    for _ in range(32):
        if frame is None:
            break
        name = frame.f_globals.get("__name__")
        if name in _IMPORT_SYSTEM:
            importing = frame
        elif importing is not None:
            return importing.f_code.co_name != "get_data"
        elif isinstance(name, str) and name.startswith(_METADATA):
            return True
        elif _module_kind(name, frame) != "stdlib":
            return isinstance(name, str) and name.partition(".")[0] in _KILN_PACKAGES
        frame = frame.f_back
    return importing is not None


_KILN_PACKAGES = frozenset({"kiln", "kiln_early", "kiln_jax_plugin", "kiln_cli", "kiln_pytest",
                            "kiln_server", "kiln_warm"})


def _under_written(full: str) -> bool:
    """``full`` was written by this process first, or lies in a folder it made."""
    if full in _written:
        return True
    parent = os.path.dirname(full)
    while parent and parent != os.sep:
        if parent in _written:
            return True
        parent = os.path.dirname(parent)
    return False


def _record(event: str, args: tuple[Any, ...]) -> None:
    path = args[0] if args else None
    if event == "os.rename":
        _before_change(args[1])  # (the file renamed over; a rename moves what was read)
        if isinstance(args[1], str | bytes | os.PathLike):
            with _lock:
                _made.add(os.path.abspath(os.fsdecode(args[1])))
        path = args[0]
    if isinstance(path, int) or path is None:
        return  # (a file descriptor: opened elsewhere; os.listdir(None) is the cwd's, below)
    full = os.path.abspath(os.fsdecode(path))
    if _skipped(full):
        return
    if event in ("open", "os.listdir", "os.scandir") and _machinery(sys._getframe(2)):
        return
    if event == "open":
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else os.O_RDONLY
        access = flags & os.O_ACCMODE
        if access != os.O_RDONLY and os.path.isdir(full):
            # a file with no name in folder ``full`` (O_TMPFILE: tempfile.TemporaryFile, whose
            # io.open of the folder is audited too): neither an input nor an output
            return
        if access == os.O_RDONLY and not flags & os.O_TRUNC:
            _note_file(full)
        elif (access == os.O_RDWR and not flags & (os.O_TRUNC | os.O_EXCL | os.O_APPEND)
              and os.path.exists(full)):
            # read and written (``r+``, ``np.memmap(mode="r+")``): what it held is an input,
            # digested now, before the writes (one it creates, ``tempfile``'s, and a log it
            # appends to, ``a+``, are outputs)
            _note_file(full)
            _before_change(full)
            with _lock:
                _made.add(full)
        else:
            with _lock:
                _made.add(full)
                if full in _files:
                    _before_change(full)
                elif not _under_written(full):
                    _written.add(full)  # an output of the run (a log, a checkpoint it saves)
    elif event in ("os.remove", "os.truncate", "os.rename"):
        _before_change(full)
    elif event == "os.mkdir":
        with _lock:
            _made.add(full)
            if not os.path.exists(full):
                _written.add(full)  # a folder the run made (a temporary one): not an input
    else:  # os.listdir, os.scandir
        _note_listing(full)


def _note_file(full: str) -> None:
    with _lock:
        if full in _files or _under_written(full):
            return
    try:
        st = os.stat(full)
    except OSError:
        identity = None
    else:
        if not stat.S_ISREG(st.st_mode):
            return  # a pipe, a socket, a device, a folder: no content to key
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    # a small file is digested now, as the program reads it (another process may rewrite it
    # while this one runs: a cache two pytest-xdist workers share); a large one when a guard
    # is made, by its identity (kiln._keys._guard)
    digest = _small_digest(full) if identity is not None and identity[2] <= _SMALL else None
    with _lock:
        _files.setdefault(full, Observed(identity, digest))


_SMALL = 1 << 20  # bytes


def _small_digest(full: str) -> str | None:
    """The xxh3-128 digest of a small file's content (as ``kiln._keys._reads.content_digest``
    gives it), or None where it cannot be read now."""
    try:
        import xxhash  # (kiln's dependency; imported at the first file read)

        with open(full, "rb") as f:  # (the hook records not its own open: _machinery)
            return str(xxhash.xxh3_128(f.read(_SMALL + 1)).hexdigest())
    except (OSError, ImportError):
        return None


def _note_listing(full: str) -> None:
    with _lock:
        if full in _listings or _under_written(full):
            return
    try:
        names: tuple[str, ...] | None = tuple(sorted(
            name for name in os.listdir(full)  # (no event: this hook records not its own)
            if os.path.join(full, name) not in _written))
    except OSError:
        names = None
    with _lock:
        _listings.setdefault(full, names)


def _before_change(path: Any) -> None:
    if isinstance(path, int) or path is None:
        return
    full = os.path.abspath(os.fsdecode(path))
    with _lock:
        seen = _files.get(full)
        hooks = list(_overwrite)
    if seen is None or seen.digest is not None or seen.lost or seen.identity is None:
        return
    if not hooks:
        seen.lost = True  # read before kiln could digest it: what was read is unknown
        return
    for hook in hooks:
        hook(full, seen)


# -- environment variables read by user code -------------------------------------------------
_Environ: Any = type(os.environ)


def _wrap_environ() -> None:
    getitem, iterate = _Environ.__getitem__, _Environ.__iter__
    setitem, delitem = _Environ.__setitem__, _Environ.__delitem__

    def __getitem__(self: Any, key: Any) -> Any:  # noqa: N807 - os._Environ's own method
        try:
            value = getitem(self, key)
        except KeyError:
            _note_env(self, key, None)
            raise
        _note_env(self, key, value)
        return value

    def __iter__(self: Any) -> Any:  # noqa: N807
        if self is os.environ and _whole_env is None and _read_by_user():
            _note_whole()
        return iterate(self)

    def __setitem__(self: Any, key: Any, value: Any) -> None:  # noqa: N807
        _note_env_write(self)
        setitem(self, key, value)

    def __delitem__(self: Any, key: Any) -> None:  # noqa: N807
        _note_env_write(self)
        delitem(self, key)

    __getitem__.kiln_original = getitem  # type: ignore[attr-defined]
    __iter__.kiln_original = iterate  # type: ignore[attr-defined]
    __setitem__.kiln_original = setitem  # type: ignore[attr-defined]
    __delitem__.kiln_original = delitem  # type: ignore[attr-defined]
    _Environ.__getitem__, _Environ.__iter__ = __getitem__, __iter__
    _Environ.__setitem__, _Environ.__delitem__ = __setitem__, __delitem__


def _note_env_write(env: Any) -> None:
    if env is not os.environ or _before_env_write:
        return
    try:
        if _read_by_user():
            _before_env_write.append(frozenset(sys.modules))
    except Exception:  # noqa: BLE001, S110 - never fail the user's write over a record
        pass


def modules_before_env_write() -> frozenset[str] | None:
    """The modules that were imported when user code first set or removed a variable of
    ``os.environ`` (``os.environ[...] = ``, ``update``, ``setdefault``, ``pop``, ``del``),
    or None where it has not: a module imported after it may have read what the program set
    (``JAX_ENABLE_X64`` before ``import jax``), so a warm process must not import it first."""
    return _before_env_write[0] if _before_env_write else None


def _original(name: str) -> Any:
    method = getattr(_Environ, name)
    return getattr(method, "kiln_original", method)


def _note_env(env: Any, key: Any, value: Any) -> None:
    if env is not os.environ or not isinstance(key, str) or key in _env:
        return
    if key.startswith("KILN_") or (_paused and threading.get_ident() in _paused):
        return
    try:
        if _read_by_user():
            with _lock:
                _env.setdefault(key, value)
    except Exception:  # noqa: BLE001, S110 - never fail the user's read over a record
        pass


def _note_whole() -> None:
    global _whole_env
    _whole_env = [name for name, _ in environment()]


def _read_by_user() -> bool:
    """The nearest frame outside the stdlib (and outside this module) is the user's code."""
    frame: Any = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return False
        name = frame.f_globals.get("__name__")
        if name == __name__:
            frame = frame.f_back
            continue
        kind = _module_kind(name, frame)
        if kind != "stdlib":
            return kind == "user"
        frame = frame.f_back
    return False


_kinds: dict[str, str] = {}  # module name -> "stdlib", "library" or "user"


def _module_kind(name: Any, frame: Any) -> str:
    known = _kinds.get(name) if isinstance(name, str) else None
    if known is not None:
        return known
    module = sys.modules.get(name) if isinstance(name, str) else None
    file = getattr(module, "__file__", None) if module is not None else None
    if not isinstance(file, str):
        if isinstance(name, str) and name.partition(".")[0] in sys.stdlib_module_names:
            return "stdlib"
        file = frame.f_code.co_filename  # (exec'd code, python -c: "<string>")
        if file.startswith("<frozen "):
            return "stdlib"
        return "user" if is_user_file(file) else "library"
    real = os.path.realpath(file)
    if real.startswith(_STDLIB) and not real.startswith(_SITE_REAL):
        kind = "stdlib"
    else:
        kind = "user" if is_user_file(file) else "library"
    if isinstance(name, str) and len(_kinds) < 1 << 14:
        _kinds[name] = kind
    return kind

