"""Files a C library opens itself raise no audit event. For the readers kiln knows (``_READERS``:
h5py's ``File``, netCDF4's ``Dataset`` and ``MFDataset``, pyarrow's parquet, feather, csv,
json, ipc, orc and dataset readers and its ``memory_map``, ``OSFile``, ``input_stream``), the
opener is wrapped while a recording is open (only when its library is already imported: kiln
imports none of them), and the file it names is keyed as a Python read is; a directory given
to one of them (a partitioned dataset) by its whole tree (each directory's listing, each
file's content). A wrapped function that a module imported while a recording was open holds
for good is taken for the original by the walk (:func:`is_probe`). A source that is not a
local file (an ``s3://`` URL, an OPeNDAP address, pyarrow's S3 file system, an HDF5 driver
that reads several files or a remote one) makes the recording unkeyable, and so does the
first import of one of these modules while tracing (its opener is not wrapped yet), unless a
wrapped reader imports it (``pq.read_table`` imports ``pyarrow.dataset``: that call is keyed,
and the module is wrapped when it returns)."""

from __future__ import annotations

import os
import stat
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _state
from ._state import DIR, FILE

if TYPE_CHECKING:
    from . import ReadRecorder

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
    if isinstance(source, os.PathLike | bytes):
        source = os.fsdecode(source)
    if not isinstance(source, str):
        return None
    if expand:
        source = os.path.expanduser(source)
    if "://" in source and _state._stat(_state._abspath(source)) is None:
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
    _state._busy.add(me)
    try:
        try:
            paths = reads(args, kwargs)
        except _NotLocal as e:
            if not _state._caller_is_machinery(caller):
                _state._give_up(recorders, f"the trace reads {e} through {what}; kiln keys "
                                "local files only")
            return
        if not paths or _state._caller_is_machinery(caller):
            return
        for path, access in paths:
            full = _state._abspath(path)
            if _state._is_library_path(full):
                continue
            st = _state._stat(full)
            if access != os.O_WRONLY and st is not None and stat.S_ISDIR(st[0]):
                _note_tree(path, recorders)
            else:
                _state._note(path, FILE, access, recorders, full)
    except Exception:  # noqa: BLE001 - never into the user's call
        _state._give_up(recorders, f"kiln could not record a read through {what} while tracing")
    finally:
        _state._busy.discard(me)


def _note_tree(top: str, recorders: tuple[ReadRecorder, ...]) -> None:
    """A directory a reader reads whole: each directory's listing and each file."""
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        _state._note(folder, DIR, os.O_RDONLY, recorders)
        for name in sorted(files):
            _state._note(os.path.join(folder, name), FILE, os.O_RDONLY, recorders)


def _read_through(original: Callable[..., Any], reads: Callable[..., _Reads], what: str,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call of a wrapped reader (:func:`_reader_wrapper`, :func:`_stand_in`): ``original``'s,
    recording what it opens for the threads that read for a recording; every other call costs
    a dict lookup."""
    if _state._active:
        me = threading.get_ident()
        if me not in _state._busy:
            recorders = _state._recorders_here(me)
            if recorders:
                _reader_reads(what, reads, args, kwargs, recorders, sys._getframe(2), me)
                try:
                    return original(*args, **kwargs)
                finally:
                    if _late:
                        _wrap_late()
    return original(*args, **kwargs)


def _reader_wrapper(original: Callable[..., Any], reads: Callable[..., _Reads],
                    what: str) -> Callable[..., Any]:
    """``original`` (a function, or a method set on its class), recording what its calls
    open (:func:`_read_through`)."""

    def reader(*args: Any, **kwargs: Any) -> Any:
        return _read_through(original, reads, what, args, kwargs)

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
        return _read_through(original, reads, what, args, kwargs)

    return _StandInType(original.__name__, (original,), {
        "__new__": __new__, "__module__": original.__module__,
        "__qualname__": original.__qualname__, "__doc__": original.__doc__,
        "__wrapped__": original, "__slots__": ()})


def _wrap_readers() -> None:
    """Put the wrappers of the known readers in place, for each library that is imported
    (under ``_state._active_lock``; kiln imports none). One that someone else replaced since kiln
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
        if frame.f_code is _read_through.__code__:
            return True
        frame = frame.f_back
    return False


def _wrap_late() -> None:
    """Wrap the readers of the modules a reader imported while it ran (a recording is open)."""
    with _state._active_lock:
        _late.clear()
        if _state._open:
            _wrap_readers()


_READER_CODE = next(c for c in _reader_wrapper.__code__.co_consts
                    if getattr(c, "co_name", None) == "reader")


def is_probe(fn: Any) -> bool:
    """``fn`` is one of the wrappers of ``os.stat`` / ``lstat`` / ``access``, or of a C
    library's reader (``pyarrow.csv.read_csv``; its ``__wrapped__`` is the original: a module
    that imported it while a recording was open holds the wrapper for good)."""
    code = getattr(fn, "__code__", None)
    return code is _state._PROBE_CODE or code is _READER_CODE
