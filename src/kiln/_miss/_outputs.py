"""kiln.filter_jit's outputs that are not arrays (an equinox Module's functions, ints,
strings): split off at trace time, as ``equinox.filter_jit`` does, returned outside the
executable, and put back in their places around each of its runs."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import jax

from .._base import _jax_compat

__all__ = ["Box", "abstract_sig", "is_static_output", "with_static_outputs",
           "wrap_static_outputs"]


class Box(dict[Any, Any]):
    """Non-array outputs of a flat jax.jit (kiln.filter_jit), per traced signature
    (:func:`abstract_sig` of its array leaves): ``(out_tree, {leaf index: value})``."""


def abstract_sig(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """(shape, dtype, weak_type) per traced leaf: which trace a function's non-array outputs
    came from (one flat jax.jit serves every signature of a static configuration)."""
    avals = map(jax.typeof, leaves)  # a Python scalar as jax traces it (weakly typed)
    return tuple((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", a)),
                  bool(getattr(a, "weak_type", False))) for a in avals)


def is_static_output(x: Any, depth: int = 4) -> bool:
    """Whether a non-array output leaf can be returned outside the executable (as
    ``equinox.filter_jit`` does): not an iterator or generator, and holding no tracer (a
    traced value inside a Python object would leak out of the trace)."""
    if _jax_compat.is_tracer(x):
        return False
    if isinstance(x, types.GeneratorType | types.CoroutineType | types.AsyncGeneratorType) or (
        hasattr(x, "__next__") and hasattr(x, "__iter__")
    ):
        return False
    if depth == 0:
        return True
    if isinstance(x, list | tuple | set | frozenset):
        return all(is_static_output(v, depth - 1) for v in x)
    if isinstance(x, dict):
        return all(is_static_output(v, depth - 1) for v in x.values())
    state = getattr(x, "__dict__", None)
    if isinstance(state, dict) and not isinstance(x, type | types.ModuleType | types.FunctionType):
        return all(is_static_output(v, depth - 1) for v in state.values())
    return True


def with_static_outputs(outs: Any, out_tree: Any, static_out: dict[int, Any]) -> Any:
    """The full output: the array leaves ``outs`` of an executable, with the non-array leaves
    that were split off at trace time put back in their places."""
    it = iter(outs)
    return out_tree.unflatten([static_out[i] if i in static_out else next(it)
                               for i in range(out_tree.num_leaves)])


def wrap_static_outputs(compiled: Any, out_tree: Any, static_out: dict[int, Any]) -> Any:
    """Wrap an executable whose non-JAX outputs were split off at trace time."""

    def call(*leaves: Any) -> Any:
        return with_static_outputs(compiled(*leaves), out_tree, static_out)

    return call
