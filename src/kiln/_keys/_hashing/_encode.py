"""The canonical encoder (:func:`encode`: the encoder of a value's kind, from the tables the
face fills, feeds its bytes to a hasher), the helpers encoders write with, and the encoders of
Python's own kinds and of the standard library's values (the layout: :mod:`kiln._keys._hashing`).
"""

from __future__ import annotations

import collections
import collections.abc
import contextvars
import dataclasses
import datetime
import decimal
import fractions
import functools
import operator
import pathlib
import re
import struct
import sys
import uuid
import zoneinfo
from collections.abc import Callable
from typing import Any

import jax
import xxhash

from ..._base import StaticArgumentError
from .._libraries import is_user_class


class Unpersistable(Exception):
    """A static argument is usable in-process but has no canonical cross-process digest.

    Raised by :func:`kiln._keys._hashing.static_digest` for hashable objects that are compared
    by identity (a lambda, a local function, an instance with the default ``__hash__``). The
    caller falls back to a process-local path keyed by ``hash``/``==``, exactly like
    ``jax.jit``'s static arguments.
    """


# Path through a nested value, built lazily: None (root) or (parent, kind, key). Formatted only
# when an error is raised, in jax ``keystr`` style: ``[0]``, ``['key']``, ``.attr``.
Path = tuple[Any, int, Any] | None
INDEX, KEY, ATTR, JAXKEY = 0, 1, 2, 3

pack_q = struct.Struct("<Q").pack
pack_i64 = struct.Struct("<q").pack
new_hasher = xxhash.xxh3_128
Hasher = Any  # xxhash.xxh3_128 instance
Encoder = Callable[[Hasher, Any, str, Path], None]

# A value is encoded by the encoder its exact type names here, else by the encoder of the
# first test it passes here (a tuple of types it is an instance of, or a predicate), else
# refused (:func:`refuse`): filled by the face, in its order
EXACT: dict[type, Encoder] = {}
FALLBACKS: list[tuple[tuple[type, ...] | Callable[[Any], bool], Encoder]] = []


def encode(h: Hasher, v: Any, argname: str, path: Path) -> None:
    enc = EXACT.get(type(v))
    if enc is not None:
        enc(h, v, argname, path)
        return
    for test, fallback in FALLBACKS:
        if isinstance(v, test) if type(test) is tuple else test(v):  # type: ignore[operator]
            fallback(h, v, argname, path)
            return
    refuse(h, v, argname, path)


def sub_digest(v: Any, argname: str, path: Path) -> bytes:
    h = new_hasher()
    encode(h, v, argname, path)
    return h.digest()


def refuse(h: Hasher, v: Any, argname: str, path: Path) -> None:
    """A value of no kind kiln encodes: hashed by identity, or not hashable at all."""
    tp = type(v)
    if tp.__hash__ is not None:
        raise Unpersistable(
            f"{where(argname, path)} of type {type_name(tp)} is hashed by identity and has no "
            "canonical cross-process digest. Define __kiln_digest__(self) -> bytes on the class, "
            "use a dataclass or an importable top-level object, or mark the argument as dynamic."
        )
    raise StaticArgumentError(
        f"{where(argname, path)} of type {type_name(tp)} is not hashable and cannot be hashed "
        "by value. Make it hashable (for example a frozen dataclass), define "
        "__kiln_digest__(self) -> bytes, or mark the argument as dynamic."
    )


