"""Canonical, cross-process digests of static arguments.

A static argument is hashed BY VALUE into a 128-bit ``xxh3_128`` digest (32 hex chars). The
digest is used twice: as an in-process dictionary key, and as one part of the persistent cache
key, so it must be identical across processes, machines and Python hash seeds. It therefore never
uses ``hash()`` of a ``str``, ``id()``, ``repr()`` of arbitrary objects or pickle.

What "equal" means:

* Two values get the same digest when they have the same type tag and the same canonical content.
  ``1``, ``1.0``, ``True``, ``"1"``, ``np.int32(1)`` and ``np.float32(1)`` all differ.
* Floats are compared by IEEE-754 bits: ``-0.0`` differs from ``0.0`` and a NaN equals a NaN with
  the same bits (unlike ``==``).
* A mapping is keyed IN ITERATION ORDER: ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` differ,
  because code iterating it (``[x * v for v in cfg.values()]``) builds a different program. This
  holds for ``dict``, its subclasses (``OrderedDict``; ``defaultdict`` also records its
  ``default_factory``, which a trace can call), ``flax.core.FrozenDict`` (a pytree whose flatten
  sorts its keys, so it is hashed as a mapping, never through the pytree), flax's
  ``HashableMapping`` (in an nnx ``GraphDef``) and any other hashable
  ``collections.abc.Mapping``; a mapping other than a plain ``dict`` also records its class.
  An unhashable mapping that is not a ``dict`` (``os.environ``, a custom ``MutableMapping``) is
  not hashed by its items (nothing says they are all of its value): a registered pytree node is
  hashed as one, anything else is refused as unhashable.
* ``set``/``frozenset`` elements are sorted by their own digest, so two equal sets get one digest:
  a set has no order of its own that survives processes (the iteration order of a set of strings
  changes with ``PYTHONHASHSEED``), so sorting is the only order that is the same in every process.
* Sharding objects are hashed by what they mean, never by identity or their private caches: a
  ``jax.Device`` by id, platform, device kind and process index; a ``jax.sharding.Mesh`` (used or
  not) by axis names, devices shape, axis types and each device; an ``AbstractMesh`` by axis sizes,
  names, types and its abstract device; a ``NamedSharding`` by mesh, ``PartitionSpec`` and memory
  kind; a ``SingleDeviceSharding`` by device and memory kind; an ``AxisType`` by member name. A
  NumPy object array whose elements are all devices is hashed as a device array. Two processes of
  one job see the same device ids, so they get one digest for one mesh.
* Arrays are hashed by dtype + shape + logical bytes (C order): a non-contiguous view equals its
  contiguous copy; ``(2, 2)`` and ``(4,)`` zeros differ; ``int32`` and ``float32`` arrays with the
  same bytes differ. NumPy arrays are mutable, so their digest is recomputed on every call (about
  10 GB/s). A ``jax.Array`` has the same digest as ``np.asarray(x)`` (so ``jnp.asarray(a)`` and
  ``a`` agree), except that a weakly typed ``jax.Array`` additionally records ``weak_type`` because
  it changes type promotion when traced. ``jax.Array`` digests are computed once per object and
  memoised (they are immutable).
* Functions, classes, enum classes, dataclass classes and pytree node types are identified by
  ``module`` + ``qualname``, and only when that name imports back to the very same object. The
  code of a function is NOT fingerprinted: editing an imported helper does not change the digest.
  A lambda, a local function or class, or any other object hashed by identity raises
  :class:`Unpersistable`; it still works as an in-process static argument (the caller falls back
  to a slower, process-local path).
* Standard-library values by what they are, each type with its own tag (``date(2020, 1, 1)``
  never equals a string or tuple of the same text): a ``datetime.date``, ``datetime`` or
  ``time`` by its fields (``fold`` too) and tzinfo (none; a ``datetime.timezone`` by offset and
  name; a ``zoneinfo.ZoneInfo`` by key, the zone's rules being the installed tz database's;
  any other tzinfo computes offsets in its own code: :class:`Unpersistable`), so a naive and an
  aware datetime differ; a ``timedelta`` by days, seconds and microseconds; a
  ``decimal.Decimal`` by ``as_tuple()``, so ``Decimal("1.0")`` and ``Decimal("1.00")`` differ
  (``str`` tells them apart), as do ``-0`` and ``0``, NaN and sNaN; a ``fractions.Fraction`` by
  numerator and denominator; an ``re.Pattern`` by pattern (``str`` and ``bytes`` apart) and
  flags; a ``collections.deque`` by its items in order and ``maxlen``; a ``uuid.UUID`` by its
  128 bits; a ``pathlib`` path by class and ``str``. Only these exact types: a subclass can
  hold more than its base shows (``pandas.Timestamp``'s nanoseconds beside a datetime's
  fields), so it is hashed as any other object.
* An object may define ``__kiln_digest__(self) -> bytes | str`` to supply its own canonical digest.

Byte layout (what is fed to the hasher; changing it requires bumping kiln's entry format
version, see the golden tests in ``tests/test_hashing.py``). ``u64`` is a little-endian unsigned
64-bit length or count, ``i64`` signed; ``str`` below means ``u64 length + UTF-8 bytes``
(``surrogatepass``); ``name`` means ``str module + str qualname``; ``<value>`` is a recursive
encoding; ``digest`` is the 16 raw bytes of a nested ``xxh3_128``::

    None                 b"N"
    bool                 b"T" | b"F"
    int in [-2**63,2**63) b"i" i64
    other int            b"I" u64 n + n bytes two's complement little-endian
    float                b"f" + struct.pack("<d")
    complex              b"c" + struct.pack("<dd")
    str                  b"s" str
    bytes / bytearray    b"b" / b"B"  u64 + bytes
    tuple / list         b"(" / b"["  u64 count + <value>...
    dict                 b"{" u64 count + (<key> <value>)... in iteration order
    other mapping        b"M" name + (b"f" <default_factory> for a defaultdict | b"-")
                             + the dict encoding of its items in iteration order
    frozenset / set      b"Z" / b"z"  u64 count + element digest... sorted
    array                b"A" digest, where the array digest hashes
                             dtype + u64 ndim + i64 per dim + C-order bytes (+ b"w" if weak jax)
    device array         b"V" u64 ndim + i64 per dim + <element>... in C order
    jax.Device           b"v" i64 id + str platform + str device_kind + i64 process_index
    Mesh                 b"m" <axis names tuple> <device array> <axis types tuple>
    AbstractMesh         b"a" <axis sizes tuple> <axis names tuple> <axis types tuple>
                             <abstract device: None, or tuple of (str field, <value>)>
    PartitionSpec        b"p" u64 count + (b"u" for UNCONSTRAINED | <entry>)...
                             <unreduced frozenset> <reduced frozenset>
    NamedSharding        b"n" <mesh> <spec> <memory_kind> <logical device ids or None>
    SingleDeviceSharding b"1" <device> <memory_kind>
    AxisType             b"x" str member name
    numpy scalar         b"g" dtype + u64 + bytes
    numpy dtype          b"d" dtype           (dtype = str dtype.str [+ str(dtype) for kind "V"])
    enum member          b"E" name + str member name + <value>
    type                 b"Y" name
    importable object    b"G" name            (functions, jitted functions, jnp.float32, ...)
    functools.partial    b"P" <func> <args tuple> <keywords dict>
    ShapeDtypeStruct     b"J" <shape tuple> dtype + b"T"/b"F" weak_type
    dataclass instance   b"D" name + u64 count + (str field name + <value>)...
    operator callable    b"O" str qualname + <its __reduce__ tuple>
    builtin subclass     b"X" name + <value as the builtin base type>
    pytree node          b"R" name + <aux data> + u64 count + <child>...
    pytree structure     b"t" + per node: b"*" leaf | b"0" None | b"N" name <aux> u64 count
                             + <child node>...
    __kiln_digest__      b"U" name + u64 + bytes
    datetime.date        b"Sd" i64 year, month, day
    datetime.datetime    b"St" i64 year, month, day, hour, minute, second, microsecond, fold
                             + <tzinfo>
    datetime.time        b"Sh" i64 hour, minute, second, microsecond, fold + <tzinfo>
    tzinfo               None | <timezone> | <ZoneInfo>
    datetime.timedelta   b"SD" i64 days, seconds, microseconds
    datetime.timezone    b"Sz" <utcoffset timedelta> + str tzname
    zoneinfo.ZoneInfo    b"SZ" str key
    decimal.Decimal      b"S$" i64 sign + u64 n + n digits (bytes 0-9) + <exponent: int, or
                             str "n" NaN | "N" sNaN | "F" infinity>
    fractions.Fraction   b"Sq" <numerator int> <denominator int>
    re.Pattern           b"Sr" <pattern str | bytes> + i64 flags
    collections.deque    b"Sk" <maxlen None | int> + u64 count + <item>...
    uuid.UUID            b"Su" + 16 bytes, big-endian
    pathlib path         b"SP" str class name + str path
    keyed by code        b"C" str "type:name" (static_digest_by_code only: a name that does
                             not import back, a callable hashed by identity; its code is keyed
                             by the caller's fingerprint walk)
"""

