"""Function fingerprints: what a stored executable was built from, and a manifest to re-check.

A fingerprint has two layers (as ccache's direct mode does for headers):

1. **Static walk** (part of the persistent key, :func:`fingerprint`): the function's code object
   (bytecode, constants including nested code, names; not line numbers), its defaults, closure
   values, and every module-level value its code names, recursing into user functions, user
   modules' attributes and user classes' methods. Values are hashed by value
   (:mod:`kiln._keys._hashing`). The walk is :class:`kiln._keys._walk.Walker`.
2. **Manifest** (stored in the entry, re-checked on a warm lookup,
   :mod:`kiln._keys._manifest`): after tracing cold, every user-code function that emitted
   part of the program is read off the equations' source tracebacks (and, on Python 3.12+,
   every one that ran: :class:`kiln._keys._recorder.TraceRecorder`). Functions the static
   walk could not see (methods reached through objects, callbacks held in data structures)
   are stored as ``(module, qualname, digest)`` and must hash the same before an entry is used.

"User code" is any Python file outside the interpreter's stdlib and site-packages
(:mod:`kiln._keys._libraries`). Installed libraries count by distribution name + version
(``importlib.metadata``), never by code.

Anything that cannot be fingerprinted soundly (a global holding an object with no canonical
value digest, a function that ran but cannot be found again by module + qualname) makes the
fingerprint *unsound*: kiln then never trusts a fingerprint key for that function and takes the
verify path (trace + lower, key by the lowered module, skip only the compile).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._walk import Walker, class_code, walk_failure

__all__ = ["Fingerprint", "fingerprint"]


@dataclass
class Fingerprint:
    """Result of the static walk.

    Attributes:
        digest: 32 hex characters over every part, in walk order.
        parts: (name, digest) pairs, e.g. ``("code:mod.helper", "ab..")`` or
            ``("global:mod.SCALE", "..")`` or ``("lib:diffrax", "diffrax==0.7.2")``; stored in
            the entry header so ``KILN_EXPLAIN`` can name what changed.
        sound: False if some part could not be digested (then ``reason`` says which).
        codes: code objects covered by the walk (the manifest skips them).
        names: every name the walked code reads (globals and attributes).
        objects: every object the walk visited, in walk order: the same sequence in every
            process whose walk gives the same digest, so host callbacks can refer to the
            live objects by position (``_jax_compat.pickle_callbacks``).
        watchable: ``(name, value)`` of the globals and bound methods' ``self`` met that can be
            keyed by the fields their trace reads (:meth:`Walker.watched_value`).
    """

    digest: str
    parts: list[tuple[str, str]]
    sound: bool = True
    reason: str | None = None
    codes: set[types.CodeType] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    objects: list[Any] = field(default_factory=list, repr=False)
    watchable: list[tuple[str, Any]] = field(default_factory=list, repr=False)


def fingerprint(fun: Callable[..., Any], *, extra: list[tuple[str, Any]] = (),  # type: ignore[assignment]
                reads: dict[str, tuple[str, ...] | None] | None = None) -> Fingerprint:
    """Static-walk fingerprint of ``fun`` and of the named ``extra`` values (see module doc).

    ``extra`` holds values that shape the trace besides ``fun``: static arguments and the aux
    data of the arguments' pytree nodes. Functions among them are fingerprinted by code.
    ``reads``: for a static object (``static:<name>`` in ``extra``) keyed by the fields its
    trace read, those fields (:mod:`kiln._keys._static_reads`); others by their whole state.
    """
    w = Walker()
    w.reads = dict(reads or {})
    try:
        w.value(getattr(fun, "__qualname__", type(fun).__qualname__), fun)
        if not isinstance(fun, types.FunctionType | functools.partial | types.MethodType):
            class_code(w, type(fun))  # a callable object: its class's __call__ and methods
        for name, v in extra:
            w.add(f"extra:{name}", "")
            w.seen.discard(id(v))
            fields = (reads or {}).get(name)
            if fields is not None:
                w.static_fields(name, v, fields)
            elif name.startswith("static:"):
                w.static_value(name, v)
            else:
                w.value(name, v)
        w.finish()
    except Exception as e:  # noqa: BLE001 - the walk never raises into the user's call
        w.unsound(walk_failure(e))
    return Fingerprint(w.digest(), w.parts, w.reason is None, w.reason, w.codes, w.names,
                       w.keep, w.watchable)
