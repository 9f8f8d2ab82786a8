"""Keying one call of a kiln function in this process: split the static arguments (and, under
kiln.filter_jit, the leaves that are not arrays) from the dynamic ones, digest the static
values, and make the in-process table's key (:class:`TableKey`) of the :class:`Call`; and the
check a :class:`kiln.Compiled` makes of the arguments it is given."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from .._base import StaticArgumentError, _jax_compat
from .._keys import STATIC_LEAF, Unpersistable, _args, static_digest
from .._miss import Call
from . import _stages
from ._dispatch import StaticValue
from ._options import JitOptions

__all__ = ["TO_JAX", "TableKey", "aot_check", "prepare"]

_tree_flatten = jax.tree_util.tree_flatten
# Set on the first call (not at import: importing kiln must not start the XLA backend).
_trace_context_token = _jax_compat.trace_context_token

# A Call's key for arguments kiln.jit hands to the plain jax.jit of its function, whose own
# errors name them (a leaf that is not a JAX type, in_shardings that do not fit).
TO_JAX = object()


class TableKey(NamedTuple):
    """A key of the in-process table: one executable per trace context and signature."""

    context: Any  # jax's trace context (config values that change tracing)
    treedef: Any  # of (dynamic args, dynamic kwargs)
    sigs: tuple[Any, ...]  # per leaf: aval (and sharding), Python scalar type
    static_key: tuple[Any, ...]  # static arguments and static leaves, by digest


def prepare(options: JitOptions, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Call:
    """The call of the function ``name`` with ``options``: its key, array leaves, dynamic and
    static parts.

    The key is None under a transformation (a tracer among the leaves, or an outer trace the
    function may close over), and :data:`TO_JAX` for arguments kiln.jit hands to the plain
    jax.jit (a leaf that is not a JAX type: jax's own TypeError)."""
    if options.filter_jit and options.signature is not None:
        # equinox binds to the signature: f(x, y=1) and f(x, 1) are one program
        bound = options.signature.bind(*args, **kwargs)
        args, kwargs = bound.args, bound.kwargs
    if options.traced_fun:
        # filter_jit of a pytree holding arrays (a Module): a hidden first argument, traced
        # and keyed as arguments are (equinox partitions its function as it does them)
        args = options.traced_fun + tuple(args)
    if options.has_statics:
        dyn_args, dyn_kwargs, statics = _split(options, args, kwargs)
        skey = _static_key(options, name, statics) if statics else ()
    else:
        dyn_args, dyn_kwargs, statics, skey = args, kwargs, (), ()
    leaves, treedef = _tree_flatten((dyn_args, dyn_kwargs))
    sigs = tuple(map(_args.filter_leaf_sig if options.filter_jit else _args.leaf_sig, leaves))
    key: Any = None
    if options.in_shardings is not None and not _in_shardings_fit(options, dyn_args,
                                                                   dyn_kwargs):
        key = TO_JAX  # jax.jit's error for kwargs or a prefix of another length
    elif STATIC_LEAF in sigs:
        if not options.filter_jit:
            key = TO_JAX
        else:
            leaf_key, leaves = _static_leaves(options, name, leaves, sigs, treedef)
            skey = skey + leaf_key
    if key is None and None not in sigs and _jax_compat.at_top_level():
        # jax's trace context includes jax_disable_jit, x64, matmul precision, ...
        key = TableKey(_trace_context_token(), treedef, sigs, skey)
    # else: a tracer among the arguments, or one the function may close over: behave as
    # a nested jax.jit (never compile or store a program that captured a tracer)
    return Call(key, leaves, dyn_args, dyn_kwargs, statics, skey, treedef, sigs)


def _split(
    options: JitOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[Any, Any], ...]]:
    n, nums, names = len(args), options.static_argnums, options.static_argnames
    at = [i for i in range(n) if i in nums or (i - n) in nums]
    statics = [(i, args[i]) for i in at] + [(k, v) for k, v in kwargs.items() if k in names]
    return (tuple(a for i, a in enumerate(args) if i not in at),
            {k: v for k, v in kwargs.items() if k not in names},
            tuple((w, v.value if type(v) is StaticValue else v) for w, v in statics))


