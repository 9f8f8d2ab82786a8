"""Names a function only hands to a JAX host-callback API as the callable.

``jax.debug.callback(record, v)``, ``jax.pure_callback(host, shape, x)`` and
``io_callback(sim.advance, shape, x)`` put the callable into the program as a reference: the
trace never calls it and never reads what it holds, so the executable does not depend on the
callable's state (the list ``record`` appends to, the simulator ``sim.advance`` steps), and a
warm start calls the live object (``kiln._base._jax_compat.pickle_callbacks``). Keying that
state would only make a function miss whenever its callbacks have run (a second function keyed
after the first one advanced the simulator) or send it to the verify path (a callback writing
to an open file).

:func:`callback_roots` reads a function's bytecode: a name is a *callback root* when every load
of it in the function's code (and none in its nested code) is the whole first argument of a
call to one of these APIs, as ``name`` or ``name.method``; the call is found by the stack depth
(``dis.stack_effect``), so ``jax.pure_callback(make(x), ...)`` (a call made while tracing) is
not one. Anything less plain (an alias of the API, a conditional, ``*args``) is not a root and
is keyed by value, as before.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import logging
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import io_callback

__all__ = ["callback_only_names", "callback_roots", "log_only_names"]

_API_NAMES = frozenset({"callback", "pure_callback", "io_callback"})
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST", "LOAD_NAME", "LOAD_CLASSDEREF",
                    "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})
_ATTRS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CALL_TAIL = frozenset({"PRECALL", "CALL", "KW_NAMES", "CALL_KW", "CALL_FUNCTION_EX"})
_SKIP = frozenset({"CACHE", "NOP", "EXTENDED_ARG", "RESUME", "PUSH_NULL"})
_USES = _LOADS | frozenset({"LOAD_CLOSURE", "STORE_GLOBAL", "STORE_DEREF", "STORE_FAST",
                            "DELETE_GLOBAL", "DELETE_DEREF", "DELETE_FAST", "STORE_NAME",
                            "DELETE_NAME", "LOAD_FROM_DICT_OR_DEREF",
                            "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_FAST_LOAD_FAST"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
# what could move the first argument or take it without lowering the depth
_REORDER = frozenset({"SWAP", "UNPACK_SEQUENCE", "UNPACK_EX"})


_API_OBJECTS = (jax.debug.callback, jax.pure_callback, io_callback)
_cache: dict[tuple[types.CodeType, int], dict[str, frozenset[str]]] = {}
_NONE: dict[str, frozenset[str]] = {}


def callback_roots(fn: types.FunctionType) -> dict[str, frozenset[str]]:
    """The global and closure names that ``fn`` only passes to a host-callback API as the
    callable (module doc), each with the attributes read off it to get the callable (``ops``
    of ``ops.transform``: ``{"ops": {"transform"}}``; a name passed as it is: no attribute).
    Empty for almost every function (a look at ``co_names`` first)."""
    if not _API_NAMES & set(fn.__code__.co_names):
        return _NONE
    return _cached(_cache, _roots, fn, _NONE)


def _cached(cache: dict[tuple[types.CodeType, int], Any], find: Callable[[types.FunctionType], Any],
            fn: types.FunctionType, default: Any) -> Any:
    """``find(fn)``, once per code and globals (``default`` when it fails: keyed by value)."""
    key = (fn.__code__, id(fn.__globals__))
    got = cache.get(key)
    if got is None:
        try:
            got = find(fn)
        except Exception:  # noqa: BLE001 - anything unexpected: none (keyed by value)
            got = default
        if len(cache) > 4096:
            cache.clear()
        cache[key] = got
    return got


def _instructions(code: types.CodeType) -> list[dis.Instruction]:
    return [i for i in dis.get_instructions(code) if i.opname not in _SKIP]


def _effect(ins: dis.Instruction) -> int:
    if ins.opcode >= dis.HAVE_ARGUMENT:
        return dis.stack_effect(ins.opcode, ins.arg, jump=False)
    return dis.stack_effect(ins.opcode, jump=False)


def _resolve(fn: types.FunctionType, ins: dis.Instruction) -> Any:
    """The value a load of a global or closure variable gives (``_MISSING``: unknown)."""
    name = ins.argval
    if ins.opname == "LOAD_GLOBAL":
        return fn.__globals__.get(name, _MISSING)
    if ins.opname == "LOAD_DEREF" and name in fn.__code__.co_freevars:
        cell = fn.__closure__[fn.__code__.co_freevars.index(name)]  # type: ignore[index]
        try:
            return cell.cell_contents
        except ValueError:
            return _MISSING
    return _MISSING


_MISSING = object()


def _api_calls(fn: types.FunctionType, ins: list[dis.Instruction]) -> Iterator[int]:
    """Where the arguments of each call of a host-callback API start (after ``jax.debug.
    callback``'s loads)."""
    i = 0
    while i < len(ins):
        op = ins[i]
        if op.opname not in ("LOAD_GLOBAL", "LOAD_DEREF"):
            i += 1
            continue
        obj = _resolve(fn, op)
        j = i + 1
        while obj is not _MISSING and j < len(ins) and ins[j].opname in _ATTRS:
            obj = (getattr(obj, ins[j].argval, _MISSING) if isinstance(obj, types.ModuleType)
                   else _MISSING)
            j += 1
        if obj is _MISSING or not any(obj is api for api in _API_OBJECTS):
            i += 1
            continue
        yield j
        i = j


def _roots(fn: types.FunctionType) -> dict[str, frozenset[str]]:
    code = fn.__code__
    ins = _instructions(code)
    candidates: dict[str, int] = {}  # name -> number of its loads that are callback roots
    attrs: dict[str, set[str]] = {}  # name -> the attributes read off it for the callable
    for j in _api_calls(fn, ins):
        found = _first_argument_root(fn, ins, j)
        if found is not None:
            root, attr = found
            candidates[root] = candidates.get(root, 0) + 1
            attrs.setdefault(root, set()).update([attr] if attr else [])
    if not candidates:
        return _NONE
    uses = _uses(code)
    nested = set().union(*(_all_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))
    return {n: frozenset(attrs[n]) for n, k in candidates.items()
            if uses.get(n, 0) == k and n not in nested}


def _first_argument_root(fn: types.FunctionType, ins: list[dis.Instruction],
                         j: int) -> tuple[str, str | None] | None:
    """The name whose load (with at most one attribute, also returned) is the whole first
    argument of the call whose arguments start at ``ins[j]``, or None."""
    if j >= len(ins) or ins[j].opname not in ("LOAD_GLOBAL", "LOAD_DEREF"):
        return None
    if ins[j].opname == "LOAD_GLOBAL" and (ins[j].arg or 0) & 1 and ins[j].argrepr.startswith(
            "NULL"):
        return None  # (a load for a call: ``name(...)``)
    name = ins[j].argval
    first_end = j + 1 if j + 1 < len(ins) and ins[j + 1].opname in _ATTRS else j
    if ins[first_end].opname == "LOAD_METHOD" or not _whole_first_argument(ins, j, first_end):
        return None
    if first_end > j:
        obj = _resolve(fn, ins[j])
        attr = ins[first_end].argval
        member = inspect.getattr_static(type(obj), attr, None) if obj is not _MISSING else None
        if not isinstance(member, types.FunctionType) and attr not in getattr(obj, "__dict__",
                                                                              {}):
            return None  # a property or other descriptor runs code while tracing
        return str(name), str(attr)
    return str(name), None


def _whole_first_argument(ins: list[dis.Instruction], j: int, first_end: int) -> bool:
    """Whether ``ins[j:first_end + 1]`` leaves one value that is the whole first argument of
    the call whose arguments start at ``ins[j]``: the stack depth over the arguments is 1 at
    ``first_end``, the later arguments stay above it (depth >= 2: an instruction that took the
    value, as ``BUILD_TUPLE`` takes a lambda's default in ``callback(lambda v, r=RUN_ID: ...)``,
    leaves at most its one result) until the call, where the depth drops below zero."""
    depths, end = _call_depths(ins, j)
    if end is None or first_end >= end:
        return False
    tail = end
    while tail > j and ins[tail].opname in _CALL_TAIL:
        tail -= 1
    later = range(first_end + 1, tail + 1)
    return (depths[first_end - j] == 1 and all(depths[k - j] >= 2 for k in later)
            and not any(ins[k].opname in _REORDER for k in later))


def _call_depths(ins: list[dis.Instruction], j: int,
                 stop: frozenset[str] = frozenset()) -> tuple[list[int], int | None]:
    """The stack depth after each instruction from ``ins[j]`` (where a call's arguments start)
    to the one that takes them (its index; None when a jump, or one of ``stop``, comes first)."""
    depth = 0
    depths: list[int] = []
    for k in range(j, len(ins)):
        if ins[k].opcode in _JUMPS or ins[k].opname in stop:
            return depths, None
        depth += _effect(ins[k])
        depths.append(depth)
        if depth < 0:
            return depths, k
    return depths, None


def callback_only_names(fn: types.FunctionType) -> frozenset[str]:
    """The names that only functions ``fn`` makes and passes at once to a host-callback API
    read (``jax.debug.callback(lambda v: print(RUN_ID, v), y)``: ``RUN_ID``), that ``fn``'s
    own code and its other nested functions never name. Such a function runs when the program
    runs, not while tracing; a warm start binds it to the module's live globals
    (``kiln._base._jax_compat.pickle_callbacks``), so what those names hold is not part of the
    program (issue 42: a process-varying global read there made every warm start miss)."""
    code = fn.__code__
    if not _API_NAMES & set(code.co_names):
        return frozenset()
    try:
        ins = _instructions(code)
        made = {c for j in _api_calls(fn, ins) if (c := _first_argument_code(ins, j))}
    except Exception:  # noqa: BLE001 - anything unexpected: none (keyed by value)
        return frozenset()
    if not made:
        return frozenset()
    own = set(code.co_names) | set(code.co_freevars) | set(code.co_cellvars) | _strings(code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and c not in made:
            own |= _all_names(c) | _strings(c)
    return frozenset(set().union(*map(_all_names, made)) - own)


_MAKE_FUNCTION = frozenset({"MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"})


def _first_argument_code(ins: list[dis.Instruction], j: int) -> types.CodeType | None:
    """The code of the function made as the whole first argument of the call whose arguments
    start at ``ins[j]`` (``lambda v: ...``, a closure's cells its only other input: no
    defaults), or None."""
    k = j
    while k < len(ins) and ins[k].opname in ("LOAD_CLOSURE", "BUILD_TUPLE"):
        k += 1
    if k >= len(ins) or ins[k].opname != "LOAD_CONST" or not isinstance(ins[k].argval,
                                                                       types.CodeType):
        return None
    first_end = k + 1
    while first_end < len(ins) and ins[first_end].opname in _MAKE_FUNCTION:
        first_end += 1
    first_end -= 1
    return ins[k].argval if first_end > k and _whole_first_argument(ins, j, first_end) else None


def _uses(code: types.CodeType) -> Counter[str]:
    return Counter(i.argval for i in _instructions(code)
                   if i.opname in _USES and isinstance(i.argval, str))


def _all_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars) | set(code.co_cellvars)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _all_names(c)
    return names


_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical",
                          "log", "fatal"})
