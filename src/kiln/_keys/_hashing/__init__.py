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

The encoders live in the modules of their kinds (:mod:`._encode`: Python's and the standard
library's values, with the machinery; :mod:`._jax`: NumPy's and jax's); the tables below say
which kind takes a value: its exact type, else the first test it passes, in order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ..._base import StaticArgumentError
from . import _encode as e
from . import _jax as j
from ._encode import EXACT, FALLBACKS, Unpersistable, by_code, encode, new_hasher
from ._jax import array_digest, ndarray_key

__all__ = ["Unpersistable", "array_digest", "digested_by_meaning", "ndarray_key", "static_digest",
           "static_digest_by_code"]


EXACT.update({**e.EXACT_ENCODERS, **dict(j.SHARDING_ENCODERS), **e.STDLIB_ENCODERS})
FALLBACKS += [
    (j.SHARDING_TYPES, j.enc_sharding),
    ((jax.Array, np.ndarray), j.enc_array),
    ((np.generic,), j.enc_numpy_scalar),
    ((np.dtype,), j.enc_dtype),
    (lambda v: getattr(type(v), "__kiln_digest__", None) is not None, e.enc_digest_hook),
    ((enum.Enum,), e.enc_enum),
    ((type,), e.enc_class),
    (e.OPERATOR_TYPES, e.enc_operator),
    ((functools.partial,), e.enc_partial),
    ((jax.ShapeDtypeStruct,), j.enc_shape_dtype_struct),
    (dataclasses.is_dataclass, e.enc_dataclass),
    # a mapping that is a dict or hashable, before a pytree node (FrozenDict's flatten sorts)
    (lambda v: isinstance(v, Mapping) and (isinstance(v, dict) or type(v).__hash__ is not None),
     e.enc_mapping),
    (j.is_pytree_node, j.enc_pytree),
    (e.BUILTIN_BASES, e.enc_builtin_subclass),
    ((jax.tree_util.PyTreeDef,), j.enc_treedef),
    (lambda v: isinstance(v, types.FunctionType | types.BuiltinFunctionType | types.MethodType)
     or (type(v).__hash__ is not None and e.importable_name(v) is not None), e.enc_importable),
    # (static_digest_by_code only) a callable hashed by identity: the caller walks its code
    (lambda v: type(v).__hash__ is not None and callable(v) and by_code.get(),
     lambda h, v, argname, path: e.write_by_code(h, v)),
]


def digested_by_meaning(v: Any) -> bool:
    """Whether :func:`static_digest` digests ``v`` by what it means through an encoder of its
    own (a ``Mesh``, ``NamedSharding``, ``Device``, a stdlib value): its private caches (a used
    mesh's ``_name_to_type``) never count, so it is never keyed field by field."""
    return type(v) in EXACT or isinstance(v, j.SHARDING_TYPES)


def static_digest_by_code(value: Any, *, argname: str) -> str | None:
    """:func:`static_digest` of ``value`` with what has no canonical digest only because it is
    code (a lambda, a local function, a class of a user file, a callable object hashed by
    identity) written as ``b"C" str`` (its type and name): the caller must key those by their
    code (the fingerprint walk of ``value``). None when something else in ``value`` has no
    digest (a library class that does not import back by its name among them).

    For a static value that holds functions deep inside: equinox's ``filter_jit`` under the
    jax.jit swap passes ``(static leaves, treedef)`` pairs holding the user's function, an
    ``eqx.nn.MLP``'s ``lambda x: x`` and a Module class defined in a function."""
    token = by_code.set(True)
    try:
        return static_digest(value, argname=argname)
    except Exception:  # noqa: BLE001 - no digest (or a __kiln_digest__ failing): the verify path
        return None
    finally:
        by_code.reset(token)


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
    h = new_hasher()
    try:
        encode(h, value, argname, None)
    except RecursionError:
        raise StaticArgumentError(
            f"static argument {argname!r} is nested too deeply or contains itself; it cannot be "
            "hashed by value. Flatten it or mark the argument as dynamic."
        ) from None
    return h.hexdigest()
