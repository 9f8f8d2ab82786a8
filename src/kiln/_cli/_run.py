"""``kiln run``: a Python script (or ``-m module``, as ``python -m``) run with kiln, and a
summary of hits, misses, traces and compiles on stderr at exit. By default every ``jax.jit``
made outside JAX itself is a ``kiln.jit`` (:func:`kiln.replace_jax_jit`, the zero-change mode);
``--no-jit`` or ``KILN_REPLACE_JIT=0`` leaves ``jax.jit`` alone (JAX's cache routed into the
store only)."""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import runpy
import signal
import sys
import traceback
import types
import zipfile
from typing import Any

import kiln_early

from .._base import _config, _stats
from . import _after_import
from ._common import Failure, start_jax
from ._render import note

__all__ = ["prepare", "register"]

# the counters the summary reports (kiln.stats()), in its order
_STATS_FIELDS = ("hits", "misses", "traces", "compiles", "compile_seconds", "saved_seconds",
                 "bad_entries", "jax_cache_hits", "jax_cache_misses", "jax_cache_writes",
                 "remote_hits", "remote_misses", "remote_timeouts", "remote_errors",
                 "lease_waits", "lease_takeovers", "eager_hits", "eager_misses", "eager_writes",
                 "eager_left")


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``run`` to the ``kiln`` parser's ``verbs``."""
    run = verbs.add_parser(
        "run", parents=common, help="run a Python script with kiln; print hits/misses at exit",
        description="Run SCRIPT as __main__ with kiln configured; print a summary of hits, "
        "misses, traces, compiles and compile seconds spent / saved to stderr at exit. "
        "JAX's own persistent cache is routed into kiln's store (kiln://), so code that calls "
        "jax.jit itself, unchanged, skips its compiles on a second run (KILN_JAX_CACHE=0 "
        "turns that off; a jax_compilation_cache_dir you set is left alone). "
        "Every jax.jit made outside JAX itself, in the script and in the libraries it "
        "imports, is a kiln.jit: a second run skips tracing and lowering too "
        "(kiln.replace_jax_jit; KILN_JIT_EXCLUDE leaves modules or functions to jax.jit; "
        "--no-jit or KILN_REPLACE_JIT=0 leaves every jax.jit alone). Exits with the "
        "script's status.",
        usage="kiln run [-h] [--explain] [--verify] [--no-jit] [--server] "
        "(SCRIPT | -m MODULE) [ARGS ...]",
    )
    run.add_argument("--explain", action="store_true",
                     help="log why each miss happened (kiln.configure(explain=True)) to stderr")
    run.add_argument("--verify", action="store_true",
                     help="audit mode: re-trace every warm hit and compare with the stored module")
    jit = run.add_mutually_exclusive_group()
    jit.add_argument("--jit", action="store_true",
                     help="every jax.jit outside JAX itself is a kiln.jit (kiln.replace_jax_jit)"
                     ": a warm start skips tracing and lowering too; the default")
    jit.add_argument("--no-jit", action="store_true",
                     help="leave jax.jit alone: only JAX's persistent cache is routed into the "
                     "store (a warm start still traces and lowers); also KILN_REPLACE_JIT=0")
    server = run.add_mutually_exclusive_group()
    server.add_argument("--server", action="store_true",
                        help="run in a warm process that has already imported what this "
                        "program's last run imported (kiln_server; also KILN_SERVER=1): the "
                        "first run records the imports and starts it, later runs skip "
                        "Python's imports; any change or fault makes the run a plain one")
    server.add_argument("--no-server", action="store_true",
                        help="a plain run even where KILN_SERVER=1")
    run.add_argument("-m", dest="module", metavar="MODULE", nargs=argparse.REMAINDER,
                     help="run library module MODULE as __main__, as python -m (the rest of the "
                     "command line is its arguments)")
    run.add_argument("script", metavar="SCRIPT", nargs="?")
    run.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER,
                     help="arguments passed to the script")
    run.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    module: str | None = None
    if args.module is not None:
        if not args.module or args.script is not None:
            raise Failure("kiln run: give either SCRIPT or -m MODULE, before the arguments "
                          "of what it runs", code=2)
        module, argv_rest = args.module[0], args.module[1:]
    else:
        script = args.script
        if script is None:
            raise Failure("kiln run: give SCRIPT or -m MODULE", code=2)
        if not os.path.exists(script):
            raise Failure(f"cannot run {script!r}: no such file", code=2)
        argv_rest = args.script_args
    prelude = _Prelude(args)
    settings: dict[str, Any] = {k: True for k in ("explain", "verify") if getattr(args, k)}
    if sys.stderr.isatty() and _config.get_config().progress is None:
        settings["progress"] = True
    handler: logging.Handler | None = None
    kiln_logger = logging.getLogger("kiln")
    if args.explain:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(message)s"))
        kiln_logger.addHandler(handler)
    saved_argv, saved_path, saved_main = sys.argv[:], sys.path[:], sys.modules.get("__main__")
    before = _stats.stats()
    try:
        with _config.process_settings(**settings):
            prelude.when_jax_is_imported()
            if module is not None:
                # as python -m: the current directory first on sys.path
                sys.path.insert(0, os.getcwd())
                sys.argv = [module, *argv_rest]
                return _run_module(module)
            sys.argv = [script, *argv_rest]
            return _run_script(script)
    finally:
        prelude.undo()
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        if handler is not None:
            kiln_logger.removeHandler(handler)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        note(_format_summary(_stats_delta(before, _stats.stats())))