_log_cache: dict[tuple[types.CodeType, int], frozenset[str]] = {}


def log_only_names(fn: types.FunctionType) -> frozenset[str]:
    """The globals whose every load in ``fn``'s code (none in its nested code) is a whole
    argument of a log line or a ``print`` (``logger.info("tracing in run %s", RUN_ID)``,
    ``logging.warning(...)``, ``print("run", RUN_ID)``; positional arguments only, of
    ``logging``'s own methods and Python's own ``print``): written while tracing, they are not
    part of the program, and a warm start, which does not trace, writes no such line (a
    documented difference, docs/never-stale.md). Keying them made every warm start miss when
    the name held a run id (issue 42). An argument that is computed (``str(RUN_ID)``,
    ``RUN_ID.upper()``) or a value used anywhere else keeps the name keyed."""
    if not (_LOG_METHODS | {"print"}) & set(fn.__code__.co_names):
        return frozenset()
    return _cached(_log_cache, _log_only, fn, frozenset())


def _log_only(fn: types.FunctionType) -> frozenset[str]:
    code = fn.__code__
    ins = _instructions(code)
    counts = Counter(name for j in _log_calls(fn, ins)
                     for name in _bare_global_arguments(ins, j, code.co_consts))
    if not counts:
        return frozenset()
    uses = _uses(code)
    nested = _strings(code)  # also read by its name as a string (``globals()["RUN_ID"]``)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            nested |= _all_names(c) | _strings(c)
    return frozenset(n for n, k in counts.items() if uses.get(n, 0) == k and n not in nested)