from __future__ import annotations

import collections.abc
import contextvars
import dataclasses
import datetime
import decimal
import enum
import fractions
import functools
import operator
import pathlib
import re
import struct
import sys
import types
import uuid
import weakref
import zoneinfo
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import numpy as np
import xxhash

from .._base import StaticArgumentError
from ._libraries import is_user_class

__all__ = [
    "Unpersistable",
    "array_digest",
    "digested_by_meaning",
    "static_digest",
    "static_digest_by_code",
]


class Unpersistable(Exception):
    """A static argument is usable in-process but has no canonical cross-process digest.

    Raised by :func:`static_digest` for hashable objects that are compared by identity (a lambda,
    a local function, an instance with the default ``__hash__``). The caller falls back to a
    process-local path keyed by ``hash``/``==``, exactly like ``jax.jit``'s static arguments.
    """


# Path through a nested value, built lazily: None (root) or (parent, kind, key). Formatted only
# when an error is raised, in jax ``keystr`` style: ``[0]``, ``['key']``, ``.attr``.
_Path = tuple[Any, int, Any] | None
_INDEX, _KEY, _ATTR, _JAXKEY = 0, 1, 2, 3

_pack_q = struct.Struct("<Q").pack
_pack_i64 = struct.Struct("<q").pack
_pack_d = struct.Struct("<d").pack
_pack_dd = struct.Struct("<dd").pack
_new_hasher = xxhash.xxh3_128
_Hasher = Any  # xxhash.xxh3_128 instance