class _Prelude:
    """What ``kiln run`` turns on for the program (the kiln:// route, JAX's cache into the
    store, the ``jax.jit`` swap), put in place when the program (or a library it imports)
    first imports jax, and not before: JAX reads its settings from the environment when it is
    imported (``JAX_ENABLE_X64``, ``JAX_DEBUG_NANS``, ``JAX_NUMPY_RANK_PROMOTION``), and a
    program may set them on its first lines, as under ``python``. Right after ``jax`` is
    imported, a library's ``from jax import jit`` and its module-level ``@jax.jit`` still see
    the swap."""

    def __init__(self, args: argparse.Namespace, **settings: Any) -> None:
        self.args = args
        self.settings = settings  # (the warm process's: its --cache-dir and --store)
        self.swapped = False
        self.hook: Any = None

    def when_jax_is_imported(self) -> None:
        self.hook = _after_import.after_import("jax", self._start)

    def _start(self) -> None:
        self.hook = None
        try:
            with _config.process_settings(**self.settings):
                self.swapped = _prelude(self.args)
        except Exception as e:  # noqa: BLE001 - kiln is a cache: the program runs as without it
            note(f"kiln: warning: could not turn kiln on for this run ({type(e).__name__}: "
                 f"{e}); the program runs with plain JAX")

    def undo(self) -> None:
        if self.hook is not None:
            _after_import.remove(self.hook)
        if self.swapped:
            from .._jit import _swap

            _swap.restore_jax_jit()


def _prelude(args: argparse.Namespace) -> bool:
    """What ``kiln run`` turns on, with jax imported; whether this call swapped ``jax.jit``
    (False where it was swapped already)."""
    start_jax()
    from .._jit import _swap
    from .._travel import _jax_cache

    if _config.get_config().jax_cache:
        # unchanged jax.jit code too: JAX's own cache reads and writes the store (kiln://)
        _jax_cache.enable_jax_cache()
    if _swap_wanted(args):
        # before the script's imports: their jax.jit calls (and from jax import jit) see it
        return _swap.replace_jax_jit()
    return False


def prepare(args: argparse.Namespace) -> None:
    """``kiln run``'s prelude for the warm process of ``kiln run --server`` (``kiln_server``),
    before it imports the program's modules: put in place when the first of them imports jax
    (:class:`_Prelude`), so that a library's ``from jax import jit`` and its module-level
    ``@jax.jit`` see the swap as in a plain run, and where the program's record holds no jax
    (it set the environment before importing it), when the served program imports it.
    ``args`` is kiln's parsed command line (its ``--cache-dir``, ``--store``, ``--no-jit``
    apply; ``_main.prepare`` parses it). Starts no JAX backend."""
    _Prelude(args, cache_dir=args.cache_dir, store=args.store).when_jax_is_imported()


def _swap_wanted(args: argparse.Namespace) -> bool:
    """Whether ``kiln run`` swaps ``jax.jit``: yes (the default, issue 43) unless ``--no-jit``,
    or ``KILN_REPLACE_JIT`` set to a false value (0, false, no, off) without ``--jit``."""
    if args.no_jit:
        return False
    if args.jit or not os.environ.get("KILN_REPLACE_JIT", "").strip():
        return True
    return _config.get_config().replace_jit


