"""Objects as static arguments keyed by the fields their trace read.

A static ``self`` (a trainer, an environment, a strategy) often holds what its jitted methods
never read: the time it was made, a run id, a progress bar, a lock, a logger. Keyed by its whole
state, such an object misses on every warm start (its ``created`` differs in every process) or
takes the verify path (a lock has no value): issue 42. So an object that can be watched
(:func:`watchable`) is keyed by its class and by the fields the trace *read*:

1. The cold trace runs under a :class:`StaticReadWatch`: for its duration the object's class
   gets a ``__getattribute__`` that records every attribute name read on any instance of the
   class (the original runs as before), and a ``__hash__`` / ``__eq__`` that say the object was
   hashed or compared. The read set is the names read that are fields of the object or are
   neither fields nor class attributes (a missing field read through ``hasattr`` counts).
2. The entry is stored under the fingerprint that walks only those fields
   (:meth:`kiln._keys._walk.Walker.static_fields`; the read set is a key part too), and the
   read set is stored as a hint under the call's ``static-reads`` key.
3. A warm start reads the hint and keys the object by the fields it names.

Why any hint is sound (a wrong or tampered one only misses): the entry under a key was written
by a trace that read exactly the fields the key names, with these very values, the same code
and the same other inputs; that trace, run here, would read the same fields and build the same
program (what a trace depends on is what it reads, as in build systems with dynamic
dependencies: Mokhov et al., "Build systems à la carte", 2018).

The whole state is keyed instead (the read set is None) when a read cannot be seen name by
name: ``__dict__``, ``__getstate__``, ``__reduce__`` or ``__reduce_ex__`` was read (``vars``,
``copy``, ``pickle``), the object was hashed or compared while tracing (a cache keyed by it,
such as an inner ``jax.jit`` with the object static, may reuse a trace made earlier, whose reads
were not seen), the function body did not run (jax reused a trace), or the class cannot be
patched. Not seen, and documented (``docs/never-stale.md``): a read that bypasses the class,
``object.__getattribute__(self, "x")``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._walk import strict_digest

__all__ = ["StaticReadWatch"]

# reads that see the whole state at once
_WHOLE = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__"})


class _Patched:
    """One class's recording hooks, shared by every watch on it (refcounted: threads and nested
    traces watch the same class at once)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.watches: list[StaticReadWatch] = []
        self.own = {a: vars(cls)[a] for a in ("__getattribute__", "__hash__", "__eq__")
                    if a in vars(cls)}
        getattribute: Any = cls.__getattribute__
        hash_: Any = cls.__hash__
        eq: Any = cls.__eq__
        watches = self.watches

        def __getattribute__(obj: Any, name: str) -> Any:
            for w in watches:
                w.names.add(name)
            return getattribute(obj, name)

        def __eq__(obj: Any, other: Any) -> Any:  # noqa: N807 - the hook's own name
            for w in watches:
                w.hashed = True
            return eq(obj, other)

        self.hooks: dict[str, Any] = {"__getattribute__": __getattribute__, "__eq__": __eq__}
        if hash_ is not None:  # (an unhashable class stays unhashable)
            def __hash__(obj: Any) -> int:  # noqa: N807
                for w in watches:
                    w.hashed = True
                return hash_(obj)

            self.hooks["__hash__"] = __hash__

    def install(self) -> None:
        for name, hook in self.hooks.items():
            setattr(self.cls, name, hook)

    def remove(self) -> None:
        for name in self.hooks:
            if name in self.own:
                setattr(self.cls, name, self.own[name])
            else:
                delattr(self.cls, name)


_patched: dict[type, _Patched] = {}
_lock = threading.Lock()


class StaticReadWatch:
    """Around a trace: the fields each watched static object was read by (see the module doc).

    ``objects``: ``(name, value)`` of the static values to watch (each :func:`watchable`).
    ``ran``: a callable giving how many times the function body has run (the trace ran it
    when the count moved; None: not known, so the whole state is keyed).

    After the block: ``reads``, name -> the sorted field names read, or None where the whole
    state must be keyed; ``changed``, None or which field of an object the trace changed
    (rebound or mutated: the keys, made from the state before the trace, cannot be made from
    the state after it, so the caller takes the verify path)."""

    def __init__(self, objects: Sequence[tuple[str, Any]],
                 ran: Callable[[], int] | None = None) -> None:
        self.objects = list(objects)
        self.names: set[str] = set()
        self.hashed = False
        self.reads: dict[str, tuple[str, ...] | None] = {}
        self.changed: str | None = None
        self._ran = ran
        self._before: list[dict[str, str]] = []
        self._runs = 0
        self._classes: list[type] = []
        self._failed = False

    def __enter__(self) -> StaticReadWatch:
        self._runs = self._ran() if self._ran is not None else 0
        self._before = [_state_digests(v) for _, v in self.objects]
        with _lock:
            for cls in dict.fromkeys(type(v) for _, v in self.objects):
                patched = _patched.get(cls)
                if patched is None:
                    patched = _Patched(cls)
                    try:
                        patched.install()
                    except Exception:  # noqa: BLE001 - a class that refuses: whole state
                        self._failed = True
                        with contextlib.suppress(Exception):  # (nothing was installed)
                            patched.remove()
                        continue
                    _patched[cls] = patched
                patched.watches.append(self)
                self._classes.append(cls)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            for cls in self._classes:
                patched = _patched[cls]
                patched.watches.remove(self)
                if not patched.watches:
                    del _patched[cls]
                    patched.remove()
        for (name, v), before in zip(self.objects, self._before, strict=True):
            after = _state_digests(v)
            moved = sorted(a for a in {*before, *after} if before.get(a) != after.get(a))
            if moved and self.changed is None:
                self.changed = (f"the trace changed {name.removeprefix('static:')}."
                                f"{moved[0]} (a field of a static argument)")
        ran = self._ran is not None and self._ran() != self._runs
        whole = self._failed or self.hashed or not ran or bool(self.names & _WHOLE)
        for name, v in self.objects:
            self.reads[name] = None if whole else _fields_read(v, self.names)


def _fields_read(v: Any, names: set[str]) -> tuple[str, ...]:
    """The names in ``names`` that are fields of ``v``, or that are neither fields nor class
    attributes (a field read while absent: ``hasattr(self, "cache")``)."""
    state = vars(v)
    return tuple(sorted(n for n in names if n in state or not any(
        n in vars(c) for c in type(v).__mro__)))


def _state_digests(v: Any) -> dict[str, str]:
    """Each field of ``v`` -> the digest of a strict walk of its value (or why it has none)."""
    out = {}
    for attr, item in list(vars(v).items()):
        digest, reason = strict_digest(attr, item)
        out[attr] = digest if reason is None else f"unsound: {reason}"
    return out
