"""Pickling values with cloudpickle: output trees against a call's inputs, host callbacks bound to
live objects and live module globals, plain values.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

import cloudpickle

from ._errors import LiveObjectMissing, Unserializable
from ._pickling import _ATOMS, _load_singleton, _named_global, _singleton_id

__all__ = [
    "pickle_tree",
    "unpickle_tree",
    "pickle_callbacks",
    "unpickle_callbacks",
]


class _ValuePickler(cloudpickle.Pickler):
    """cloudpickle, except that whatever its module and qualified name import back to (in this
    process) is pickled by reference, ``__main__`` included: a class or function of the running
    script must come back as the very object of the process that loads it (``isinstance`` of a
    NamedTuple, an equinox Module's fields, a function leaf's identity), not a copy."""

    def persistent_id(self, obj: Any) -> Any:
        return _singleton_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and _named_global(obj) is not None:
            return NotImplemented  # pickle's own save_global: by module and name
        return super().reducer_override(obj)


class _ValueUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "global":
            return _load_singleton(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


class _TreePickler(_ValuePickler):
    """An output's tree structure: what the inputs hold (``input_objects``) by position, so a
    warm result holds the caller's own objects as a cold one does; anything else by value
    (cloudpickle: an optimizer's local functions a step made itself come back as copies)."""

    def __init__(self, file: io.BytesIO, inputs: Sequence[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._inputs: dict[int, int] = {}
        for i, obj in enumerate(inputs):
            self._inputs.setdefault(id(obj), i)

    def persistent_id(self, obj: Any) -> Any:
        i = self._inputs.get(id(obj))
        if i is not None and not isinstance(obj, _ATOMS):
            return ("input", i)
        return super().persistent_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, type) and "<locals>" in getattr(obj, "__qualname__", "")
                and _named_global(obj) is None):
            # a copy of a class is not the class: an equinox Module rebuilt from a cloudpickled
            # class loses its fields (seen on examples/eqx_transformer.py)
            raise pickle.PicklingError(
                f"the class {obj.__qualname__} is defined inside a function and is not one "
                "the inputs hold")
        return super().reducer_override(obj)


class _TreeUnpickler(_ValueUnpickler):
    def __init__(self, file: io.BytesIO, inputs: Sequence[Any]) -> None:
        super().__init__(file)
        self._inputs = inputs

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "input":
            if not 0 <= pid[1] < len(self._inputs):
                raise pickle.UnpicklingError(f"input object {pid[1]} is not in this call")
            return self._inputs[pid[1]]
        return super().persistent_load(pid)


def pickle_tree(value: Any, inputs: Sequence[Any]) -> bytes:
    """Pickle an output's structure (a tree, static outputs) with what the call's ``inputs``
    hold by position (``input_objects``), anything else with cloudpickle (``_ValuePickler``),
    except classes defined inside a function.

    Raises:
        Unserializable: it cannot be pickled.
    """
    buf = io.BytesIO()
    try:
        _TreePickler(buf, inputs).dump(value)
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"the output's tree structure cannot be pickled: "
                             f"{type(e).__name__}: {e}",
                             advice="return arrays and objects the inputs hold (a TrainState's "
                             "apply_fn and tx come back as the caller's own) or objects "
                             "cloudpickle can carry") from None
    return buf.getvalue()


def unpickle_tree(data: bytes, inputs: Sequence[Any]) -> Any:
    """The value :func:`pickle_tree` pickled, its input references taken from ``inputs``."""
    return _TreeUnpickler(io.BytesIO(data), inputs).load()


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class _CallbackPickler(_ValuePickler):
    """Host callbacks, with every object of the user's live world they reach by reference:
    ``("live", i, type)`` for the ``i``-th object of the function's walk, named functions and
    classes by module and name (``_ValuePickler``). ``copied`` names the first user object
    (``is_user``) that would be pickled by value instead: a copy of it could differ from the
    live one (a closure's list, a simulator's state), so the callbacks are not stored."""

    def __init__(self, file: io.BytesIO, live: Sequence[Any],
                 is_user: Callable[[Any], bool] | None, codes: Collection[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._live: dict[int, int] = {}
        for i, obj in enumerate(live):
            self._live.setdefault(id(obj), i)
        self._is_user = is_user
        self._codes = codes
        self.copied: str | None = None

    def persistent_id(self, obj: Any) -> Any:
        i = self._live.get(id(obj))
        if i is not None and not isinstance(obj, _ATOMS):
            return ("live", i, _type_name(obj))
        pid = super().persistent_id(obj)
        if (pid is None and self.copied is None and self._is_user is not None
                and not isinstance(obj, _ATOMS) and _named_global(obj) is None
                and self._is_user(obj) and not self._made_while_tracing(obj)):
            self.copied = (f"{getattr(obj, '__qualname__', None) or type(obj).__qualname__} "
                           f"({_type_name(obj)})")
        return pid

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, types.FunctionType) and _named_global(obj) is None
                and self._made_while_tracing(obj) and _module_of_globals(obj) is not None):
            # bound to its module's live globals when loaded, as the cold run's function is
            return (_live_function, (obj.__code__, _module_of_globals(obj), obj.__name__,
                                     obj.__qualname__, obj.__defaults__, obj.__kwdefaults__,
                                     obj.__closure__))
        return super().reducer_override(obj)

    def _made_while_tracing(self, obj: Any) -> bool:
        """A function the trace made (``lambda v: log.append(v)`` in the function's body): its
        code is the walked code's own and every variable it closes over is a live cell, so a
        copy acts on the same objects."""
        if not (isinstance(obj, types.FunctionType) and obj.__code__ in self._codes
                and all(id(c) in self._live for c in obj.__closure__ or ())):
            return False
        if _module_of_globals(obj) is not None:
            return True  # its globals: its module's, live (:func:`_live_function`)
        # the globals it reads travel as a copy of their bindings: only names that a program
        # does not rebind (modules, classes, functions) may be among them
        g = obj.__globals__
        return all(isinstance(g[n], types.ModuleType | type | types.FunctionType
                              | types.BuiltinFunctionType)
                   for n in _code_names(obj.__code__) if n in g)