def _run_module(module: str) -> int:
    """Run ``module`` as ``__main__`` (a package: its ``__main__``); the status
    ``python -m module`` would exit with."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        found = None
        why = str(e)
    else:
        why = f"No module named {module!r}"
    if found is None:
        note(f"error: {why}")
        return 1
    return _run_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True),
                     found.origin or module)


def _run_script(script: str) -> int:
    """Run the file ``script`` as ``python script`` does; the status it would exit with.

    As CPython's ``pymain_run_file``: ``sys.path[0]`` is the folder of the script's real path
    (a symlinked script's target folder); ``__main__`` is a new module whose ``__file__`` is
    the path joined to the working folder, not normalized (``/w/./prog.py``), the code's file
    name too, with a ``SourceFileLoader``, no ``__spec__``, the ``builtins`` module and an empty
    ``__annotations__``; the
    source is compiled as Python compiles it (no ``__future__`` flag of kiln's). A folder or
    zip archive with a ``__main__.py`` runs through :mod:`runpy`, as Python does."""
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    if not _is_source(script):
        return _run_main(lambda: runpy.run_path(script, run_name="__main__"), script)
    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path),
                         __builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main

    def run() -> None:
        with io.open_code(path) as f:  # (as Python opens a script: the audit event is open)
            source = f.read()
        try:
            code = compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            raise _NoFrames(e) from None
        exec(code, main.__dict__)

    return _run_main(run, script)


def _is_source(script: str) -> bool:
    """Whether Python runs ``script`` as a source file (not a folder or zip archive with a
    ``__main__.py``, not compiled bytecode)."""
    if os.path.isdir(script) or zipfile.is_zipfile(script):
        return False
    with open(script, "rb") as f:
        return f.read(4) != importlib.util.MAGIC_NUMBER


class _NoFrames(Exception):
    """The script's error raised before any of its code ran (a ``SyntaxError``): shown with no
    traceback, as Python shows it."""


def _run_main(run: Any, script: str) -> int:
    """Call ``run`` (the script's, or runpy's for ``script``); the status Python would exit
    with, or ``-SIGINT`` where Python would die by SIGINT (an uncaught ``KeyboardInterrupt``:
    the caller ends the process so, once kiln's summary is out)."""
    kiln_early.skip()  # kiln is imported first here: no early start to remember
    try:
        run()
    except SystemExit as e:
        return _exit_code(e)
    except _NoFrames as e:
        _uncaught(e.args[0], None)
        return 1
    except KeyboardInterrupt as e:
        _uncaught(e, _script_frames(e, script))
        return -signal.SIGINT
    except Exception as e:  # noqa: BLE001 - report the script's error like python does
        _uncaught(e, _script_frames(e, script))
        return 1
    return 0


def _uncaught(exc: BaseException, tb: Any) -> None:
    """What Python does with an exception nothing caught: ``sys.last_*`` set, then
    ``sys.excepthook`` (the program's own where it set one)."""
    exc.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # noqa: BLE001 - as Python: a failing hook, then the default one
        traceback.print_exc(file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


# the swap's decisions, counted in kiln.stats().reasons
_SWAP_KINDS = ("jit-swap-kiln", "jit-swap-verify", "jit-swap-jax")


def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    delta = {f: getattr(after, f) - getattr(before, f) for f in _STATS_FIELDS}
    for kind in _SWAP_KINDS:
        delta[f"reason:{kind}"] = after.reasons[kind] - before.reasons[kind]
    return delta


def _format_summary(delta: dict[str, float]) -> str:
    parts = [
        f"hits: {int(delta['hits'])}",
        f"misses: {int(delta['misses'])}",
        f"traces: {int(delta['traces'])}",
        f"compiles: {int(delta['compiles'])}",
        f"compile_seconds: {delta['compile_seconds']:.2f}",
        f"saved_seconds: {delta['saved_seconds']:.2f}",
    ]
    if delta["bad_entries"]:
        parts.append(f"bad_entries: {int(delta['bad_entries'])}")
    swap = {k: int(delta.get(f"reason:{k}", 0)) for k in _SWAP_KINDS}
    if any(swap.values()):
        # the jax.jit swap (--jit): what each jax.jit became
        parts.append(f"jax.jit as kiln.jit: {swap['jit-swap-kiln'] + swap['jit-swap-verify']} "
                     f"(verify path: {swap['jit-swap-verify']}), left to jax.jit: "
                     f"{swap['jit-swap-jax']}")
    if delta["jax_cache_hits"] or delta["jax_cache_misses"]:
        # plain jax.jit programs through JAX's cache routed into the store (kiln://)
        parts.append(f"jax cache hits: {int(delta['jax_cache_hits'])}, "
                     f"misses: {int(delta['jax_cache_misses'])}, "
                     f"written: {int(delta['jax_cache_writes'])}")
    if delta["eager_hits"] or delta["eager_misses"] or delta["eager_left"]:
        # JAX's own eager work (its jitted functions, primitives applied outside a trace)
        parts.append(f"eager loaded: {int(delta['eager_hits'])}, "
                     f"compiled: {int(delta['eager_misses'])}, "
                     f"stored: {int(delta['eager_writes'])}, "
                     f"left to JAX: {int(delta['eager_left'])}")
    remote = ("remote_hits", "remote_misses", "remote_timeouts", "remote_errors", "lease_waits",
              "lease_takeovers")
    if any(delta[f] for f in remote):
        # a fleet store: what the remote store answered, and single-flight waits
        parts.append(", ".join(f"{f.replace('_', ' ')}: {int(delta[f])}" for f in remote))
    return "kiln: " + ", ".join(parts)


def _script_frames(exc: BaseException, script: str) -> Any:
    """The traceback of ``exc`` from the script's first frame on, without kiln's and
    runpy's frames above it (as ``python`` shows it)."""
    tb = exc.__traceback__
    target = os.path.realpath(script)
    here = os.path.dirname(os.path.realpath(__file__))
    probe = tb
    while probe is not None:
        filename = probe.tb_frame.f_code.co_filename
        if os.path.realpath(filename) == target:
            return probe
        if not (filename.startswith("<frozen runpy") or os.path.basename(filename) == "runpy.py"
                or os.path.realpath(filename).startswith(here + os.sep)):
            return probe  # the first frame of neither kiln nor runpy (a module's own)
        probe = probe.tb_next
    return tb


def _exit_code(e: SystemExit) -> int:
    """The status Python would exit with for ``sys.exit(e.code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1