def where(argname: str, path: Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, kind, key = path
        if kind == INDEX:
            parts.append(f"[{key}]")
        elif kind == KEY:
            parts.append(f"[{key!r}]")
        elif kind == ATTR:
            parts.append(f".{key}")
        else:
            parts.append(jax.tree_util.keystr((key,)))
    text = "".join(reversed(parts))
    return f"static argument {argname!r}" + (f" (path: {text})" if text else "")


def type_name(tp: type) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


def importable_name(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` if importing that name gives back ``obj`` itself, else None."""
    try:
        module = obj.__module__
        qualname = getattr(obj, "__qualname__", None) or obj.__name__
    except AttributeError:
        return None
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    target: Any = sys.modules.get(module)
    if target is None:
        return None
    for part in qualname.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return None
    return (module, qualname) if target is obj else None


_MISSING = object()


def write_str(h: Hasher, s: str) -> None:
    data = s.encode("utf-8", "surrogatepass")
    h.update(pack_q(len(data)))
    h.update(data)


def write_name(h: Hasher, obj: Any, what: str, argname: str, path: Path) -> None:
    name = importable_name(obj)
    if name is None and by_code.get() and (not isinstance(obj, type) or is_user_class(obj)):
        # (a library class made at run time counts by its name and version in the walk, not
        # by what it holds: it has no digest)
        write_by_code(h, obj)
        return
    if name is None:
        raise Unpersistable(
            f"{where(argname, path)}: {what} {_describe(obj)} cannot be imported back by its "
            "module and qualname, so it has no canonical cross-process digest. Define it at the "
            "top level of a module, give the value a __kiln_digest__ method, or mark the "
            "argument as dynamic."
        )
    write_str(h, name[0])
    write_str(h, name[1])


# static_digest_by_code is running (in this context): what has no name that imports back is
# written by its description, the caller keys it by code
by_code: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_by_code", default=False)


def write_by_code(h: Hasher, obj: Any) -> None:
    h.update(b"C")
    write_str(h, f"{type_name(type(obj))}:{_describe(obj)}")


def _describe(obj: Any) -> str:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(mod, str) and isinstance(qual, str):
        return f"{mod}.{qual}"
    return f"of type {type_name(type(obj))}"


# -- Python's own kinds ----------------------------------------------------------------------

_pack_d = struct.Struct("<d").pack
_pack_dd = struct.Struct("<dd").pack


def enc_int(h: Hasher, v: int, argname: str, path: Path) -> None:
    if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        h.update(b"i" + pack_i64(v))
    else:
        data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        h.update(b"I" + pack_q(len(data)))
        h.update(data)


def enc_str(h: Hasher, v: str, argname: str, path: Path) -> None:
    data = v.encode("utf-8", "surrogatepass")
    h.update(b"s" + pack_q(len(data)))
    h.update(data)


def _enc_bytes(tag: bytes) -> Encoder:
    def enc(h: Hasher, v: bytes | bytearray, argname: str, path: Path) -> None:
        h.update(tag + pack_q(len(v)))
        h.update(v)

    return enc


def _enc_seq(tag: bytes) -> Encoder:
    def enc(h: Hasher, v: Any, argname: str, path: Path) -> None:
        h.update(tag + pack_q(len(v)))
        for i, item in enumerate(v):
            encode(h, item, argname, (path, INDEX, i))

    return enc


def enc_items(
    h: Hasher, items: collections.abc.Collection[tuple[Any, Any]], argname: str, path: Path
) -> None:
    """The items of a mapping IN ITERATION ORDER: the order is part of the value, since a trace
    that iterates the mapping (``[x * v for v in cfg.values()]``) builds another program."""
    h.update(b"{" + pack_q(len(items)))
    for k, val in items:
        item_path = (path, KEY, k)
        encode(h, k, argname, item_path)
        encode(h, val, argname, item_path)


def _enc_set(tag: bytes) -> Encoder:
    # Sorted by element digest: a set has no order of its own that survives processes (a set of
    # strings iterates in an order that changes with PYTHONHASHSEED), so equal sets must get one
    # digest whatever order this process happens to iterate them in.
    def enc(h: Hasher, v: Any, argname: str, path: Path) -> None:
        digests = sorted(sub_digest(item, argname, path) for item in v)
        h.update(tag + pack_q(len(digests)))
        for d in digests:
            h.update(d)

    return enc


EXACT_ENCODERS: dict[type, Encoder] = {
    type(None): lambda h, v, argname, path: h.update(b"N"),
    bool: lambda h, v, argname, path: h.update(b"T" if v else b"F"),
    int: enc_int,
    float: lambda h, v, argname, path: h.update(b"f" + _pack_d(v)),
    complex: lambda h, v, argname, path: h.update(b"c" + _pack_dd(v.real, v.imag)),
    str: enc_str,
    bytes: _enc_bytes(b"b"),
    bytearray: _enc_bytes(b"B"),
    tuple: _enc_seq(b"("),
    list: _enc_seq(b"["),
    dict: lambda h, v, argname, path: enc_items(h, v.items(), argname, path),
    frozenset: _enc_set(b"Z"),
    set: _enc_set(b"z"),
}


def enc_digest_hook(h: Hasher, v: Any, argname: str, path: Path) -> None:
    """An object that says its own canonical digest: ``__kiln_digest__(self) -> bytes | str``."""
    tp = type(v)
    out = tp.__kiln_digest__(v)
    if isinstance(out, str):
        out = out.encode("utf-8", "surrogatepass")
    if not isinstance(out, bytes):
        raise StaticArgumentError(
            f"{where(argname, path)}: {type_name(tp)}.__kiln_digest__ returned "
            f"{type(out).__name__}; it must return bytes or str."
        )
    h.update(b"U")
    write_str(h, tp.__module__)
    write_str(h, tp.__qualname__)
    h.update(pack_q(len(out)))
    h.update(out)


def enc_enum(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"E")
    write_name(h, type(v), "enum class", argname, path)
    write_str(h, v.name)
    encode(h, v.value, argname, (path, ATTR, "value"))


def enc_class(h: Hasher, v: type, argname: str, path: Path) -> None:
    h.update(b"Y")
    write_name(h, v, "class", argname, path)


OPERATOR_TYPES = (operator.methodcaller, operator.attrgetter, operator.itemgetter)


def enc_operator(h: Hasher, v: Any, argname: str, path: Path) -> None:
    # jax.tree_util.register_pytree_node_class registers methodcaller("tree_flatten"): by
    # what it calls, from its __reduce__ (the names and arguments)
    h.update(b"O")
    write_str(h, type(v).__qualname__)
    encode(h, v.__reduce__(), argname, (path, ATTR, "<reduce>"))


def enc_partial(h: Hasher, v: functools.partial[Any], argname: str, path: Path) -> None:
    h.update(b"P")
    encode(h, v.func, argname, (path, ATTR, "func"))
    encode(h, v.args, argname, (path, ATTR, "args"))
    encode(h, v.keywords, argname, (path, ATTR, "keywords"))


def enc_dataclass(h: Hasher, v: Any, argname: str, path: Path) -> None:
    fields = dataclasses.fields(v)
    h.update(b"D")
    write_name(h, type(v), "dataclass", argname, path)
    h.update(pack_q(len(fields)))
    for f in fields:
        write_str(h, f.name)
        encode(h, getattr(v, f.name), argname, (path, ATTR, f.name))


def enc_mapping(h: Hasher, v: Any, argname: str, path: Path) -> None:
    """A mapping other than a plain dict: its class by name (a ``defaultdict`` also by its
    ``default_factory``), then its items in iteration order, as a dict."""
    h.update(b"M")
    write_name(h, type(v), "mapping class", argname, path)
    if isinstance(v, collections.defaultdict):
        h.update(b"f")
        encode(h, v.default_factory, argname, (path, ATTR, "default_factory"))
    else:
        h.update(b"-")
    enc_items(h, list(v.items()), argname, path)  # (a list: len and iteration agree)


# Builtin bases, most specific first, for subclasses (IntEnum and friends are caught earlier;
# dict subclasses are mappings: enc_mapping).
BUILTIN_BASES = (bool, int, float, complex, str, bytes, bytearray, tuple, list, frozenset, set)


def enc_builtin_subclass(h: Hasher, v: Any, argname: str, path: Path) -> None:
    base = next(b for b in BUILTIN_BASES if isinstance(v, b))
    h.update(b"X")
    write_name(h, type(v), "class", argname, path)
    EXACT[base](h, base(v), argname, path)


def enc_importable(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"G")
    write_name(h, v, "function", argname, path)


# -- the standard library's values ---------------------------------------------------------

_pack_3q = struct.Struct("<3q").pack
_pack_5q = struct.Struct("<5q").pack
_pack_8q = struct.Struct("<8q").pack


def _enc_datetime(h: Hasher, v: datetime.datetime, argname: str, path: Path) -> None:
    # fold too: it picks the offset of an ambiguous local time, though == ignores it
    fields = (v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold)
    h.update(b"St" + _pack_8q(*fields))
    _enc_tzinfo(h, v.tzinfo, argname, (path, ATTR, "tzinfo"))


def _enc_time(h: Hasher, v: datetime.time, argname: str, path: Path) -> None:
    h.update(b"Sh" + _pack_5q(v.hour, v.minute, v.second, v.microsecond, v.fold))
    _enc_tzinfo(h, v.tzinfo, argname, (path, ATTR, "tzinfo"))


def _enc_tzinfo(h: Hasher, tz: datetime.tzinfo | None, argname: str, path: Path) -> None:
    """None, a fixed offset or an IANA zone by key; any other tzinfo computes offsets in its own
    code, which has no canonical digest."""
    if tz is None:
        h.update(b"N")
    elif type(tz) is datetime.timezone or type(tz) is zoneinfo.ZoneInfo:
        STDLIB_ENCODERS[type(tz)](h, tz, argname, path)
    else:
        raise Unpersistable(
            f"{where(argname, path)} is a tzinfo of type {type_name(type(tz))}, which "
            "computes offsets in its own code and has no canonical cross-process digest. Use "
            "datetime.timezone or zoneinfo.ZoneInfo, or mark the argument as dynamic."
        )


def _enc_timedelta(h: Hasher, v: datetime.timedelta, argname: str, path: Path) -> None:
    h.update(b"SD" + _pack_3q(v.days, v.seconds, v.microseconds))


def _enc_timezone(h: Hasher, v: datetime.timezone, argname: str, path: Path) -> None:
    # the name too (``strftime("%Z")`` shows it), though == compares offsets only
    h.update(b"Sz")
    _enc_timedelta(h, v.utcoffset(None), argname, path)
    write_str(h, v.tzname(None))


def _enc_zoneinfo(h: Hasher, v: zoneinfo.ZoneInfo, argname: str, path: Path) -> None:
    if v.key is None:  # ZoneInfo.from_file: rules from a file object, no name to key them by
        raise Unpersistable(
            f"{where(argname, path)} is a zoneinfo.ZoneInfo read from a file (its key is "
            "None), which has no canonical cross-process digest. Use ZoneInfo(key), or mark "
            "the argument as dynamic."
        )
    h.update(b"SZ")
    write_str(h, v.key)


def _enc_decimal(h: Hasher, v: decimal.Decimal, argname: str, path: Path) -> None:
    # as_tuple, not ==: Decimal("1.0") == Decimal("1.00") but their str differ, as -0 and 0 do
    sign, digits, exponent = v.as_tuple()
    h.update(b"S$" + pack_i64(sign) + pack_q(len(digits)))
    h.update(bytes(digits))
    encode(h, exponent, argname, path)  # an int, or "n" (NaN), "N" (sNaN), "F" (infinity)


def _enc_fraction(h: Hasher, v: fractions.Fraction, argname: str, path: Path) -> None:
    h.update(b"Sq")
    enc_int(h, v.numerator, argname, path)
    enc_int(h, v.denominator, argname, path)


def _enc_pattern(h: Hasher, v: re.Pattern[Any], argname: str, path: Path) -> None:
    h.update(b"Sr")
    encode(h, v.pattern, argname, (path, ATTR, "pattern"))  # (str and bytes tagged apart)
    h.update(pack_i64(v.flags))


def _enc_deque(h: Hasher, v: collections.deque[Any], argname: str, path: Path) -> None:
    h.update(b"Sk")
    encode(h, v.maxlen, argname, (path, ATTR, "maxlen"))
    h.update(pack_q(len(v)))
    for i, item in enumerate(v):
        encode(h, item, argname, (path, INDEX, i))


def _enc_path(h: Hasher, v: pathlib.PurePath, argname: str, path: Path) -> None:
    # the class by its name alone (its module moved in 3.13): it says how the text is parsed
    h.update(b"SP")
    write_str(h, type(v).__name__)
    write_str(h, str(v))


# pathlib's own classes (a user's subclass may hold more than its text)
_PATH_TYPES = (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path,
               pathlib.PosixPath, pathlib.WindowsPath)

STDLIB_ENCODERS: dict[type, Encoder] = {
    datetime.date: lambda h, v, argname, path: h.update(b"Sd" + _pack_3q(v.year, v.month, v.day)),
    datetime.datetime: _enc_datetime,
    datetime.time: _enc_time,
    datetime.timedelta: _enc_timedelta,
    datetime.timezone: _enc_timezone,
    zoneinfo.ZoneInfo: _enc_zoneinfo,
    decimal.Decimal: _enc_decimal,
    fractions.Fraction: _enc_fraction,
    re.Pattern: _enc_pattern,
    collections.deque: _enc_deque,
    uuid.UUID: lambda h, v, argname, path: h.update(b"Su" + v.bytes),
    **dict.fromkeys(_PATH_TYPES, _enc_path),
}
