"""What a trace reads from the process's settings: environment variables, and the plain values
a library keeps in its module globals (a setting it read once, at import).

Environment variables. A function that reads ``os.environ["SCALE"]``, ``os.environ.get``,
``os.getenv`` or ``"SCALE" in os.environ`` while it traces bakes the answer into the program.
While a recording is open, ``os._Environ.__getitem__`` (which ``Mapping.get``,
``Mapping.__contains__`` and ``os.getenv`` go through), ``__iter__``, ``__len__`` and
``__repr__`` are wrapped at class level (refcounted: nested and concurrent recordings share
them, and the last to close puts the originals back); an :class:`EnvWatch` collects the reads
of the thread it records and turns them into manifest items:

- ``[name, "<env>", digest]``: a variable the trace read, by the xxh3-128 digest of its value
  (the value itself is never stored: it may be a secret), or ``"absent"`` when it was not set;
- ``["<environ>", "<env>", digest, "all"]``: the trace iterated the whole environment
  (``dict(os.environ)``, ``os.environ.items()``, ``copy()``, ``len``, ``repr``): every name and
  value, in the environment's order. Any variable set, unset or changed then misses, even one
  the program does not use: kiln cannot tell which of them the trace kept (never stale first).

Only what the trace read is keyed: a variable it never read does not matter, and one it read
(``HOME``) hits as long as it holds the same value. Reads made by kiln itself and by the
import system (a module imported while tracing reads its settings at import: the module's
values are keyed instead, below, or as a ``<module>`` item for user code) are not recorded
(:func:`kiln._keys._reads._state._caller_is_machinery`). A variable the trace read that holds
another value when the trace ends (the trace set it, ``os.environ.setdefault``, or another
thread did) makes the recording unkeyable: the function takes the verify path.

Library settings. An installed library that reads an environment variable once, at import,
into a module global (equinox's ``EQX_ON_ERROR`` in ``equinox._config``, imported by
``equinox._errors``) changes the programs it builds by that global, not by a read while
tracing. Libraries count by version, their code is not walked; so for each library code object
that ran while tracing (:attr:`kiln._miss._program.Program.calls`), the names it reads (nested
code included) that its module's globals hold as plain values (None, bool, int, float,
complex, str, bytes, an enum member; dunder names left out) are keyed by value:

- ``[module, "<libglobals>", digest, names]`` (:func:`library_globals`), re-checked on a warm
  lookup against the module's globals then (:func:`check_library_globals`; a module not
  imported yet is imported, as the trace would).

Left out: the stdlib (it counts by Python's version; its globals are the process's state), and
jax, jaxlib and kiln, whose settings are keyed elsewhere (jax's config and flags). A value that
is not plain (a tuple, a dict, an object) is not keyed: a library's setting kept in a
container or on a class attribute (numpyro's ``Distribution._validate_args``) is not seen.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from ._code import code_names
from ._libraries import KILN_ROOT, installed_path
from ._reads._state import _caller_is_machinery, _frame, _swap

__all__ = ["ENV", "EnvWatch", "LIBGLOBALS", "check_env", "check_library_globals",
           "library_globals", "value_digest"]

ENV = "<env>"
LIBGLOBALS = "<libglobals>"
WHOLE = "<environ>"  # the name of the whole-environment item (told apart by its 4th field)

# -- environment variables ------------------------------------------------------------------

_Environ: Any = type(os.environ)
# the methods kiln wraps while a recording is open, as they were when kiln was imported (kiln's
# own reads of the environment call these, never its wrappers)
_getitem = _Environ.__getitem__
_iter = _Environ.__iter__
_len = _Environ.__len__
_repr = _Environ.__repr__

_active: dict[int, list[EnvWatch]] = {}  # thread id -> watches that thread reads for
_lock = threading.Lock()  # changes of _active, _open and the wrappers
_open = 0  # recordings open in the process: the wrappers are in place while > 0


def _value_now(name: str) -> str | None:
    """``os.environ[name]`` now (None: not set), through the original method."""
    try:
        return _getitem(os.environ, name)
    except KeyError:
        return None


def value_digest(value: str | None) -> str:
    """A variable's value as keys hold it: its xxh3-128 digest (never the value, which may be
    a secret), or ``"absent"``."""
    if value is None:
        return "absent"
    return xxhash.xxh3_128(value.encode("utf-8", "surrogateescape")).hexdigest()


def _whole_digest() -> str:
    """Every variable's name and value, in the environment's order."""
    h = xxhash.xxh3_128()
    for name in list(_iter(os.environ)):
        try:
            value = _getitem(os.environ, name)
        except KeyError:  # unset by another thread meanwhile
            continue
        h.update(name.encode("utf-8", "surrogateescape") + b"=")
        h.update(value.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


def _watches(env: Any) -> tuple[EnvWatch, ...]:
    """The watches this thread reads ``env`` for (none for another mapping of the class)."""
    if not _active:
        return ()
    watches = _active.get(threading.get_ident())
    if not watches or not (env is os.environ or env is getattr(os, "environb", None)):
        return ()
    return tuple(watches)


def _record(watches: tuple[EnvWatch, ...], name: Any) -> None:
    caller = _frame(3)  # _record <- _note <- the wrapper <- its caller
    if _caller_is_machinery(caller) or _caller_is_jax(caller):
        return
    if name is None:
        digest = _whole_digest()
        for w in watches:
            if w.whole is None:
                w.whole = digest
        return
    if isinstance(name, bytes):  # os.environb: the same variables as bytes
        name = os.fsdecode(name)
    if not isinstance(name, str):
        return
    for w in watches:
        if name not in w.seen:
            w.seen[name] = value_digest(_value_now(name))


def _caller_is_jax(frame: Any) -> bool:
    """The nearest frame outside the stdlib is jax's or jaxlib's: jax reads its settings (its
    flags at import, ``XLA_FLAGS`` for its own cache key while compiling an eager operation
    in the trace), which count elsewhere (jax's config, the XLA flags the backend started
    with), not as the program's inputs."""
    for _ in range(64):
        if frame is None:
            return False
        top = _top_of(frame.f_code.co_filename)
        if top != "":
            return top in ("jax", "jaxlib")
        frame = frame.f_back
    return False


