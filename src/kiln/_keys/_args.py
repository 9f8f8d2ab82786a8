"""Argument handling shared by kiln.jit, kiln.filter_jit and kiln.noinline: static / donated
argument numbers and names (checked and normalised as ``jax.jit`` does), the positions of the
dynamic arguments, and readable leaf paths for messages and keys."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .._base import _jax_compat

__all__ = ["leaf_sig", "filter_leaf_sig", "STATIC_LEAF", "ARRAY_TYPES", "multi_device",
           "check_argnames", "normalize_argnums", "normalize_argnames", "dyn_positions",
           "leaf_paths", "param_name"]


def param_name(positional: list[str], where: Any) -> Any:
    """The key name of a static argument: its parameter name when the signature gives one
    (so ``f(x, t)`` and ``f(x, table=t)`` share an executable), else ``args[i]``; static
    leaves keep their ``("leaf", i)`` position."""
    if isinstance(where, int):
        if 0 <= where < len(positional):
            return positional[where]
        return f"args[{where}]"
    return where


def check_argnames(
    fun: Callable[..., Any], params: list[inspect.Parameter], names: list[tuple[str, str]],
    prefix: str = "",
) -> None:
    """Refuse an ``(option, name)`` naming no parameter of ``fun`` (unless it takes
    ``**kwargs``, or its signature is unknown: ``params`` empty).

    Raises:
        ValueError: naming the option, the function, its parameters and the closest one.
    """
    known = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params or any(p.kind == p.VAR_KEYWORD for p in params):
        return
    for option, n in names:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{prefix}{option}: {getattr(fun, '__name__', fun)!r} has no parameter {n!r}; "
                f"its parameters are {known}.{hint}"
            )


def normalize_argnums(argnums: int | Iterable[int] | None, name: str) -> tuple[int, ...]:
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        return (argnums,)
    try:
        out = tuple(argnums)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {argnums!r}") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {argnums!r}")
    return out


def normalize_argnames(argnames: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    if argnames is None:
        return ()
    if isinstance(argnames, str):
        return (argnames,)
    out = tuple(argnames)
    if not all(isinstance(s, str) for s in out):
        raise TypeError(f"{name} must be a str or a sequence of str, got {argnames!r}")
    return out


def dyn_positions(statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> list[int]:
    """Original positions of the dynamic positional arguments (static positions removed)."""
    pos = [w for w, _ in statics if isinstance(w, int)]
    total = n_dyn + len(pos)
    taken = {w if w >= 0 else total + w for w in pos}
    return [i for i in range(total) if i not in taken]


def leaf_paths(
    positional: list[str], dyn_args: Any, dyn_kwargs: Any, statics: tuple[tuple[Any, Any], ...]
) -> list[str]:
    """Readable path of every leaf of (dyn_args, dyn_kwargs): ``x``, ``model.layers[0].weight``,
    ``kwargs['y']``, using parameter names where the signature gives them."""
    positions = dyn_positions(statics, len(dyn_args))
    out = []
    flat = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=lambda x: False)
    for path, _ in flat[0]:
        head, rest = path[0].idx, path[1:]  # type: ignore[attr-defined]
        if head == 0:
            j = rest[0].idx  # type: ignore[attr-defined]
            name = param_name(positional, positions[j]) if j < len(positions) else f"args[{j}]"
        else:
            name = str(getattr(rest[0], "key", rest[0]))
        out.append(name + jax.tree_util.keystr(tuple(rest[1:])))
    return out


# -- leaf signatures: what one leaf of a call contributes to its key ------------------------
STATIC_LEAF = "<static leaf>"
_SCALARS = (int, float, bool, complex)
_ARRAY_IMPL = _jax_compat.ArrayImpl
# multi_device(), once asked (None: not yet)
_multi_device: bool | None = None


def multi_device() -> bool:
    """Whether this process sees several devices: then a leaf's sharding picks the executable
    too, and a key names the default device. Found on first use, not at import (importing
    kiln must not start the XLA backend)."""
    global _multi_device
    if _multi_device is None:
        _multi_device = jax.device_count() > 1
    return _multi_device


def _array_sig(x: Any) -> Any:
    """A jax Array's aval; with several devices, ``(aval, sharding)``: a committed array's
    sharding picks the executable. An uncommitted array (made without a device: ``jnp.ones``,
    ``jax.random``) lives on the process's default device and constrains nothing, as in
    ``jax.jit``: its sharding is None, so the processes of a multi-process job, each with its
    own default device, share one key."""
    if _multi_device is False:  # (the hot path: one global read)
        return x.aval
    if _multi_device is None and not multi_device():
        return x.aval
    return (x.aval, x.sharding if x.committed else None)


_scalar_sigs: dict[tuple[type, bool], Any] = {}


def _scalar_sig(t: type) -> Any:
    """A Python scalar's signature: the weak-typed aval ``jax.jit`` gives it (``int`` ->
    ``int32[]`` weak, ``int64[]`` under x64), so ``f(0)`` and ``f(<a weak int32[] f
    returned>)`` are one program, as in ``jax.jit`` (a flax ``TrainState``'s ``step``). Its value
    is checked when it runs (an int too large for int32 raises jax's OverflowError)."""
    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
    sig = _scalar_sigs.get((t, x64))
    if sig is None:
        aval = jax.typeof(t(0))
        sig = _scalar_sigs[(t, x64)] = (aval, None) if multi_device() else aval
    return sig


def leaf_sig(x: Any) -> Any:
    """In-process signature of one leaf: its aval (shape, dtype, weak_type, sharding; a Python
    scalar's weak-typed aval), None for a tracer, STATIC_LEAF for a non-JAX value."""
    t = type(x)
    if t is _ARRAY_IMPL:
        return _array_sig(x)
    if t in _SCALARS:
        return _scalar_sig(t)
    if _jax_compat.is_tracer(x):
        return None
    try:
        aval = jax.typeof(x)
    except TypeError:
        return STATIC_LEAF  # not a JAX type (a function, a string, ...): static by value
    if not hasattr(aval, "weak_type"):
        return None  # a token (jax.lax.create_token): run as a plain nested jax.jit
    return aval


def filter_leaf_sig(x: Any) -> Any:
    """``kiln.filter_jit``'s signature of one leaf (equinox's contract): JAX and numpy arrays
    are traced (their aval), a tracer gives None, everything else (Python scalars too) is
    STATIC_LEAF."""
    t = type(x)
    if t is _ARRAY_IMPL:
        return _array_sig(x)
    if _jax_compat.is_tracer(x):
        return None
    if isinstance(x, _SIG_TYPES):  # (precompile takes structs)
        return jax.typeof(x)
    return STATIC_LEAF


ARRAY_TYPES = (np.ndarray, np.generic, jax.Array)  # equinox.is_array: what filter_jit traces
_SIG_TYPES = (*ARRAY_TYPES, jax.ShapeDtypeStruct)  # (precompile takes structs)
