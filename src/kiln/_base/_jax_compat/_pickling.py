"""Pickling what an executable's entry holds by reference: JAX's singletons and named globals, the
objects a call's inputs hold (:func:`input_objects`).

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import sys
import types
from collections.abc import Sequence
from typing import Any

import jax

from ._private import _xc

__all__ = ['input_objects']


_singletons: dict[type, dict[int, str]] = {}
_NOT_SINGLETON_MODULES = frozenset({"builtins", "numpy", "jaxlib._jax", "jax._src.tree_util"})


def _singleton_id(obj: Any) -> tuple[str, str, str] | None:
    """("global", module, name) for a module-level instance such as equinox's ``MISSING``.

    Sentinels compared by identity (``x is MISSING``) must unpickle as the very same object,
    not a copy; pytree aux data holds them (equinox ``_Missing``).
    """
    t = type(obj)
    if not isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
        named = _named_global(obj)  # jax.nn.relu: a custom_jvp named in its own module
        if named is not None:
            return ("global", *named)
    module = getattr(t, "__module__", None)
    if module is None or module in _NOT_SINGLETON_MODULES or isinstance(obj, type):
        return None
    table = _singletons.get(t)
    if table is None:
        mod = sys.modules.get(module)
        items = list(vars(mod).items()) if mod is not None else []
        table = _singletons[t] = {id(v): name for name, v in items if type(v) is t}
    found = table.get(id(obj))
    if found is None or getattr(sys.modules.get(module), found, None) is not obj:
        return None
    return ("global", module, found)


def _load_singleton(pid: Any) -> Any:
    _, module, name = pid
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _named_global(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` when importing that name gives back ``obj`` itself."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None) if target is not None else None
    return (module, qualname) if target is obj else None


# builtin values, most of what an executable's metadata holds: none is referenced by id (each
# check of persistent_id below gives None for them, unless one is the callback list itself)
_PLAIN = frozenset({int, float, complex, str, bytes, bool, type(None), tuple, list, dict,
                    frozenset})


class _Pickler(pickle.Pickler):
    """Pickles an UnloadedMeshExecutable with the XLA executable, devices and client as ids."""

    def __init__(self, file: io.BytesIO, callbacks: list[Any],
                 devices: tuple[int, ...] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._callbacks = callbacks
        self._callback_ids = frozenset(id(cb) for cb in callbacks)
        self._devices = devices
        self.executable: bytes | None = None

    def persistent_id(self, obj: Any) -> Any:
        if (type(obj) in _PLAIN and obj is not self._callbacks
                and id(obj) not in self._callback_ids):
            return None  # (pickle asks for every object: ~230 per eager program)
        if isinstance(obj, _xc.LoadedExecutable):
            self.executable = obj.client.serialize_executable(obj)
            # the program's global device assignment (UnloadedMeshExecutable.device_list), as
            # JAX's cache deserializes with it: in a multi-process job each process then loads
            # the executable onto its own local devices (its local_devices() are only the
            # compiling process's)
            ids = self._devices or tuple(d.id for d in obj.local_devices())
            return ("exec", ids)
        if isinstance(obj, _xc.Device):
            return ("device", obj.id)
        if isinstance(obj, _xc.Client):
            return ("client",)
        if isinstance(obj, _xc.DeviceList):
            return ("devices", tuple(d.id for d in obj))
        if obj is self._callbacks:
            return ("callbacks",)
        for i, cb in enumerate(self._callbacks):
            if obj is cb:  # a callback also held elsewhere (emit_python_callback's keepalive)
                return ("callback", i)
        return _singleton_id(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, executable: bytes, callbacks: list[Any]) -> None:
        super().__init__(file)
        self._backend = jax.devices()[0].client
        self._by_id = {d.id: d for d in self._backend.devices()}
        self._executable = executable
        self._callbacks = callbacks

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "exec":
            # the devices the executable was compiled for (one for a single-device program)
            ids = pid[1] if len(pid) > 1 else tuple(self._by_id)
            devices = _xc.DeviceList(tuple(self._by_id[i] for i in ids))
            return self._backend.deserialize_executable(
                self._executable, devices, None, host_callbacks=self._callbacks
            )
        if kind == "device":
            return self._by_id[pid[1]]
        if kind == "client":
            return self._backend
        if kind == "devices":
            return _xc.DeviceList(tuple(self._by_id[i] for i in pid[1]))
        if kind == "callbacks":
            return self._callbacks
        if kind == "callback":
            return self._callbacks[pid[1]]
        if kind == "global":
            return _load_singleton(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


_ATOMS = (str, bytes, int, float, bool, complex, type(None))
_PyTreeDef = type(jax.tree_util.tree_structure(0))


def input_objects(treedef: Any, statics: Sequence[tuple[Any, Any]] = ()) -> list[Any]:
    """The objects a call's inputs hold outside their arrays, in a fixed order: each node's
    class and auxiliary data in ``treedef`` (a flax ``TrainState``'s ``apply_fn`` and ``tx``, a
    dict's keys) and the static arguments' values, with the items of tuples, lists and dicts among
    them. Two calls under one key give equal lists (the key holds them by value).

    Tree structures among the static values (equinox's ``filter_jit`` under the jax.jit swap
    passes ``(static leaves, treedef)`` pairs: the class of a Module defined in a function is in
    that treedef) are walked as ``treedef`` is, after everything else, so that the positions
    of what comes before stay those of entries written before they were walked. Then, last for
    the same reason, the compared fields of the dataclass instances found (flax NNX's
    ``GraphDef`` holds an optimizer's ``tx`` in a ``Static`` of a ``NodeDef``'s attributes:
    by value, a warm step returned a copy of it, so the next call's tree differed and missed)."""
    out: list[Any] = []
    static_trees: list[Any] = []
    records: list[tuple[Any, int]] = []

    def add(obj: Any, depth: int) -> None:
        if isinstance(obj, _ATOMS) or depth > 8:
            return
        out.append(obj)
        if isinstance(obj, _PyTreeDef):
            static_trees.append(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            records.append((obj, depth))
        elif isinstance(obj, tuple | list):
            for item in obj:
                add(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                add(item, depth + 1)

    def walk(td: Any) -> None:
        data = td.node_data()
        if data is not None:
            add(data[0], 0)  # the node's class (an equinox Module defined in a function)
            add(data[1], 0)
        for child in td.children():
            walk(child)

    walk(treedef)
    for _, value in statics:
        add(value, 0)
    for tree in static_trees:
        walk(tree)
    # (fields that take part in ==: under one key, equal trees give equal lists)
    for record, depth in records:  # (grows while it is walked: nested records come after)
        for field in dataclasses.fields(record):
            if field.compare:
                add(getattr(record, field.name, None), depth + 1)
    return out