def _log_calls(fn: types.FunctionType, ins: list[dis.Instruction]) -> Iterator[int]:
    """Where the arguments of each call of a log method of a logger (its class's method
    ``logging`` defines, not one a subclass overrides) or of ``logging``, or of the builtin
    ``print`` as Python defines it (not a patched one), start."""
    for i, op in enumerate(ins):
        if op.opname != "LOAD_GLOBAL":
            continue
        obj = _resolve(fn, op)
        if obj is _MISSING and op.argval == "print":
            obj = getattr(builtins, "print", None)
        if obj is _PRINT:
            yield i + 1
        elif (i + 1 < len(ins) and ins[i + 1].opname in _ATTRS
              and ins[i + 1].argval in _LOG_METHODS and _is_logging(obj, ins[i + 1].argval)):
            yield i + 2


_PRINT = builtins.print  # as at import: a patched print may do anything with what it gets


def _is_logging(obj: Any, method: str) -> bool:
    """``obj.method`` is ``logging``'s own: the module's function, or the method of
    ``logging.Logger`` / ``LoggerAdapter`` that the object's class does not override."""
    if obj is logging:
        return True
    for base in (logging.Logger, logging.LoggerAdapter):
        if isinstance(obj, base):
            return getattr(type(obj), method, None) is getattr(base, method, None)
    return False


