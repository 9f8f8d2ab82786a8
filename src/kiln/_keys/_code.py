"""Code objects: their digests, the names they read, and loops whose order a hash seed decides.

A code object's digest covers its bytecode, constants (nested code recursively), names and
arity, never line numbers or file names. The names it reads (globals, attributes, identifier
strings) tell the walk which module attributes to follow.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import types
from typing import Any

import xxhash

from .._base import StaticArgumentError
from ._hashing import Unpersistable, static_digest

__all__ = [
    "code_digest",
    "code_names",
    "hash_seed_fixed",
    "iterated_set_constant",
    "module_strings",
    "nested_codes",
    "order_is_stable",
    "relative_imports",
]


@functools.lru_cache(maxsize=8192)
def code_names(code: types.CodeType) -> frozenset[str]:
    """Names ``code`` reads (globals, attributes) and identifier-like string constants
    (``getattr(mod, "SCALE")``), nested code included."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_names(c)
        elif type(c) is str and c.isidentifier():
            names.add(c)
    return frozenset(names)


def nested_codes(code: types.CodeType) -> set[types.CodeType]:
    """``code`` and every code object nested in it (lambdas, local functions, comprehensions)."""
    out = {code}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= nested_codes(c)
    return out


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


@functools.lru_cache(maxsize=8192)
def relative_imports(code: types.CodeType) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """``(level, name, fromlist)`` of each relative import in ``code`` (nested code included):
    ``from . import consts`` is ``(1, "", ("consts",))``, ``from ..sub import X`` is
    ``(2, "sub", ("X",))``. The level is an operand of ``IMPORT_NAME`` (the constant loaded
    two instructions before it), not a name, so :func:`code_names` cannot see it; code is
    disassembled only when its bytecode holds that opcode."""
    out: list[tuple[int, str, tuple[str, ...]]] = []
    if _IMPORT_NAME in code.co_code[::2]:
        ins = list(dis.get_instructions(code))
        for i, op in enumerate(ins):
            if op.opcode != _IMPORT_NAME or i < 2:
                continue
            level, fromlist = ins[i - 2].argval, ins[i - 1].argval
            if ins[i - 2].opname == "LOAD_CONST" and type(level) is int and level > 0:
                names = fromlist if isinstance(fromlist, tuple) else ()
                out.append((level, op.argval, tuple(n for n in names if type(n) is str)))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.extend(relative_imports(c))
    return tuple(out)


def module_strings(code: types.CodeType) -> set[str]:
    """String constants of ``code`` that name imported modules (``import_module("mod")``)."""
    return {c for k in nested_codes(code) for c in k.co_consts
            if type(c) is str and c in sys.modules}


@functools.lru_cache(maxsize=8192)
def code_digest(code: types.CodeType) -> str:
    """Digest of a code object (see the module doc). Constants are hashed canonically
    (:func:`kiln._keys._hashing.static_digest`), never by ``repr``: a ``frozenset`` constant
    (``x in {"a", "b"}``) has the same digest under every ``PYTHONHASHSEED``."""
    h = xxhash.xxh3_128()
    _feed_code(h, code)
    return h.hexdigest()


def _feed_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                   code.co_flags, code.co_names, code.co_varnames, code.co_freevars,
                   code.co_cellvars, code.co_name)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            h.update(b"<code>")
            _feed_code(h, c)
        else:
            h.update(type(c).__name__.encode())
            try:
                h.update(static_digest(c, argname="constant").encode())
            except (Unpersistable, StaticArgumentError):  # Ellipsis and other singletons
                h.update(repr(c).encode())


@functools.lru_cache(maxsize=8192)
def iterated_set_constant(code: types.CodeType) -> str | None:
    """A ``for`` loop over a set literal whose order depends on the hash seed, if ``code`` (or
    code nested in it) has one: ``for n in {"a", "b"}`` iterates a frozenset constant in an
    order that changes with ``PYTHONHASHSEED`` (membership tests do not care)."""
    prev: Any = None
    # (disassembled only when it holds such a constant: dis costs ~0.5 ms per code object)
    unstable = any(isinstance(c, frozenset) and not order_is_stable(c) for c in code.co_consts)
    for ins in dis.get_instructions(code) if unstable else ():
        if ins.opname == "GET_ITER" and prev is not None and prev.opname == "LOAD_CONST" \
                and isinstance(prev.argval, frozenset) and not order_is_stable(prev.argval):
            return f"{code.co_qualname} iterates the set {sorted(map(repr, prev.argval))[:4]}"
        prev = ins
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            found = iterated_set_constant(c)
            if found:
                return found
    return None


def order_is_stable(items: Any) -> bool:
    """Whether a set of ``items`` iterates in the same order in every process: their hashes
    do not depend on ``PYTHONHASHSEED`` or on memory addresses (numbers, None, tuples of them)."""
    return all(
        type(e) in (int, float, bool, complex, type(None))
        or (type(e) is tuple and order_is_stable(e))
        for e in items
    )


def hash_seed_fixed() -> bool:
    """``PYTHONHASHSEED`` is set to a number: str and bytes hashes repeat across processes
    started with the same value."""
    return os.environ.get("PYTHONHASHSEED", "random").isdigit()