def _module_of_globals(fn: types.FunctionType) -> str | None:
    """The name of the imported module whose namespace is ``fn.__globals__``, or None."""
    name = fn.__globals__.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and vars(mod) is fn.__globals__ else None


def _live_function(code: types.CodeType, module: str, name: str, qualname: str,
                   defaults: Any, kwdefaults: Any, closure: Any) -> types.FunctionType:
    """A function a cold trace made (a callback's ``lambda v: print(RUN_ID, v)``), bound to the
    live globals of its module in this process: it reads ``RUN_ID`` when it runs, as the cold
    run's function does (issue 42).

    Raises:
        LiveObjectMissing: the module is not imported here.
    """
    mod = sys.modules.get(module)
    if mod is None:
        raise LiveObjectMissing(f"module {module} (of a host callback) is not imported")
    fn = types.FunctionType(code, vars(mod), name, defaults, closure)
    fn.__qualname__, fn.__kwdefaults__ = qualname, kwdefaults
    return fn


class _CallbackUnpickler(_ValueUnpickler):
    def __init__(self, file: io.BytesIO, live: Sequence[Any]) -> None:
        super().__init__(file)
        self._liveobjs = live

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "live":
            i, name = pid[1], pid[2]
            if not 0 <= i < len(self._liveobjs) or _type_name(self._liveobjs[i]) != name:
                raise LiveObjectMissing(f"live object {i} ({name}) is not in this walk")
            return self._liveobjs[i]
        return super().persistent_load(pid)


def pickle_callbacks(callbacks: Sequence[Any], live: Sequence[Any] = (),
                     is_user: Callable[[Any], bool] | None = None,
                     codes: Collection[Any] = ()) -> bytes:
    """Pickle a program's host callbacks so that a warm start calls the user's live objects,
    exactly as a cold run does (a ``jax.debug.callback`` appending to a list made in
    ``main()``, an ``io_callback(sim.advance, ...)`` stepping the user's simulator).

    ``live``: the objects the function's static walk visited, in walk order
    (``Fingerprint.objects``); a warm process whose key matched walked the same sequence, so
    each object the callbacks reach that is among them is stored as its position and comes
    back as that process's own object. Functions and classes importable by module and name
    come back by reference; JAX's own wrappers by value (made fresh by each lowering), and a
    user function the trace made by value when its code is among the walked ``codes`` and all
    it closes over is live.

    Raises:
        Unserializable: the callbacks cannot be pickled, or would hold a copy of a user object
            (``is_user``) that is not among ``live``: a copy could differ from what the cold
            run acts on, so a warm start rebuilds them by tracing instead.
    """
    buf = io.BytesIO()
    pickler = _CallbackPickler(buf, live, is_user, codes)
    try:
        pickler.dump(list(callbacks))
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"cannot pickle the host callbacks: {e}") from None
    if pickler.copied is not None:
        raise Unserializable(f"a host callback holds {pickler.copied}, which the function's "
                             "walk does not reach: a stored copy could differ from the live one")
    return buf.getvalue()


def unpickle_callbacks(data: bytes, live: Sequence[Any] = ()) -> list[Any]:
    """The callbacks :func:`pickle_callbacks` stored, bound to this process's ``live``
    objects. Only for entries whose digest verified.

    Raises:
        LiveObjectMissing: a referenced live object is not in ``live`` (the caller rebuilds
            the callbacks by tracing).
    """
    return list(_CallbackUnpickler(io.BytesIO(data), live).load())