def _strings(code: types.CodeType) -> set[str]:
    return {c for c in code.co_consts if type(c) is str}


def _bare_global_arguments(ins: list[dis.Instruction], j: int,
                           consts: tuple[Any, ...]) -> list[str]:
    """The globals loaded as a whole argument (nothing done to the value until the call) of
    the call whose arguments start at ``ins[j]``."""
    depths, end = _call_depths(ins, j, _REORDER)
    if end is None or ins[end].opname not in ("CALL", "CALL_KW"):
        return []  # (``*args``, ``**kwargs``: which argument is which is not plain)
    tail = end - 1  # the last instruction before this call's own tail (not a nested call's)
    kw: tuple[str, ...] = ()
    while tail >= j and ins[tail].opname in ("PRECALL", "KW_NAMES"):
        if ins[tail].opname == "KW_NAMES":  # (its argument indexes co_consts: 3.11, 3.12)
            kw = tuple(consts[ins[tail].arg or 0])
        tail -= 1
    if ins[end].opname == "CALL_KW":
        kw = tuple(ins[tail].argval)  # (a LOAD_CONST of the names, Python 3.13)
    positional = (ins[end].arg or 0) - len(kw)  # keyword values (``file=SINK``) do not count
    out = []
    for p in range(j, tail + 1):
        op = ins[p]
        if op.opname != "LOAD_GLOBAL" or op.argrepr.startswith("NULL"):
            continue
        before = depths[p - j - 1] if p > j else 0
        if before < positional and depths[p - j] == before + 1 and all(
                depths[k - j] >= before + 2 for k in range(p + 1, tail + 1)):
            out.append(str(op.argval))
    return out
