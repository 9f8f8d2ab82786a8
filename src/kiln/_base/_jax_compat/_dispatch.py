"""Calls: the C++ dispatcher of a stored executable, jax.clear_caches hooks, pytree node functions,
JAX's errors and debug info at a call, the name of a function.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._private import (
    _api_util,
    _core,
    _dtypes,
    _jaxlib_ext,
    _pxla,
    _sharding_impls,
    _tree_util,
    _xc,
)
from ._trace import api_boundary

logger = logging.getLogger("kiln")

__all__ = [
    "make_dispatcher",
    "on_clear_caches",
    "traced_extra_inputs",
    "pytree_node_functions",
    "InternalFloatingPointError",
    "raise_floating_point_error",
    "give_debug_info",
    "broadcast_prefix",
    "pytree_differences",
    "fun_name",
]


def make_dispatcher(
    name: str,
    cache_miss: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any]],
    fun: Callable[..., Any],
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
) -> Callable[..., Any]:
    """A C++ dispatcher like ``jax.jit``'s: after the first call with a signature, later calls
    with that signature (and the same jax trace context) run the executable without Python.

    ``cache_miss(args, kwargs) -> (outputs, compiled_or_None)`` runs on every signature the C++
    cache has not seen (and under transformations, ``disable_jit``, non-array arguments); when it
    returns a ``jax.stages.Compiled`` whose calling convention is the flat leaves of
    ``(args, kwargs)``, that executable is cached in C++ for the signature. Mirrors
    ``MeshExecutable.create_cpp_call`` (jax 0.10.2). ``fun``: the user's function, which
    jax's NaN check (``jax_debug_nans``, ``api._nan_check_posthook``) re-runs op by op as
    ``dispatcher._fun`` to name the operation that produced a NaN. ``static_argnums`` /
    ``static_argnames``: left out of the flat leaves, and hashed and compared (with their
    types) into the cache key, as jax.jit's.
    """

    # (jax's own cache_miss is an API boundary too)
    @api_boundary
    def miss(*args: Any, **kwargs: Any) -> Any:
        outs, compiled = cache_miss(args, kwargs)
        return outs, (None if compiled is None else _fastpath_data(compiled, outs)), False

    @api_boundary
    def fallback(*args: Any, **kwargs: Any) -> Any:  # under jax.disable_jit()
        return cache_miss(args, kwargs)[0]

    dispatcher = _jaxlib_ext.pjit(
        name, fallback, miss, list(static_argnums), list(static_argnames),
        _pxla.JitGlobalCppCacheKeys(),
        jax.tree_util.dispatch_registry if hasattr(jax.tree_util, "dispatch_registry")
        else _tree_util.dispatch_registry,
        _pxla.cc_shard_arg,
    )
    dispatcher._fun = fun
    return dispatcher  # type: ignore[no-any-return]


def _fastpath_data(compiled: jax.stages.Compiled, outs: Any) -> Any:
    executable: Any = compiled._executable
    call = getattr(executable, "unsafe_call", None)
    if not (
        isinstance(call, _pxla.ExecuteReplicated)
        and not call.has_unordered_effects
        and not call.has_host_callbacks
        and not compiled._params.const_args
        and not getattr(executable, "_mut", None)
    ):
        return None
    out_flat, out_tree = jax.tree_util.tree_flatten(outs)
    same_tree: bool = out_tree == compiled.out_tree  # type: ignore[operator]
    if not same_tree or not all(isinstance(x, _xc.ArrayImpl) for x in out_flat):
        return None
    out_flat, out_tree_dispatch = _pxla.reflatten_outputs_for_dispatch(out_tree, out_flat)
    # all flat arguments, including those XLA pruned as unused (in_avals holds only kept ones)
    n_args = len(jax.tree_util.tree_leaves(compiled.args_info))
    in_shardings = [
        _sharding_impls.physical_sharding(a, s)
        if a is not _core.abstract_token and _dtypes.issubdtype(a.dtype, _dtypes.extended)
        else s
        for s, a in zip(executable._in_shardings, executable.in_avals, strict=True)
    ]
    return _pxla.MeshExecutableFastpathData(
        executable.xla_executable, out_tree_dispatch, in_shardings,
        executable._out_shardings, [o.aval for o in out_flat],
        [o._committed for o in out_flat],
        [i in executable._kept_var_idx for i in range(n_args)],
        executable._dispatch_in_layouts, [],
    )


class _OnClearCaches:
    """What ``jax.clear_caches()`` clears, as jax's own caches are: ``cache_clear()``."""

    def __init__(self, clear: Callable[[], None]) -> None:
        self._clear = clear

    def cache_clear(self) -> None:
        self._clear()

    def cache_info(self) -> None:
        return None

    def cache_keys(self) -> list[Any]:
        return []


def on_clear_caches(clear: Callable[[], None]) -> Any:
    """Have ``jax.clear_caches()`` call ``clear``; returns the registration, which the caller
    holds (jax holds it weakly). ``jax._src.util.register_cache(cache, for_what)``: a cache
    ``clear_all_caches`` (what ``jax.clear_caches`` calls first) clears by its
    ``cache_clear()``; jax 0.4.36 to 0.12 (checked on 0.10.2 and 0.12)."""
    from jax._src import util as _util

    hook = _OnClearCaches(clear)
    _util.register_cache(hook, "kiln.jit in-process executables")
    return hook


