"""Which fields of a global config container walked code reads, from its bytecode.

A ``types.SimpleNamespace`` or a plain ``dict`` held in a global (``CFG.lr``,
``CONFIG["lr"]``, ``CONFIG.get("lr", 0.1)``) cannot be watched for the fields a trace reads
as other objects are (:mod:`kiln._keys._static_reads` patches the object's class, and a
builtin class cannot be patched). Keying it whole made every warm start miss when it also held
a value that changes from run to run and that the program never reads (a run name from
``time.time()``, a ``uuid4`` run id; issue 42). Instead, :func:`constant_fields` reads the
code: when every use of the name, in every code object the walk met, reads one field named by
a constant, only those fields are keyed. Any other use (the container passed to a function,
iterated, subscripted by a variable, stored, ``vars(CFG)``, a dunder attribute, ``in``) and
the container is keyed whole, as before.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterable

__all__ = ["constant_fields"]

_SKIP = frozenset({"CACHE", "NOP", "EXTENDED_ARG", "RESUME", "PUSH_NULL", "PRECALL"})
_NAME_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "LOAD_DEREF",
                       "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_FROM_DICT_OR_DEREF",
                       "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_CLOSURE",
                       "STORE_GLOBAL", "STORE_NAME", "STORE_ATTR", "STORE_FAST", "STORE_DEREF",
                       "DELETE_GLOBAL", "DELETE_NAME", "DELETE_ATTR", "DELETE_FAST",
                       "DELETE_DEREF", "IMPORT_NAME", "IMPORT_FROM"})
_CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD"})

_cache: dict[tuple[types.CodeType, str, bool], frozenset[str] | None] = {}


def constant_fields(codes: Iterable[types.CodeType], name: str, *,
                    mapping: bool) -> frozenset[str] | None:
    """The fields of the container held by global ``name`` that ``codes`` read, or None when
    some use is not a read of one constant field.

    ``mapping``: a ``dict`` (``D["k"]``, ``D.get("k")``, ``D.get("k", const)``), else an object
    whose fields are attributes (``NS.k``). A code naming ``name`` anywhere else (also as an
    attribute of a module, ``cfgmod.CFG.lr``, which counts as a read of ``lr``) is read the same
    way; a code that names it in a way not listed gives None."""
    out: set[str] = set()
    for code in codes:
        if name in code.co_consts:
            return None  # named by a string (``getattr(settings, "CFG")``, ``globals()["CFG"]``)
        if name not in code.co_names and name not in code.co_varnames \
                and name not in code.co_cellvars and name not in code.co_freevars:
            continue
        key = (code, name, mapping)
        if key not in _cache:
            try:
                _cache[key] = _fields_in(code, name, mapping)
            except Exception:  # noqa: BLE001 - anything unexpected: keyed whole
                _cache[key] = None
        got = _cache[key]
        if got is None:
            return None
        out |= got
    return frozenset(out)


def _fields_in(code: types.CodeType, name: str, mapping: bool) -> frozenset[str] | None:
    ins = [i for i in dis.get_instructions(code) if i.opname not in _SKIP]
    out: set[str] = set()
    for k, op in enumerate(ins):
        if op.opname not in _NAME_OPS or op.argval != name:
            continue
        if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR") or (
                op.opname == "LOAD_ATTR" and "NULL" in op.argrepr):
            return None  # stored, deleted, a local of that name, or a method's load
        # (``LOAD_GLOBAL (NULL + ACTS)`` starts a call whose callee is read from the global:
        # ``ACTS["relu"](x)``; ``CFG(...)`` itself reads no field, below)
        field = _field_read(ins, k + 1, mapping)
        if field is None:
            return None
        out.add(field)
    return frozenset(out)


def _field_read(ins: list[dis.Instruction], j: int, mapping: bool) -> str | None:
    """The constant field read by the instructions from ``ins[j]`` on the container loaded just
    before, or None."""
    if j >= len(ins):
        return None
    op = ins[j]
    if not mapping:
        if op.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(op.argval, str) \
                and not op.argval.startswith("__"):
            return op.argval
        return None
    if op.opname == "LOAD_CONST" and isinstance(op.argval, str) and j + 1 < len(ins) and (
            ins[j + 1].opname == "BINARY_SUBSCR"
            or ins[j + 1].opname == "BINARY_OP" and ins[j + 1].argrepr == "[]"):
        return op.argval
    if op.opname in ("LOAD_ATTR", "LOAD_METHOD") and op.argval == "get":
        # D.get("k") or D.get("k", const): the key, then at most one constant, then the call
        if j + 1 >= len(ins) or ins[j + 1].opname != "LOAD_CONST" or not isinstance(
                ins[j + 1].argval, str):
            return None
        rest = ins[j + 2:j + 4]
        if (rest and rest[0].opname in _CALLS and rest[0].arg == 1) or (len(rest) == 2 and
                rest[0].opname == "LOAD_CONST" and rest[1].opname in _CALLS and rest[1].arg == 2):
            return ins[j + 1].argval
    return None
