"""The C++ dispatcher of a kiln function (jax.jit's, from ``_jax_compat.make_dispatcher``):
after the first call with a signature, later calls with it run the executable with no Python
frame in between. Static arguments with no hash of their own (arrays by value, lists) get one
first (:class:`StaticValue`: kiln's digest, hashed and compared in C)."""

from __future__ import annotations

import collections.abc
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base import StaticArgumentError, _jax_compat
from .._keys import Unpersistable, ndarray_key, static_digest
from ._options import JitOptions

__all__ = ["StaticValue", "install", "unwrapped"]


class StaticValue(bytes):
    """A static argument with no hash of its own (a numpy or jax array, a list), as its kiln
    digest, so that jax's C++ dispatcher can key a call on it: the bytes are the digest (hashed
    and compared in C, with no Python call), ``value`` the argument itself."""

    value: Any

    def __new__(cls, value: Any, digest: bytes) -> StaticValue:
        self = super().__new__(cls, digest)
        self.value = value
        return self


_static_values: dict[bytes, StaticValue] = {}
_SMALL = 1 << 16  # bytes: arrays up to this size reuse their StaticValue


def _static_value(v: np.ndarray[Any, Any], digest: bytes) -> StaticValue:
    """The :class:`StaticValue` of a numpy array: for a small array, one object per digest, so
    jax's dispatcher finds its key by identity (measured: 8.2 us a call against 12.6 us with a
    new object); its ``value`` is always the array of this call (the miss path reads it)."""
    if v.nbytes > _SMALL:
        return StaticValue(v, digest)
    got = _static_values.get(digest)
    if got is None:
        if len(_static_values) >= 4096:
            _static_values.clear()
        got = _static_values[digest] = StaticValue(v, digest)
    got.value = v
    return got


# static values jax's dispatcher hashes itself, with no need to ask
_HASHABLE = frozenset({int, float, bool, str, bytes, complex, type(None), type,
                       types.FunctionType, types.BuiltinFunctionType})


def _static_caller(
    dispatch: Any, python_call: Callable[..., Any], nums: list[int], names: frozenset[str],
    fname: str, by_value: bool,
) -> Callable[..., Any]:
    """``__call__`` of a function with static arguments: the C++ dispatcher, after giving each
    static value that has no hash (an array by value) a :class:`StaticValue`; anything kiln
    cannot digest goes to the Python path, which raises the error that names it. With
    ``by_value`` False (the jax.jit swap), a value with no hash goes to the Python path too,
    which gives it to jax.jit (whose error refuses it)."""

    def give_hash(v: Any, name: str) -> Any:
        t = type(v)
        if t in _HASHABLE:
            return v
        if not by_value:
            hash(v)  # (TypeError: the Python path)
            return v
        if t is np.ndarray:  # re-hashed on each call (mutable): the raw digest, no dispatch
            return _static_value(v, ndarray_key(v))
        if isinstance(v, collections.abc.Mapping):
            # a mapping is keyed in iteration order, but a hashable one's == ignores the order
            # (flax's FrozenDict, HashableMapping): by its digest, never by hash / ==
            return StaticValue(v, static_digest(v, argname=name).encode())
        try:
            hash(v)
            return v
        except TypeError:
            return StaticValue(v, static_digest(v, argname=name).encode())

    name_list = sorted(names)
    to_python = (Unpersistable, StaticArgumentError) + (() if by_value else (TypeError,))

    def call(*args: Any, **kwargs: Any) -> Any:
        # in the common case every static value is of a type jax hashes itself: nothing to do
        try:
            n = len(args)
            for i in nums:
                if i < n and type(args[i]) not in _HASHABLE:
                    args = tuple(give_hash(a, str(j)) if j in nums else a
                                 for j, a in enumerate(args))
                    break
            if kwargs:  # (a fresh dict on every call: changed in place)
                for k in name_list:
                    if k in kwargs and type(kwargs[k]) not in _HASHABLE:
                        kwargs[k] = give_hash(kwargs[k], k)
        except to_python:
            return python_call(unwrapped(args), unwrapped(kwargs))[0]
        return dispatch(*args, **kwargs)

    call.__name__ = call.__qualname__ = fname
    # (not an API boundary itself: its one frame shows in the traceback of an error raised
    # below, whose frames the dispatcher's miss removes; a boundary here would cost every call)
    return call


def unwrapped(args: Any) -> Any:
    """``args`` (a tuple or a kwargs dict) with each :class:`StaticValue` replaced by its
    value."""
    if isinstance(args, dict):
        return {k: v.value if type(v) is StaticValue else v for k, v in args.items()}
    return tuple(a.value if type(a) is StaticValue else a for a in args)


def _weakly(jf: Any, method: str) -> Callable[..., Any]:
    """``getattr(jf, method)`` called through a weak reference to ``jf``. The dispatcher lives
    on ``jf`` (its ``_python_call`` for misses, its ``_fun`` for jax's NaN-check re-run): a bound
    method would make a cycle that keeps ``jf`` and what its function closes over alive until
    the garbage collector runs (``jax.jit`` frees them at ``del``)."""
    ref = weakref.ref(jf)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:  # pragma: no cover - the dispatcher outlived its function
            raise RuntimeError("this kiln.jit function was garbage collected")
        return getattr(target, method)(*args, **kwargs)

    return call


def install(jf: Any, cls: type, name: str, options: JitOptions) -> Any:
    """Make the C++ dispatcher of ``jf`` (a ``JitFunction``, ``cls``) and give ``jf`` a class
    of its own, derived from ``cls``, whose ``__call__`` it is; the dispatcher, or None where
    calls stay in Python (negative static_argnums need the call's length).

    The dispatcher keys static arguments as jax.jit's are (hashed and compared by jax), those
    with no hash of their own (arrays by value) by kiln's digest through :class:`StaticValue`,
    unless ``jf._statics_by_value`` is False (the jax.jit swap: jax.jit refuses them).
    """
    if not all(i >= 0 for i in options.static_argnums):
        return None
    dispatch = _jax_compat.make_dispatcher(
        name, _weakly(jf, "_python_call"), _weakly(jf, "_fun"),
        static_argnums=sorted(options.static_argnums),
        static_argnames=sorted(options.static_argnames))
    # Python looks __call__ up on the type: in a class of its own whose __call__ is the
    # C++ dispatcher, a cached signature runs with no Python frame in between. With a
    # Python __call__ forwarding to it, benchmarks/per_call.py measured 1.12x jax.jit
    # on `x * y + 1` (now 1.02x; docs/benchmarks.md). With static arguments a Python
    # __call__ first gives the unhashable ones a hash (_static_caller).
    call = (dispatch if not options.has_statics else _static_caller(
        dispatch, _weakly(jf, "_python_call"), sorted(options.static_argnums),
        options.static_argnames, name, jf._statics_by_value))
    jf.__class__ = type(
        cls.__name__, (cls,),
        {"__call__": staticmethod(call), "__slots__": (),
         "__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )
    return dispatch
