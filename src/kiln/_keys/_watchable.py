"""Which objects can be keyed by the fields a trace reads (:mod:`kiln._keys._static_reads`)."""

from __future__ import annotations

import enum
import functools
import sys
import types
from typing import Any

from ._hashing import digested_by_meaning

__all__ = ["watchable"]


def watchable(v: Any) -> bool:
    """Whether static value ``v`` can be keyed by the fields its trace reads: an instance of a
    class defined in Python source (user or library) whose whole state is its ``__dict__`` (no
    slots, no builtin base but ``object``, no ``__kiln_digest__`` of its own saying what it is,
    not an enum, a function, a class or a module, nor a value :mod:`kiln._keys._hashing` digests
    by meaning, such as a ``jax.sharding.Mesh`` whose caches a trace fills)."""
    cls = type(v)
    if digested_by_meaning(v) or isinstance(
            v, type | types.FunctionType | types.MethodType | types.ModuleType
            | functools.partial | enum.Enum) or getattr(cls, "__kiln_digest__", None):
        return False
    if not isinstance(getattr(v, "__dict__", None), dict):
        return False
    for c in cls.__mro__[:-1]:
        if c.__module__ == "builtins" or "__slots__" in vars(c) and vars(c)["__slots__"] not in (
                (), "__dict__", ("__dict__",), ("__weakref__",), ("__dict__", "__weakref__")):
            return False
        mod = sys.modules.get(c.__module__)
        f = getattr(mod, "__file__", None)
        if not (isinstance(f, str) and f.endswith(".py")) or c.__module__.startswith("kiln."):
            return False
    return cls.__mro__[-1] is object