def _format_path(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, kind, key = path
        if kind == _INDEX:
            parts.append(f"[{key}]")
        elif kind == _KEY:
            parts.append(f"[{key!r}]")
        elif kind == _ATTR:
            parts.append(f".{key}")
        else:
            parts.append(jax.tree_util.keystr((key,)))
    return "".join(reversed(parts))


def _where(argname: str, path: _Path) -> str:
    text = _format_path(path)
    return f"static argument {argname!r}" + (f" (path: {text})" if text else "")


def _type_name(tp: type) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


def _importable_name(obj: Any) -> tuple[str, str] | None:
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


def _write_str(h: _Hasher, s: str) -> None:
    data = s.encode("utf-8", "surrogatepass")
    h.update(_pack_q(len(data)))
    h.update(data)


def _write_name(h: _Hasher, obj: Any, what: str, argname: str, path: _Path) -> None:
    name = _importable_name(obj)
    if name is None and _by_code.get() and (not isinstance(obj, type) or is_user_class(obj)):
        # (a library class made at run time counts by its name and version in the walk, not
        # by what it holds: it has no digest)
        _write_by_code(h, obj)
        return
    if name is None:
        raise Unpersistable(
            f"{_where(argname, path)}: {what} {_describe(obj)} cannot be imported back by its "
            "module and qualname, so it has no canonical cross-process digest. Define it at the "
            "top level of a module, give the value a __kiln_digest__ method, or mark the "
            "argument as dynamic."
        )
    _write_str(h, name[0])
    _write_str(h, name[1])


def _describe(obj: Any) -> str:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(mod, str) and isinstance(qual, str):
        return f"{mod}.{qual}"
    return f"of type {_type_name(type(obj))}"


# ---------------------------------------------------------------------------------------------
# Arrays


_DTYPE_BYTES: dict[np.dtype[Any], bytes] = {}


def _dtype_bytes(dtype: np.dtype[Any]) -> bytes:
    out = _DTYPE_BYTES.get(dtype)
    if out is None:
        text = dtype.str
        if dtype.kind == "V":
            # "<V2" is shared by bfloat16, float16 variants and raw void; str() tells them apart
            # (and spells out the fields of a structured dtype).
            text += "|" + str(dtype)
        data = text.encode("utf-8")
        out = _pack_q(len(data)) + data
        _DTYPE_BYTES[dtype] = out
    return out


def _object_array_error(argname: str, path: _Path) -> StaticArgumentError:
    return StaticArgumentError(
        f"{_where(argname, path)} is an object array; object arrays cannot be hashed by value. "
        "Pass a numeric array or mark the argument as dynamic."
    )


def _tracer_error(value: Any, argname: str, path: _Path) -> StaticArgumentError:
    aval = getattr(value, "aval", None)
    return StaticArgumentError(
        f"{_where(argname, path)} is a traced value ({aval}); static arguments must be concrete "
        "values known at trace time. Pass a concrete NumPy or Python value, or mark the argument "
        "as dynamic."
    )


def _ndarray_digest(a: np.ndarray[Any, Any], extra: bytes, argname: str, path: _Path) -> bytes:
    dtype = a.dtype
    if dtype.hasobject:
        raise _object_array_error(argname, path)
    h = _new_hasher(_dtype_bytes(dtype))
    shape = a.shape
    head = _SHAPE_BYTES.get(shape)
    if head is None:
        head = _pack_q(len(shape)) + (struct.pack(f"<{len(shape)}q", *shape) if shape else b"")
        if len(_SHAPE_BYTES) < 4096:
            _SHAPE_BYTES[shape] = head
    h.update(head)
    if a.nbytes:
        # The logical content in C order: the buffer itself when C-contiguous (no new array
        # objects: on the per-call path for a static numpy argument, building the view below
        # cost ~10 us of a ~25 us call, benchmarks/per_call.py), a contiguous copy otherwise.
        # (ml_dtypes such as bfloat16 export no buffer: the uint8 view then.)
        if a.flags.c_contiguous and dtype.isbuiltin == 1:
            h.update(a.data)
        else:
            h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    h.update(extra)
    return h.digest()


# shape -> its packed bytes (ndim, then each extent), for the per-call path
_SHAPE_BYTES: dict[tuple[int, ...], bytes] = {}


def _jax_array_digest_uncached(x: Any) -> bytes:
    """Digest of a concrete ``jax.Array``: the digest of ``np.asarray(x)`` (+ weak_type marker)."""
    extra = b"w" if getattr(x, "weak_type", False) else b""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        # Typed PRNG keys: hash the key dtype name and the raw key data.
        data = np.asarray(jax.random.key_data(x))
        marker = str(x.dtype).encode("utf-8")
        return _ndarray_digest(data, b"k" + _pack_q(len(marker)) + marker + extra, "", None)
    return _ndarray_digest(np.asarray(x), extra, "", None)


# id(x) -> (weakref to x, digest). The weakref callback drops the entry when x dies; a lookup
# also checks the weakref still points at x, so a reused id() can never return a stale digest.
_JAX_MEMO: dict[int, tuple[weakref.ref[Any], bytes]] = {}


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _JAX_MEMO.get(key)
    if entry is not None and entry[0] is ref:
        _JAX_MEMO.pop(key, None)


def _jax_array_digest(x: Any, argname: str, path: _Path) -> bytes:
    key = id(x)
    entry = _JAX_MEMO.get(key)
    if entry is not None and entry[0]() is x:
        return entry[1]
    try:
        digest = _jax_array_digest_uncached(x)
    except StaticArgumentError:
        raise _object_array_error(argname, path) from None
    except Exception as e:  # deleted/donated buffers, non-addressable shards, ...
        raise StaticArgumentError(
            f"{_where(argname, path)} is a jax.Array whose value cannot be read on the host "
            f"({type(e).__name__}: {e}). Pass a fully addressable, live array or mark the "
            "argument as dynamic."
        ) from e
    try:
        ref = weakref.ref(x, functools.partial(_forget, key))
    except TypeError:
        return digest  # weakref not supported: no memo
    _JAX_MEMO[key] = (ref, digest)
    return digest


def _array_digest_bytes(x: Any, argname: str, path: _Path) -> bytes:
    if isinstance(x, jax.core.Tracer):
        raise _tracer_error(x, argname, path)
    if isinstance(x, jax.Array):
        return _jax_array_digest(x, argname, path)
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray and not isinstance(x, np.memmap):
            raise StaticArgumentError(
                f"{_where(argname, path)} is an instance of the ndarray subclass "
                f"{_type_name(type(x))}, which cannot be hashed by value. Pass np.asarray(x) or "
                "mark the argument as dynamic."
            )
        return _ndarray_digest(x, b"", argname, path)
    if isinstance(x, np.generic):
        return _ndarray_digest(np.asarray(x), b"", argname, path)
    raise TypeError(f"expected a NumPy array, NumPy scalar or jax.Array, got {type(x).__name__}")


def ndarray_key(a: np.ndarray[Any, Any]) -> bytes:
    """The raw digest of a NumPy array (dtype, shape, logical bytes): the fast path for a static
    array by value on every call (kiln._jit._dispatch), equal exactly when :func:`array_digest` is.

    Raises:
        StaticArgumentError: an object array.
    """
    return _ndarray_digest(a, b"", "<array>", None)


def array_digest(x: Any) -> str:
    """Hex ``xxh3_128`` digest (32 chars) of an array's dtype, shape and logical bytes.

    Args:
        x: A ``np.ndarray``, NumPy scalar (treated as a 0-d array) or concrete ``jax.Array``.

    Returns:
        32 lowercase hex characters. A ``jax.Array`` gets the digest of ``np.asarray(x)``
        (plus a weak-type marker when ``x.weak_type``), computed once per object and memoised;
        NumPy arrays are re-hashed on every call because they are mutable.

    Raises:
        StaticArgumentError: ``x`` is an object array or a tracer.
        TypeError: ``x`` is not an array.

    Example:
        >>> import numpy as np
        >>> array_digest(np.zeros((2, 2))) == array_digest(np.zeros((4,)))
        False
    """
    return _array_digest_bytes(x, "<array>", None).hex()


# ---------------------------------------------------------------------------------------------
# Canonical encoder

_Encoder = Callable[[_Hasher, Any, str, _Path], None]


def _enc_none(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    h.update(b"N")


def _enc_bool(h: _Hasher, v: bool, argname: str, path: _Path) -> None:
    h.update(b"T" if v else b"F")


def _enc_int(h: _Hasher, v: int, argname: str, path: _Path) -> None:
    if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        h.update(b"i" + _pack_i64(v))
    else:
        data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        h.update(b"I" + _pack_q(len(data)))
        h.update(data)


def _enc_float(h: _Hasher, v: float, argname: str, path: _Path) -> None:
    h.update(b"f" + _pack_d(v))


def _enc_complex(h: _Hasher, v: complex, argname: str, path: _Path) -> None:
    h.update(b"c" + _pack_dd(v.real, v.imag))


def _enc_str(h: _Hasher, v: str, argname: str, path: _Path) -> None:
    data = v.encode("utf-8", "surrogatepass")
    h.update(b"s" + _pack_q(len(data)))
    h.update(data)


def _enc_bytes(h: _Hasher, v: bytes, argname: str, path: _Path) -> None:
    h.update(b"b" + _pack_q(len(v)))
    h.update(v)


def _enc_bytearray(h: _Hasher, v: bytearray, argname: str, path: _Path) -> None:
    h.update(b"B" + _pack_q(len(v)))
    h.update(v)


def _enc_seq(tag: bytes) -> _Encoder:
    def enc(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
        h.update(tag + _pack_q(len(v)))
        for i, item in enumerate(v):
            _encode(h, item, argname, (path, _INDEX, i))

    return enc


def _sub_digest(v: Any, argname: str, path: _Path) -> bytes:
    h = _new_hasher()
    _encode(h, v, argname, path)
    return h.digest()


def _enc_items(
    h: _Hasher, items: collections.abc.Collection[tuple[Any, Any]], argname: str, path: _Path
) -> None:
    """The items of a mapping IN ITERATION ORDER: the order is part of the value, since a trace
    that iterates the mapping (``[x * v for v in cfg.values()]``) builds another program."""
    h.update(b"{" + _pack_q(len(items)))
    for k, val in items:
        item_path = (path, _KEY, k)
        _encode(h, k, argname, item_path)
        _encode(h, val, argname, item_path)


def _enc_dict(h: _Hasher, v: dict[Any, Any], argname: str, path: _Path) -> None:
    _enc_items(h, v.items(), argname, path)


def _enc_mapping(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    """A mapping other than a plain dict: its class by name (a ``defaultdict`` also by its
    ``default_factory``), then its items in iteration order, as a dict."""
    tp = type(v)
    h.update(b"M")
    _write_name(h, tp, "mapping class", argname, path)
    if isinstance(v, collections.defaultdict):
        h.update(b"f")
        _encode(h, v.default_factory, argname, (path, _ATTR, "default_factory"))
    else:
        h.update(b"-")
    _enc_items(h, list(v.items()), argname, path)  # (a list: len and iteration agree)


def _enc_set(tag: bytes) -> _Encoder:
    # Sorted by element digest: a set has no order of its own that survives processes (a set of
    # strings iterates in an order that changes with PYTHONHASHSEED), so equal sets must get one
    # digest whatever order this process happens to iterate them in.
    def enc(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
        digests = sorted(_sub_digest(item, argname, path) for item in v)
        h.update(tag + _pack_q(len(digests)))
        for d in digests:
            h.update(d)

    return enc


# ---------------------------------------------------------------------------------------------
# Standard-library values, by what they are (their exact types only, in _EXACT: a subclass can
# hold more than its base shows, as pandas.Timestamp's nanoseconds beside a datetime's fields)

_pack_3q = struct.Struct("<3q").pack
_pack_5q = struct.Struct("<5q").pack
_pack_8q = struct.Struct("<8q").pack


def _enc_date(h: _Hasher, v: datetime.date, argname: str, path: _Path) -> None:
    h.update(b"Sd" + _pack_3q(v.year, v.month, v.day))


def _enc_datetime(h: _Hasher, v: datetime.datetime, argname: str, path: _Path) -> None:
    # fold too: it picks the offset of an ambiguous local time, though == ignores it
    fields = (v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold)
    h.update(b"St" + _pack_8q(*fields))
    _enc_tzinfo(h, v.tzinfo, argname, (path, _ATTR, "tzinfo"))


def _enc_time(h: _Hasher, v: datetime.time, argname: str, path: _Path) -> None:
    h.update(b"Sh" + _pack_5q(v.hour, v.minute, v.second, v.microsecond, v.fold))
    _enc_tzinfo(h, v.tzinfo, argname, (path, _ATTR, "tzinfo"))


def _enc_tzinfo(h: _Hasher, tz: datetime.tzinfo | None, argname: str, path: _Path) -> None:
    """None, a fixed offset or an IANA zone by key; any other tzinfo computes offsets in its own
    code, which has no canonical digest."""
    if tz is None:
        h.update(b"N")
    elif type(tz) is datetime.timezone or type(tz) is zoneinfo.ZoneInfo:
        _EXACT[type(tz)](h, tz, argname, path)
    else:
        raise Unpersistable(
            f"{_where(argname, path)} is a tzinfo of type {_type_name(type(tz))}, which "
            "computes offsets in its own code and has no canonical cross-process digest. Use "
            "datetime.timezone or zoneinfo.ZoneInfo, or mark the argument as dynamic."
        )


def _enc_timedelta(h: _Hasher, v: datetime.timedelta, argname: str, path: _Path) -> None:
    h.update(b"SD" + _pack_3q(v.days, v.seconds, v.microseconds))


def _enc_timezone(h: _Hasher, v: datetime.timezone, argname: str, path: _Path) -> None:
    # the name too (``strftime("%Z")`` shows it), though == compares offsets only
    h.update(b"Sz")
    _enc_timedelta(h, v.utcoffset(None), argname, path)
    _write_str(h, v.tzname(None))


def _enc_zoneinfo(h: _Hasher, v: zoneinfo.ZoneInfo, argname: str, path: _Path) -> None:
    if v.key is None:  # ZoneInfo.from_file: rules from a file object, no name to key them by
        raise Unpersistable(
            f"{_where(argname, path)} is a zoneinfo.ZoneInfo read from a file (its key is "
            "None), which has no canonical cross-process digest. Use ZoneInfo(key), or mark "
            "the argument as dynamic."
        )
    h.update(b"SZ")
    _write_str(h, v.key)


def _enc_decimal(h: _Hasher, v: decimal.Decimal, argname: str, path: _Path) -> None:
    # as_tuple, not ==: Decimal("1.0") == Decimal("1.00") but their str differ, as -0 and 0 do
    sign, digits, exponent = v.as_tuple()
    h.update(b"S$" + _pack_i64(sign) + _pack_q(len(digits)))
    h.update(bytes(digits))
    _encode(h, exponent, argname, path)  # an int, or "n" (NaN), "N" (sNaN), "F" (infinity)


def _enc_fraction(h: _Hasher, v: fractions.Fraction, argname: str, path: _Path) -> None:
    h.update(b"Sq")
    _enc_int(h, v.numerator, argname, path)
    _enc_int(h, v.denominator, argname, path)


def _enc_pattern(h: _Hasher, v: re.Pattern[Any], argname: str, path: _Path) -> None:
    h.update(b"Sr")
    _encode(h, v.pattern, argname, (path, _ATTR, "pattern"))  # (str and bytes tagged apart)
    h.update(_pack_i64(v.flags))


def _enc_deque(h: _Hasher, v: collections.deque[Any], argname: str, path: _Path) -> None:
    h.update(b"Sk")
    _encode(h, v.maxlen, argname, (path, _ATTR, "maxlen"))
    h.update(_pack_q(len(v)))
    for i, item in enumerate(v):
        _encode(h, item, argname, (path, _INDEX, i))


def _enc_uuid(h: _Hasher, v: uuid.UUID, argname: str, path: _Path) -> None:
    h.update(b"Su" + v.bytes)


def _enc_path(h: _Hasher, v: pathlib.PurePath, argname: str, path: _Path) -> None:
    # the class by its name alone (its module moved in 3.13): it says how the text is parsed
    h.update(b"SP")
    _write_str(h, type(v).__name__)
    _write_str(h, str(v))


# pathlib's own classes (a user's subclass may hold more than its text)
_PATH_TYPES: tuple[type, ...] = (
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.WindowsPath,
)

_STDLIB_ENCODERS: dict[type, _Encoder] = {
    datetime.date: _enc_date,
    datetime.datetime: _enc_datetime,
    datetime.time: _enc_time,
    datetime.timedelta: _enc_timedelta,
    datetime.timezone: _enc_timezone,
    zoneinfo.ZoneInfo: _enc_zoneinfo,
    decimal.Decimal: _enc_decimal,
    fractions.Fraction: _enc_fraction,
    re.Pattern: _enc_pattern,
    collections.deque: _enc_deque,
    uuid.UUID: _enc_uuid,
    **dict.fromkeys(_PATH_TYPES, _enc_path),
}


# ---------------------------------------------------------------------------------------------
# Devices and shardings, by what they mean (never by identity, nor through a Mesh's private
# caches such as ``_flat_devices_set``, which the generic fallbacks would reach)

_Device: type = jax.Device
_Mesh: type = jax.sharding.Mesh
_AbstractMesh: type = jax.sharding.AbstractMesh
_NamedSharding: type = jax.sharding.NamedSharding
_PartitionSpec: type = jax.sharding.PartitionSpec
_SingleDeviceSharding: type = jax.sharding.SingleDeviceSharding
_AxisType: type = jax.sharding.AxisType
_UNCONSTRAINED = jax.sharding.PartitionSpec.UNCONSTRAINED


def _enc_device(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    # ids and process indices are global in a multi-process job: every process agrees on them
    h.update(b"v" + _pack_i64(v.id))
    _write_str(h, v.platform)
    _write_str(h, v.device_kind)
    h.update(_pack_i64(v.process_index))


def _enc_device_array(h: _Hasher, a: np.ndarray[Any, Any], argname: str, path: _Path) -> None:
    shape = a.shape
    h.update(b"V" + _pack_q(len(shape)))
    if shape:
        h.update(struct.pack(f"<{len(shape)}q", *shape))
    for i, item in enumerate(a.flat):
        _encode(h, item, argname, (path, _INDEX, i))


def _is_device_array(v: Any) -> TypeGuard[np.ndarray[Any, Any]]:
    return (
        type(v) is np.ndarray
        and v.dtype.kind == "O"
        and v.size > 0
        and all(isinstance(d, _Device) for d in v.flat)
    )


def _enc_mesh(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    h.update(b"m")
    _encode(h, tuple(v.axis_names), argname, (path, _ATTR, "axis_names"))
    _enc_device_array(h, np.asarray(v.devices), argname, (path, _ATTR, "devices"))
    _encode(h, tuple(v.axis_types), argname, (path, _ATTR, "axis_types"))


def _enc_abstract_mesh(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    h.update(b"a")
    _encode(h, tuple(v.axis_sizes), argname, (path, _ATTR, "axis_sizes"))
    _encode(h, tuple(v.axis_names), argname, (path, _ATTR, "axis_names"))
    _encode(h, tuple(v.axis_types), argname, (path, _ATTR, "axis_types"))
    device = v.abstract_device
    if device is not None:
        names = (
            [f.name for f in dataclasses.fields(device)]
            if dataclasses.is_dataclass(device)
            else ["device_kind", "num_cores", "platform"]
        )
        device = tuple((n, getattr(device, n)) for n in names)
    _encode(h, device, argname, (path, _ATTR, "abstract_device"))


def _enc_partition_spec(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    parts = tuple(v.partitions) if hasattr(v, "partitions") else tuple(v)
    h.update(b"p" + _pack_q(len(parts)))
    for i, part in enumerate(parts):
        if part is _UNCONSTRAINED:
            h.update(b"u")
        else:
            _encode(h, part, argname, (path, _INDEX, i))
    _encode(h, frozenset(getattr(v, "unreduced", ())), argname, (path, _ATTR, "unreduced"))
    _encode(h, frozenset(getattr(v, "reduced", ())), argname, (path, _ATTR, "reduced"))


def _enc_named_sharding(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    h.update(b"n")
    _encode(h, v.mesh, argname, (path, _ATTR, "mesh"))
    _encode(h, v.spec, argname, (path, _ATTR, "spec"))
    _encode(h, v.memory_kind, argname, (path, _ATTR, "memory_kind"))
    # a constructor argument of NamedSharding (jax 0.10: part of its __eq__ and __hash__); read
    # as an attribute, as jax itself does, with no import of jax._src
    ids = getattr(v, "_logical_device_ids", None)
    _encode(h, None if ids is None else tuple(ids), argname, (path, _ATTR, "_logical_device_ids"))


def _enc_single_device_sharding(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    (device,) = v.device_set
    h.update(b"1")
    _encode(h, device, argname, (path, _ATTR, "device"))
    _encode(h, v.memory_kind, argname, (path, _ATTR, "memory_kind"))


def _enc_axis_type(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    h.update(b"x")
    _write_str(h, v.name)


# checked by exact type first (_EXACT), then by isinstance before any generic fallback
_SHARDING_ENCODERS: tuple[tuple[type, _Encoder], ...] = (
    (_Device, _enc_device),
    (_Mesh, _enc_mesh),
    (_AbstractMesh, _enc_abstract_mesh),
    (_NamedSharding, _enc_named_sharding),
    (_PartitionSpec, _enc_partition_spec),
    (_SingleDeviceSharding, _enc_single_device_sharding),
    (_AxisType, _enc_axis_type),
)
_SHARDING_TYPES = tuple(t for t, _ in _SHARDING_ENCODERS)


_EXACT: dict[type, _Encoder] = {
    type(None): _enc_none,
    bool: _enc_bool,
    int: _enc_int,
    float: _enc_float,
    complex: _enc_complex,
    str: _enc_str,
    bytes: _enc_bytes,
    bytearray: _enc_bytearray,
    tuple: _enc_seq(b"("),
    list: _enc_seq(b"["),
    dict: _enc_dict,
    frozenset: _enc_set(b"Z"),
    set: _enc_set(b"z"),
    **dict(_SHARDING_ENCODERS),
    **_STDLIB_ENCODERS,
}

# Builtin bases, most specific first, for subclasses (IntEnum and friends are caught earlier).
_BUILTIN_BASES: tuple[type, ...] = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    tuple,
    list,
    frozenset,
    set,
)  # (dict subclasses are mappings: _enc_mapping)


def digested_by_meaning(v: Any) -> bool:
    """Whether :func:`static_digest` digests ``v`` by what it means through an encoder of its
    own (a ``Mesh``, ``NamedSharding``, ``Device``, a stdlib value): its private caches (a used
    mesh's ``_name_to_type``) never count, so it is never keyed field by field."""
    return type(v) in _EXACT or isinstance(v, _SHARDING_TYPES)


def _encode(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    enc = _EXACT.get(type(v))
    if enc is not None:
        enc(h, v, argname, path)
    else:
        _encode_other(h, v, argname, path)


def _encode_other(h: _Hasher, v: Any, argname: str, path: _Path) -> None:
    tp = type(v)
    if isinstance(v, _SHARDING_TYPES):
        next(enc for t, enc in _SHARDING_ENCODERS if isinstance(v, t))(h, v, argname, path)
        return
    if isinstance(v, (jax.Array, np.ndarray)):
        if _is_device_array(v):  # devices (as a mesh's): device by device
            _enc_device_array(h, v, argname, path)
            return
        h.update(b"A")
        h.update(_array_digest_bytes(v, argname, path))
        return
    if isinstance(v, np.generic):
        if v.dtype.hasobject:
            raise _object_array_error(argname, path)
        data = v.tobytes()
        h.update(b"g" + _dtype_bytes(v.dtype) + _pack_q(len(data)))
        h.update(data)
        return
    if isinstance(v, np.dtype):
        h.update(b"d" + _dtype_bytes(v))
        return
    hook = getattr(tp, "__kiln_digest__", None)
    if hook is not None:
        out = hook(v)
        if isinstance(out, str):
            out = out.encode("utf-8", "surrogatepass")
        if not isinstance(out, bytes):
            raise StaticArgumentError(
                f"{_where(argname, path)}: {_type_name(tp)}.__kiln_digest__ returned "
                f"{type(out).__name__}; it must return bytes or str."
            )
        h.update(b"U")
        _write_str(h, tp.__module__)
        _write_str(h, tp.__qualname__)
        h.update(_pack_q(len(out)))
        h.update(out)
        return
    if isinstance(v, enum.Enum):
        h.update(b"E")
        _write_name(h, tp, "enum class", argname, path)
        _write_str(h, v.name)
        _encode(h, v.value, argname, (path, _ATTR, "value"))
        return
    if isinstance(v, type):
        h.update(b"Y")
        _write_name(h, v, "class", argname, path)
        return
    if isinstance(v, operator.methodcaller | operator.attrgetter | operator.itemgetter):
        # jax.tree_util.register_pytree_node_class registers methodcaller("tree_flatten"): by
        # what it calls, from its __reduce__ (the names and arguments)
        h.update(b"O")
        _write_str(h, tp.__qualname__)
        _encode(h, v.__reduce__(), argname, (path, _ATTR, "<reduce>"))
        return
    if isinstance(v, functools.partial):
        h.update(b"P")
        _encode(h, v.func, argname, (path, _ATTR, "func"))
        _encode(h, v.args, argname, (path, _ATTR, "args"))
        _encode(h, v.keywords, argname, (path, _ATTR, "keywords"))
        return
    if isinstance(v, jax.ShapeDtypeStruct):
        if getattr(v, "sharding", None) is not None:
            raise Unpersistable(
                f"{_where(argname, path)} is a jax.ShapeDtypeStruct with a sharding; shardings "
                "have no canonical digest. Drop the sharding or mark the argument as dynamic."
            )
        h.update(b"J")
        _encode(h, tuple(v.shape), argname, (path, _ATTR, "shape"))
        h.update(_dtype_bytes(np.dtype(v.dtype)) + (b"T" if v.weak_type else b"F"))
        return
    if dataclasses.is_dataclass(v):
        fields = dataclasses.fields(v)
        h.update(b"D")
        _write_name(h, tp, "dataclass", argname, path)
        h.update(_pack_q(len(fields)))
        for f in fields:
            _write_str(h, f.name)
            _encode(h, getattr(v, f.name), argname, (path, _ATTR, f.name))
        return
    if isinstance(v, collections.abc.Mapping) and (isinstance(v, dict) or tp.__hash__ is not None):
        # before the pytree branch: FrozenDict's flatten sorts its keys, losing their order
        _enc_mapping(h, v, argname, path)
        return
    if _encode_pytree(h, v, argname, path):
        return
    if isinstance(v, _BUILTIN_BASES):
        base = next(b for b in _BUILTIN_BASES if isinstance(v, b))
        h.update(b"X")
        _write_name(h, tp, "class", argname, path)
        _EXACT[base](h, base(v), argname, path)
        return
    if isinstance(v, jax.tree_util.PyTreeDef):
        h.update(b"t")  # a pytree structure (in an nnx GraphDef): node types, aux, shape
        _encode_treedef(h, v, argname, path)
        return
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)) or (
        tp.__hash__ is not None and _importable_name(v) is not None
    ):
        h.update(b"G")
        _write_name(h, v, "function", argname, path)
        return
    if tp.__hash__ is not None and callable(v) and _by_code.get():
        _write_by_code(h, v)
        return
    if tp.__hash__ is not None:
        raise Unpersistable(
            f"{_where(argname, path)} of type {_type_name(tp)} is hashed by identity and has no "
            "canonical cross-process digest. Define __kiln_digest__(self) -> bytes on the class, "
            "use a dataclass or an importable top-level object, or mark the argument as dynamic."
        )
    raise StaticArgumentError(
        f"{_where(argname, path)} of type {_type_name(tp)} is not hashable and cannot be hashed "
        "by value. Make it hashable (for example a frozen dataclass), define "
        "__kiln_digest__(self) -> bytes, or mark the argument as dynamic."
    )


def _encode_treedef(h: _Hasher, t: Any, argname: str, path: _Path) -> None:
    data = t.node_data()
    if data is None:
        h.update(b"*")
        return
    node_type, aux = data
    if node_type is type(None):
        h.update(b"0")
        return
    h.update(b"N")
    _write_name(h, node_type, "pytree node type", argname, path)
    _encode(h, aux, argname, (path, _ATTR, "<aux>"))
    kids = t.children()
    h.update(_pack_q(len(kids)))
    for k in kids:
        _encode_treedef(h, k, argname, path)


def _encode_pytree(h: _Hasher, v: Any, argname: str, path: _Path) -> bool:
    """Encode ``v`` as a registered pytree node one level deep; False if it is a leaf."""
    children, treedef_ = jax.tree_util.tree_flatten_with_path(v, is_leaf=lambda n: n is not v)
    treedef: Any = treedef_
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return False  # v itself is a leaf: not a registered node
    node_type, aux = treedef.node_data()
    h.update(b"R")
    _write_name(h, node_type, "pytree node type", argname, path)
    _encode(h, aux, argname, (path, _ATTR, "<aux>"))
    h.update(_pack_q(len(children)))
    for keypath, child in children:
        child_path = path
        for k in keypath:
            child_path = (child_path, _JAXKEY, k)
        _encode(h, child, argname, child_path)
    return True


# static_digest_by_code is running (in this context): what has no name that imports back is
# written by its description, the caller keys it by code
_by_code: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_by_code", default=False)


def _write_by_code(h: _Hasher, obj: Any) -> None:
    h.update(b"C")
    _write_str(h, f"{_type_name(type(obj))}:{_describe(obj)}")


def static_digest_by_code(value: Any, *, argname: str) -> str | None:
    """:func:`static_digest` of ``value`` with what has no canonical digest only because it is
    code (a lambda, a local function, a class of a user file, a callable object hashed by
    identity) written as ``b"C" str`` (its type and name): the caller must key those by their
    code (the fingerprint walk of ``value``). None when something else in ``value`` has no
    digest (a library class that does not import back by its name among them).

    For a static value that holds functions deep inside: equinox's ``filter_jit`` under the
    jax.jit swap passes ``(static leaves, treedef)`` pairs holding the user's function, an
    ``eqx.nn.MLP``'s ``lambda x: x`` and a Module class defined in a function."""
    token = _by_code.set(True)
    try:
        return static_digest(value, argname=argname)
    except Exception:  # noqa: BLE001 - no digest (or a __kiln_digest__ failing): the verify path
        return None
    finally:
        _by_code.reset(token)


def static_digest(value: Any, *, argname: str) -> str:
    """Hex ``xxh3_128`` digest (32 chars) of a static argument, stable across processes.

    See the module docstring for what is hashed by value and what "equal" means.

    Args:
        value: The static argument value (any nesting of supported types).
        argname: The argument's name, used in error messages.

    Returns:
        32 lowercase hex characters.

    Raises:
        StaticArgumentError: ``value`` (or something inside it, named by its path) cannot be a
            static argument: an object array, a tracer, an unhashable object without a canonical
            encoding, or a structure nested too deeply.
        Unpersistable: ``value`` is usable as an in-process static argument but is hashed by
            identity (a lambda, a local class, an object with the default ``__hash__``).

    Example:
        >>> static_digest(1, argname="n") == static_digest(1.0, argname="n")
        False
        >>> a = static_digest({"a": 1, "b": 2}, argname="d")
        >>> a == static_digest({"b": 2, "a": 1}, argname="d")  # iteration order is value
        False
        >>> a == static_digest({"a": 1, "b": 2}, argname="d")
        True
    """
    h = _new_hasher()
    try:
        _encode(h, value, argname, None)
    except RecursionError:
        raise StaticArgumentError(
            f"static argument {argname!r} is nested too deeply or contains itself; it cannot be "
            "hashed by value. Flatten it or mark the argument as dynamic."
        ) from None
    return h.hexdigest()