def _top_of(filename: str) -> str | None:
    """The top-level package an installed file belongs to; ``""`` for the stdlib (and frozen
    modules), None for any other file."""
    if filename.startswith("<frozen "):
        return ""
    path = installed_path(filename)
    if path is None:
        return None
    top = path.split(os.sep, 1)[0].removesuffix(".py")
    return "" if top in sys.stdlib_module_names else top


def _note(watches: tuple[EnvWatch, ...], name: Any) -> None:
    try:
        _record(watches, name)
    except Exception:  # noqa: BLE001 - never into the user's call
        for w in watches:
            w.unkeyable = w.unkeyable or "kiln could not record a read of os.environ"


def _watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a method of ``os.environ``'s class), noting for the watches of this thread
    what it reads: the variable ``os.environ[key]`` names, the whole environment otherwise."""

    def watched(self: Any, *key: Any) -> Any:
        watches = _watches(self)
        if watches:
            _note(watches, key[0] if key else None)
        return original(self, *key)

    watched.__name__ = watched.__qualname__ = name
    watched.__doc__ = original.__doc__
    watched.__wrapped__ = original  # type: ignore[attr-defined]
    return watched


# put in place while a recording is open (the first opened; under ``_lock``)
_WRAPPERS = tuple((_Environ, name, original, _watched(name, original)) for name, original in (
    ("__getitem__", _getitem), ("__iter__", _iter), ("__len__", _len), ("__repr__", _repr)))


class EnvWatch:
    """Around a trace: the environment variables the tracing thread read, as ``items`` after
    the block (the module doc's ``<env>`` items); ``unkeyable``: why they cannot be keyed (a
    variable read changed before the block ended), else None. Nests; a thread started by the
    trace is not followed (docs/never-stale.md)."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}  # name -> digest of its value when first read
        self.whole: str | None = None  # digest of the whole environment when first iterated
        self.items: list[list[str]] = []
        self.unkeyable: str | None = None
        self.thread = threading.get_ident()

    def __enter__(self) -> EnvWatch:
        global _open
        with _lock:
            _active.setdefault(self.thread, []).append(self)
            _open += 1
            if _open == 1:
                _swap(_WRAPPERS, True)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _open
        with _lock:
            stack = _active.get(self.thread, [])
            if self not in stack:
                return
            stack.remove(self)
            if not stack:
                del _active[self.thread]
            _open -= 1
            if _open == 0:
                _swap(_WRAPPERS, False)
        if exc[0] is not None:
            return
        items = []
        for name, digest in sorted(self.seen.items()):
            if value_digest(_value_now(name)) != digest:
                self.unkeyable = f"environment variable {name} changed while the function " \
                                 "was traced"
                return
            if self.whole is None:
                items.append([name, ENV, digest])
        if self.whole is not None:
            if _whole_digest() != self.whole:
                self.unkeyable = "the trace read the whole environment, which changed while " \
                                 "the function was traced"
                return
            items.append([WHOLE, ENV, self.whole, "all"])
        self.items = items


