"""Encoders of NumPy's and jax's values: arrays, scalars and dtypes; devices, meshes and
shardings by what they mean (never through a Mesh's private caches such as
``_flat_devices_set``, which the generic kinds would reach); ``ShapeDtypeStruct``; pytrees."""

from __future__ import annotations

import dataclasses
import functools
import struct
import weakref
from typing import Any, TypeGuard

import jax
import numpy as np

from ..._base import StaticArgumentError
from ._encode import (
    ATTR,
    INDEX,
    JAXKEY,
    Encoder,
    Hasher,
    Path,
    Unpersistable,
    encode,
    new_hasher,
    pack_i64,
    pack_q,
    type_name,
    where,
    write_name,
    write_str,
)

_DTYPE_BYTES: dict[np.dtype[Any], bytes] = {}


def dtype_bytes(dtype: np.dtype[Any]) -> bytes:
    out = _DTYPE_BYTES.get(dtype)
    if out is None:
        text = dtype.str
        if dtype.kind == "V":
            # "<V2" is shared by bfloat16, float16 variants and raw void; str() tells them apart
            # (and spells out the fields of a structured dtype).
            text += "|" + str(dtype)
        data = text.encode("utf-8")
        out = _DTYPE_BYTES[dtype] = pack_q(len(data)) + data
    return out


def _object_array_error(argname: str, path: Path) -> StaticArgumentError:
    return StaticArgumentError(
        f"{where(argname, path)} is an object array; object arrays cannot be hashed by value. "
        "Pass a numeric array or mark the argument as dynamic."
    )


def _ndarray_digest(a: np.ndarray[Any, Any], extra: bytes, argname: str, path: Path) -> bytes:
    dtype = a.dtype
    if dtype.hasobject:
        raise _object_array_error(argname, path)
    h = new_hasher(dtype_bytes(dtype))
    shape = a.shape
    head = _SHAPE_BYTES.get(shape)
    if head is None:
        head = pack_q(len(shape)) + (struct.pack(f"<{len(shape)}q", *shape) if shape else b"")
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
        return _ndarray_digest(data, b"k" + pack_q(len(marker)) + marker + extra, "", None)
    return _ndarray_digest(np.asarray(x), extra, "", None)


# id(x) -> (weakref to x, digest). The weakref callback drops the entry when x dies; a lookup
# also checks the weakref still points at x, so a reused id() can never return a stale digest.
_JAX_MEMO: dict[int, tuple[weakref.ref[Any], bytes]] = {}


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _JAX_MEMO.get(key)
    if entry is not None and entry[0] is ref:
        _JAX_MEMO.pop(key, None)


def _jax_array_digest(x: Any, argname: str, path: Path) -> bytes:
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
            f"{where(argname, path)} is a jax.Array whose value cannot be read on the host "
            f"({type(e).__name__}: {e}). Pass a fully addressable, live array or mark the "
            "argument as dynamic."
        ) from e
    try:
        ref = weakref.ref(x, functools.partial(_forget, key))
    except TypeError:
        return digest  # weakref not supported: no memo
    _JAX_MEMO[key] = (ref, digest)
    return digest