def _static_key(
    options: JitOptions, name: str, statics: Sequence[tuple[Any, Any]],
    names: Sequence[str] | None = None,
) -> tuple[Any, ...]:
    """``(key name, digest)`` of each static value, sorted by key name. The key name is the
    parameter name when the signature gives one (so ``f(x, t)`` and ``f(x, table=t)`` share an
    executable), else ``args[i]``; static leaves keep their ``("leaf", i)`` position. A value
    with no canonical digest is keyed by itself (``("process-local", value)``: ``==`` in this
    process only)."""
    out: list[tuple[Any, Any]] = []
    for n, (where, value) in enumerate(statics):
        keyname = _args.param_name(options.positional, where)
        argname = names[n] if names else (keyname if isinstance(keyname, str) else "leaf")
        try:
            out.append((keyname, static_digest(value, argname=argname)))
        except Unpersistable:
            try:
                hash(value)
            except TypeError:
                raise StaticArgumentError(
                    f"static argument {argname!r} of {name} is unhashable "
                    f"({type(value).__name__}); pass a hashable value or make it dynamic"
                ) from None
            out.append((keyname, ("process-local", value)))
    return tuple(sorted(out, key=lambda kv: str(kv[0])))


def _static_leaves(
    options: JitOptions, name: str, leaves: list[Any], sigs: tuple[Any, ...], treedef: Any
) -> tuple[tuple[Any, ...], list[Any]]:
    """Split non-JAX leaves off as static (keyed by value), keeping the array leaves."""
    idx = [i for i, s in enumerate(sigs) if s is STATIC_LEAF]
    statics = [(("leaf", i), leaves[i]) for i in idx]
    try:
        key = _static_key(options, name, statics)
    except StaticArgumentError:
        paths = [
            "args" + jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(
                treedef.unflatten(leaves), is_leaf=lambda x: x is None
            )[0]
        ]
        names = [paths[i] if i < len(paths) else f"leaf {i}" for i in idx]
        key = _static_key(options, name, statics, names)
    return key, [x for x, s in zip(leaves, sigs, strict=True) if s is not STATIC_LEAF]


def _in_shardings_fit(options: JitOptions, dyn_args: tuple[Any, ...],
                      dyn_kwargs: dict[str, Any]) -> bool:
    """in_shardings applies: no dynamic keyword arguments, and one entry per dynamic
    positional argument (else jax.jit's own error is raised)."""
    spec = options.in_shardings
    return not dyn_kwargs and (not isinstance(spec, tuple | list) or len(spec) == len(dyn_args))


def aot_check(
    options: JitOptions, name: str, call: Call
) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
    """``check(args, kwargs) -> leaves`` for a :class:`kiln.Compiled` made for ``call``:
    jax's AOT errors for another structure, shape or dtype."""
    if options.filter_jit:
        def check_all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
            got = prepare(options, name, args, kwargs)
            if got.treedef != call.treedef:
                raise TypeError(_stages.pytree_mismatch(got.treedef, call.treedef))
            if got.key != call.key:
                raise TypeError(_stages.type_mismatch([
                    "arguments differ in an array's shape or dtype, or in a value that is "
                    "not an array (static under filter_jit)"]))
            return list(got.leaves)

        return check_all
    paths = _args.leaf_paths(options.positional, call.dyn_args, call.dyn_kwargs, call.statics)
    names = [f"'{n}'" for n in paths]
    want = [jax.typeof(s()) if isinstance(s, type) else s[0] if isinstance(s, tuple) else s
            for s in call.sigs]

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves, tree = _tree_flatten((args, kwargs))
        if tree != call.treedef:
            raise TypeError(_stages.pytree_mismatch(tree, call.treedef))
        errors = []
        for argname, leaf, w in zip(names, leaves, want, strict=True):
            try:
                a = jax.typeof(leaf)
            except TypeError:
                raise TypeError(f"Argument {argname} of type {type(leaf)} is not a valid JAX "
                                "type") from None
            if (a.shape, a.dtype) != (w.shape, w.dtype):
                errors.append(f"Argument {argname} compiled with {w.str_short()} and called "
                              f"with {a.str_short()}")
        if errors:
            raise TypeError(_stages.type_mismatch(errors))
        return leaves

    return check