def traced_extra_inputs(traced: jax.stages.Traced) -> int:
    """How many inputs the traced program takes besides its arguments: what it closed over
    that jax.jit passes as leading arguments, not as constants (a tracer leaked from another
    trace, a value with quasi-dynamic data such as a hijax ref). ``Traced._consts``, jax 0.7
    to 0.12 (checked on 0.10.2 and 0.12): jax.jit's call passes them (and raises
    UnexpectedTracerError for a tracer), the AOT ``Compiled`` of the trace expects them as
    inputs."""
    return len(getattr(traced, "_consts", None) or ())


def pytree_node_functions(typ: type) -> tuple[Any, ...]:
    """The flatten / unflatten callables registered for pytree node type ``typ`` (empty for a
    type with no Python-side registration: builtins, or a type jax does not know).

    ``jax._src.tree_util._registry`` maps each type registered through
    ``register_pytree_node`` / ``register_pytree_with_keys`` / ``register_dataclass`` to a
    ``_RegistryEntry(to_iter, from_iter)`` (jax 0.4 to 0.10.2). They run whenever an argument of
    that type is flattened or rebuilt inside the trace, so they are part of what a program is
    built from.
    """
    entry = getattr(_tree_util, "_registry", {}).get(typ)
    if entry is None:
        return ()
    return tuple(f for f in (getattr(entry, "to_iter", None), getattr(entry, "from_iter", None))
                 if f is not None)


InternalFloatingPointError = _api_util.InternalFloatingPointError


def raise_floating_point_error(e: Exception, fun: Any, args: Any, kwargs: Any) -> None:
    """Raise the ``FloatingPointError`` ``jax.jit`` raises for ``e`` (naming the operation that
    produced the NaN or inf when the de-optimized re-run finds it)."""
    _api_util.maybe_recursive_nan_check(e, fun, args, kwargs)  # raises when it finds the op
    raise FloatingPointError(
        f"invalid value ({getattr(e, 'ty', 'nan')}) encountered in {getattr(e, 'name', fun)}"
    ) from None


def give_debug_info(wrapper: Any, fun: Any, args: Sequence[Any], kwargs: dict[str, Any],
                    static_argnums: Sequence[int], static_argnames: Sequence[str],
                    n_leaves: int, keep: Sequence[int] | None = None) -> None:
    """Make ``jax.jit(wrapper)`` name ``fun`` and its arguments where jax names them (its
    errors: "while tracing the function f at file:line ... the argument y['a']"; the lowered
    module; jax_explain_cache_misses), as ``jax.jit(fun)`` called with ``args`` / ``kwargs``
    would, when ``wrapper`` takes the ``n_leaves`` array leaves of that call (``keep``: the
    indices, among the leaves of the non-static arguments, of those it takes; all when None).

    ``jax._src.api_util.debug_info(traced_for, fun, args, kwargs, static_argnums=,
    static_argnames=)`` makes jax.jit's ``DebugInfo``, whose ``arg_names`` has one name per
    leaf of the non-static arguments, and ``debug_info`` returns a function's
    ``__fun_debug_info__`` when it has one (what jax's own wrappers set, through
    ``save_wrapped_fun_debug_info``); both in jax 0.10.2 and 0.12 (checked). Where the names do
    not fit the wrapper's leaves one to one, or jax cannot name them, nothing is set (jax
    names the wrapper, as before)."""
    try:
        dbg = _api_util.debug_info("jit", fun, args, kwargs, static_argnums=static_argnums,
                                   static_argnames=static_argnames)
        names = dbg.arg_names
        if names is None:
            return
        if keep is not None:
            names = tuple(names[i] for i in keep if i < len(names))
        if len(names) != n_leaves:
            return
        wrapper.__fun_debug_info__ = dbg._replace(arg_names=tuple(names))
    except Exception as e:  # noqa: BLE001 - jax's own names are a nicety, never a failure
        logger.debug("kiln: jax's debug info for %r not given: %s", fun, e)


class _Slot:
    """A placeholder leaf (``broadcast_prefix`` needs a tree, kiln has a treedef)."""


def broadcast_prefix(prefix: Any, treedef: Any) -> list[Any]:
    """jax.jit's rule for ``in_shardings``: ``prefix`` (a pytree prefix; None leaves are
    kept, meaning "unspecified") broadcast to one entry per leaf of ``treedef``.
    ``jax._src.tree_util.broadcast_prefix`` (0.10 to 0.12)."""
    full = treedef.unflatten([_Slot()] * treedef.num_leaves)
    return list(_tree_util.broadcast_prefix(prefix, full, is_leaf=lambda x: x is None))


def pytree_differences(got: Any, want: Any) -> list[Any]:
    """(path, got, want, explanation) per difference of two treedefs, as jax's AOT error
    lists them (``jax._src.tree_util.equality_errors_pytreedef``, 0.10 to 0.12)."""
    return list(_tree_util.equality_errors_pytreedef(got, want))


def fun_name(fun: Any) -> str:
    """The name JAX gives ``fun`` (a partial's function's, unless the partial has its own
    ``__name__``; ``jax._src.util.fun_name``, jax 0.10 to 0.12)."""
    from jax._src import util as _util

    return str(_util.fun_name(fun))