def _array_digest_bytes(x: Any, argname: str, path: Path) -> bytes:
    if isinstance(x, jax.core.Tracer):
        raise StaticArgumentError(
            f"{where(argname, path)} is a traced value ({getattr(x, 'aval', None)}); static "
            "arguments must be concrete values known at trace time. Pass a concrete NumPy or "
            "Python value, or mark the argument as dynamic."
        )
    if isinstance(x, jax.Array):
        return _jax_array_digest(x, argname, path)
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray and not isinstance(x, np.memmap):
            raise StaticArgumentError(
                f"{where(argname, path)} is an instance of the ndarray subclass "
                f"{type_name(type(x))}, which cannot be hashed by value. Pass np.asarray(x) or "
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


def enc_array(h: Hasher, v: Any, argname: str, path: Path) -> None:
    if _is_device_array(v):  # devices (as a mesh's): device by device
        enc_device_array(h, v, argname, path)
        return
    h.update(b"A")
    h.update(_array_digest_bytes(v, argname, path))


def enc_numpy_scalar(h: Hasher, v: np.generic, argname: str, path: Path) -> None:
    if v.dtype.hasobject:
        raise _object_array_error(argname, path)
    data = v.tobytes()
    h.update(b"g" + dtype_bytes(v.dtype) + pack_q(len(data)))
    h.update(data)


def enc_dtype(h: Hasher, v: np.dtype[Any], argname: str, path: Path) -> None:
    h.update(b"d" + dtype_bytes(v))


def enc_device_array(h: Hasher, a: np.ndarray[Any, Any], argname: str, path: Path) -> None:
    shape = a.shape
    h.update(b"V" + pack_q(len(shape)))
    if shape:
        h.update(struct.pack(f"<{len(shape)}q", *shape))
    for i, item in enumerate(a.flat):
        encode(h, item, argname, (path, INDEX, i))


def _is_device_array(v: Any) -> TypeGuard[np.ndarray[Any, Any]]:
    return (
        type(v) is np.ndarray
        and v.dtype.kind == "O"
        and v.size > 0
        and all(isinstance(d, jax.Device) for d in v.flat)
    )


# -- devices, meshes, shardings -----------------------------------------------------------------


def _enc_device(h: Hasher, v: Any, argname: str, path: Path) -> None:
    # ids and process indices are global in a multi-process job: every process agrees on them
    h.update(b"v" + pack_i64(v.id))
    write_str(h, v.platform)
    write_str(h, v.device_kind)
    h.update(pack_i64(v.process_index))


def _enc_mesh(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"m")
    encode(h, tuple(v.axis_names), argname, (path, ATTR, "axis_names"))
    enc_device_array(h, np.asarray(v.devices), argname, (path, ATTR, "devices"))
    encode(h, tuple(v.axis_types), argname, (path, ATTR, "axis_types"))


def _enc_abstract_mesh(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"a")
    encode(h, tuple(v.axis_sizes), argname, (path, ATTR, "axis_sizes"))
    encode(h, tuple(v.axis_names), argname, (path, ATTR, "axis_names"))
    encode(h, tuple(v.axis_types), argname, (path, ATTR, "axis_types"))
    device = v.abstract_device
    if device is not None:
        names = (
            [f.name for f in dataclasses.fields(device)]
            if dataclasses.is_dataclass(device)
            else ["device_kind", "num_cores", "platform"]
        )
        device = tuple((n, getattr(device, n)) for n in names)
    encode(h, device, argname, (path, ATTR, "abstract_device"))


def _enc_partition_spec(h: Hasher, v: Any, argname: str, path: Path) -> None:
    parts = tuple(v.partitions) if hasattr(v, "partitions") else tuple(v)
    h.update(b"p" + pack_q(len(parts)))
    for i, part in enumerate(parts):
        if part is jax.sharding.PartitionSpec.UNCONSTRAINED:
            h.update(b"u")
        else:
            encode(h, part, argname, (path, INDEX, i))
    encode(h, frozenset(getattr(v, "unreduced", ())), argname, (path, ATTR, "unreduced"))
    encode(h, frozenset(getattr(v, "reduced", ())), argname, (path, ATTR, "reduced"))


def _enc_named_sharding(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"n")
    encode(h, v.mesh, argname, (path, ATTR, "mesh"))
    encode(h, v.spec, argname, (path, ATTR, "spec"))
    encode(h, v.memory_kind, argname, (path, ATTR, "memory_kind"))
    # a constructor argument of NamedSharding (jax 0.10: part of its __eq__ and __hash__); read
    # as an attribute, as jax itself does, with no import of jax._src
    ids = getattr(v, "_logical_device_ids", None)
    encode(h, None if ids is None else tuple(ids), argname, (path, ATTR, "_logical_device_ids"))


def _enc_single_device_sharding(h: Hasher, v: Any, argname: str, path: Path) -> None:
    (device,) = v.device_set
    h.update(b"1")
    encode(h, device, argname, (path, ATTR, "device"))
    encode(h, v.memory_kind, argname, (path, ATTR, "memory_kind"))


def _enc_axis_type(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"x")
    write_str(h, v.name)


# found by exact type first, then by isinstance before any other kind (the face's tables)
SHARDING_ENCODERS: tuple[tuple[type, Encoder], ...] = (
    (jax.Device, _enc_device),
    (jax.sharding.Mesh, _enc_mesh),
    (jax.sharding.AbstractMesh, _enc_abstract_mesh),
    (jax.sharding.NamedSharding, _enc_named_sharding),
    (jax.sharding.PartitionSpec, _enc_partition_spec),
    (jax.sharding.SingleDeviceSharding, _enc_single_device_sharding),
    (jax.sharding.AxisType, _enc_axis_type),
)
SHARDING_TYPES = tuple(t for t, _ in SHARDING_ENCODERS)


def enc_sharding(h: Hasher, v: Any, argname: str, path: Path) -> None:
    """An instance of a subclass of a device, mesh or sharding type: as its base."""
    next(enc for t, enc in SHARDING_ENCODERS if isinstance(v, t))(h, v, argname, path)


def enc_shape_dtype_struct(h: Hasher, v: Any, argname: str, path: Path) -> None:
    if getattr(v, "sharding", None) is not None:
        raise Unpersistable(
            f"{where(argname, path)} is a jax.ShapeDtypeStruct with a sharding; shardings "
            "have no canonical digest. Drop the sharding or mark the argument as dynamic."
        )
    h.update(b"J")
    encode(h, tuple(v.shape), argname, (path, ATTR, "shape"))
    h.update(dtype_bytes(np.dtype(v.dtype)) + (b"T" if v.weak_type else b"F"))


def is_pytree_node(v: Any) -> bool:
    """``v`` is a registered pytree node (not a leaf)."""
    treedef: Any = jax.tree_util.tree_flatten_with_path(v, is_leaf=lambda n: n is not v)[1]
    return not (treedef.num_nodes == 1 and treedef.num_leaves == 1)


def enc_pytree(h: Hasher, v: Any, argname: str, path: Path) -> None:
    """A registered pytree node, one level deep: its type, aux data and children."""
    children, treedef = jax.tree_util.tree_flatten_with_path(v, is_leaf=lambda n: n is not v)
    node_type, aux = treedef.node_data()  # type: ignore[attr-defined]
    h.update(b"R")
    write_name(h, node_type, "pytree node type", argname, path)
    encode(h, aux, argname, (path, ATTR, "<aux>"))
    h.update(pack_q(len(children)))
    for keypath, child in children:
        child_path = path
        for k in keypath:
            child_path = (child_path, JAXKEY, k)
        encode(h, child, argname, child_path)


def enc_treedef(h: Hasher, v: Any, argname: str, path: Path) -> None:
    h.update(b"t")  # a pytree structure (in an nnx GraphDef): node types, aux, shape
    _enc_treedef_node(h, v, argname, path)


def _enc_treedef_node(h: Hasher, t: Any, argname: str, path: Path) -> None:
    data = t.node_data()
    if data is None:
        h.update(b"*")
        return
    node_type, aux = data
    if node_type is type(None):
        h.update(b"0")
        return
    h.update(b"N")
    write_name(h, node_type, "pytree node type", argname, path)
    encode(h, aux, argname, (path, ATTR, "<aux>"))
    kids = t.children()
    h.update(pack_q(len(kids)))
    for k in kids:
        _enc_treedef_node(h, k, argname, path)
