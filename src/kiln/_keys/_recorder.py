"""Recording a cold trace (:class:`TraceRecorder`): what it used that a static walk before it
cannot predict, which :func:`kiln._keys._manifest.manifest_for` turns into manifest items."""

from __future__ import annotations

import gc
import sys
import threading
import types
from typing import Any

from kiln_early import _inputs

from ._environ import EnvWatch
from ._libraries import is_user_file, module_is_user
from ._reads import ReadRecorder
from ._rngs import RngWatch

__all__ = ["TraceRecorder"]

_monitoring: Any = getattr(sys, "monitoring", None)  # Python 3.12+
_recorders: list[TraceRecorder] = []
_tool_id: int | None = None
_recorders_lock = threading.Lock()
_collecting: int | None = None  # the thread collecting garbage now, else None


def _gc_started(phase: str, info: dict[str, Any]) -> None:
    global _collecting
    if phase == "start":
        _collecting = threading.get_ident()


def _gc_stopped(phase: str, info: dict[str, Any]) -> None:
    global _collecting
    if phase == "stop":
        _collecting = None


class TraceRecorder:
    """Records what a cold trace used that a static walk before it cannot predict.

    - ``imported``: user modules imported while tracing (``from mod import X`` inside the
      function: before the trace ``mod`` is not even loaded);
    - ``codes``: on Python 3.12+, the code of every function that ran in this thread while
      tracing (``sys.monitoring`` PY_START, each code object reported once and then disabled,
      which costs nothing measurable: a 3.5 s diffrax trace took no longer). Python 3.11 has
      no such hook at a bearable price (``sys.setprofile`` added 60% to that trace), so there
      the manifest holds the functions that emitted equations only. Code that runs because
      a garbage collection happened during the trace (``gc.callbacks``, such as hypothesis's
      timer of collections, finalizers, weakref callbacks) is not the trace's (it runs where an
      allocation happened to cross a threshold): left out (:func:`_bracket_collections`).
    - ``reads``: files and databases this thread (and the threads it started while tracing)
      opened, directories it listed and paths it checked while tracing, as manifest items
      (:mod:`kiln._keys._reads`); ``read_reason`` says why they cannot be keyed (a socket, a
      pipe, a file that changed during the trace), else None; then the global random
      generators the trace drew from (:class:`kiln._keys._rngs.RngWatch`), then the
      environment variables it read (:class:`kiln._keys._environ.EnvWatch`; a variable that
      changed during the trace is a ``read_reason``).
    - ``callers``: the code on the stack when the recording opened that is not the user's
      (installed libraries', kiln's: what called the trace, pytest, an IPython kernel, an
      outer ``jax.jit``): not code the trace ran, though on Python 3.11 the equations'
      tracebacks name it (:attr:`kiln._miss._program.Program.calls` leaves it out).

    While it records, the record of the process's inputs (the guard's, :mod:`kiln._keys._guard`)
    is paused in its thread; when it closes, the files, folders and variables it read are added
    there (a later trace may read state this one set up from them).

    Use as a context manager around the trace; nests (a kiln.jit called while tracing another).
    ``modules_before``: the modules loaded when the static walk ran (default: at entry); a
    module imported since (by a manifest check, say) was not seen by the walk either.
    ``ignore``: directories whose files are not the program's inputs (kiln's store, JAX's
    cache directory).
    """

    def __init__(self, modules_before: set[str] | None = None,
                 ignore: tuple[str, ...] = ()) -> None:
        self.codes: set[types.CodeType] = set()
        self.imported: tuple[str, ...] = ()
        self.reads: list[list[str]] = []
        self.read_reason: str | None = None
        self.thread = threading.get_ident()
        self._before: set[str] = modules_before or set()
        self._reads = ReadRecorder(ignore)
        self._rngs = RngWatch()
        self._env = EnvWatch()
        self.callers: frozenset[types.CodeType] = frozenset()

    def __enter__(self) -> TraceRecorder:
        self._before = self._before or set(sys.modules)
        self.callers = _library_callers(sys._getframe(1))
        _inputs.pause()
        if _monitoring is not None:
            with _recorders_lock:
                if _start_monitoring():
                    _recorders.append(self)
        self._reads.__enter__()
        self._rngs.__enter__()
        self._env.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._env.__exit__(*exc)
        self._rngs.__exit__(*exc)
        self._reads.__exit__(*exc)
        _inputs.resume()
        if exc[0] is None:
            self.reads = self._reads.items() + self._rngs.items + self._env.items
            self.read_reason = self._reads.unkeyable or self._env.unkeyable
            _inputs.merge(self.reads)
        if _monitoring is not None:
            with _recorders_lock:
                if self in _recorders:
                    _recorders.remove(self)
                if not _recorders:
                    _stop_monitoring()
        self.imported = tuple(sorted(
            name for name, mod in list(sys.modules.items())
            if name not in self._before and isinstance(mod, types.ModuleType)
            and module_is_user(mod)
        ))


def _library_callers(frame: types.FrameType | None) -> frozenset[types.CodeType]:
    """The code on the stack from ``frame`` down that is not the user's."""
    out = set()
    while frame is not None:
        if not is_user_file(frame.f_code.co_filename):
            out.add(frame.f_code)
        frame = frame.f_back
    return frozenset(out)


def _start_monitoring() -> bool:
    """Switch PY_START events on for kiln's tool (a free ``sys.monitoring`` tool id)."""
    global _tool_id
    mon = _monitoring
    if _tool_id is None:
        for tid in range(6):  # ids 0-5; debuggers, coverage and profilers take fixed ones
            if mon.get_tool(tid) is None:
                mon.use_tool_id(tid, "kiln")
                mon.register_callback(tid, mon.events.PY_START, _on_py_start)
                _tool_id = tid
                break
        else:
            return False
    if not _recorders:
        _bracket_collections(True)
        mon.restart_events()  # codes disabled by an earlier recording report again
        mon.set_events(_tool_id, mon.events.PY_START)
    return True


def _stop_monitoring() -> None:
    if _tool_id is not None:
        _monitoring.set_events(_tool_id, 0)
    _bracket_collections(False)


def _bracket_collections(on: bool) -> None:
    """Put kiln's gc callbacks first and last in ``gc.callbacks`` (``on``), or take them out:
    between them every other callback, finalizer and weakref callback of a collection runs."""
    global _collecting
    for cb in (_gc_started, _gc_stopped):
        while cb in gc.callbacks:
            gc.callbacks.remove(cb)
    _collecting = None
    if on:
        gc.callbacks.insert(0, _gc_started)
        gc.callbacks.append(_gc_stopped)


def _on_py_start(code: types.CodeType, offset: int) -> Any:
    me = threading.get_ident()
    if _collecting == me:
        return None  # a collection's code, not the trace's (it may run in the trace later)
    seen = False
    for r in list(_recorders):
        if r.thread == me:
            r.codes.add(code)
            seen = True
    # reported once per recording; another thread's code stays on (it may run here later)
    return _monitoring.DISABLE if seen else None