def check_env(name: str, digest: str, whole: bool) -> str | None:
    """None if environment variable ``name`` (the whole environment: ``whole``) still holds
    what the cold trace read, else what changed."""
    if whole:
        return None if _whole_digest() == digest else (
            "the trace read the whole environment (os.environ iterated), which changed")
    now = value_digest(_value_now(name))
    if now == digest:
        return None
    if digest == "absent":
        return f"environment variable {name} is set now (unset when the entry was made)"
    if now == "absent":
        return f"environment variable {name} is unset now"
    return f"environment variable {name} changed"


# -- library settings: plain module globals ----------------------------------------------------

# top-level packages whose settings are keyed elsewhere: jax's config and flags, kiln's own
_KEYED_ELSEWHERE = frozenset({"jax", "jaxlib", "kiln", "kiln_early", "kiln_jax_plugin", "kiln_cli",
                              "kiln_pytest"})
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MISSING = "<missing>"


@functools.lru_cache(maxsize=4096)
def _library_module_name(filename: str) -> str | None:
    """The dotted name of the installed library module ``filename`` would be imported as
    (``.../site-packages/equinox/_errors.py``: ``equinox._errors``), None for user code, the
    stdlib, code compiled from a string and the libraries of ``_KEYED_ELSEWHERE``."""
    path = installed_path(filename) if filename.endswith(".py") else None
    if path is None or _realpath(filename).startswith(KILN_ROOT):
        return None
    parts = path[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    if (not parts or not all(p.isidentifier() for p in parts)
            or parts[0] in sys.stdlib_module_names or parts[0] in _KEYED_ELSEWHERE):
        return None
    return ".".join(parts)


def _plain_text(v: Any) -> str | None:
    """A plain value as keyed text, None for any other value."""
    if isinstance(v, enum.Enum):
        return f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}"
    if type(v) in _PLAIN:
        return f"{type(v).__name__}:{v!r}"
    return None


def _module_of(code: types.CodeType) -> types.ModuleType | None:
    """The installed library module ``code`` belongs to, None when it is not imported under
    the name its path says (it would not be found again by name)."""
    filename = code.co_filename
    name = _library_module_name(filename)
    mod = sys.modules.get(name) if name is not None else None
    f = getattr(mod, "__file__", None)
    if not isinstance(f, str) or (f != filename and _realpath(f) != _realpath(filename)):
        return None
    return mod


@functools.lru_cache(maxsize=4096)
def _realpath(filename: str) -> str:
    return os.path.realpath(filename)


def library_globals(codes: Iterable[types.CodeType]) -> list[list[str]]:
    """``[module, "<libglobals>", digest, names]`` for each installed library module (see the
    module doc) of which some code in ``codes`` ran while tracing: the plain values of the
    module globals that code names, sorted by module."""
    found: dict[str, tuple[types.ModuleType, set[str]]] = {}
    for code in codes:
        if code.co_name == "<module>":
            continue  # a module body running at import: its values are what is keyed
        mod = _module_of(code)
        if mod is None:
            continue
        g = vars(mod)
        named = code_names(code)
        names = {n for n in named
                 if n in g and not (n.startswith("__") and n.endswith("__"))
                 and _plain_text(g[n]) is not None}
        if names:
            found.setdefault(mod.__name__, (mod, set()))[1].update(names)
        top = mod.__name__.partition(".")[0]
        for n in named:
            # a module of the same library the code names (``settings.GAIN`` after
            # ``from . import settings``): the plain values of its attributes the code names
            sub = g.get(n)
            if (isinstance(sub, types.ModuleType) and sub is not mod
                    and sub.__name__.partition(".")[0] == top):
                sg = vars(sub)
                plain = {a for a in named if a in sg and not (a.startswith("__")
                         and a.endswith("__")) and _plain_text(sg[a]) is not None}
                if plain:
                    found.setdefault(sub.__name__, (sub, set()))[1].update(plain)
    out = []
    for mname, (mod, names) in sorted(found.items()):
        attrs = sorted(names)
        out.append([mname, LIBGLOBALS, _globals_digest(mod, attrs), ",".join(attrs)])
    return out


def _globals_digest(mod: types.ModuleType, names: list[str]) -> str:
    h = xxhash.xxh3_128()
    g = vars(mod)
    for name in names:
        text = _plain_text(g[name]) if name in g else _MISSING
        if text is None:
            text = f"<not plain: {type(g[name]).__qualname__}>"
        h.update(f"{name}={text};".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def check_library_globals(module: str, digest: str, names: str) -> str | None:
    """None if library module ``module``'s globals ``names`` (comma-separated) hold the values
    the cold trace saw, else what changed. A module not imported yet is imported."""
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a library that no longer imports: stale
        return f"module {module}: {type(e).__name__}: {e}"
    if _globals_digest(mod, names.split(",") if names else []) != digest:
        return f"settings of library module {module} changed ({names})"
    return None
