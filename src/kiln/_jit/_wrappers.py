"""The ``jax.jit`` functions kiln makes of a kiln function's ``fun``: one *flat* jax.jit per
static configuration, ``inner(*array_leaves)``, kiln's calling convention for executables (top-
level misses and nested calls share it, so a function called both ways traces once per
signature, as jax.jit does); and, for :meth:`JitFunction.trace`, one over the user's argument
structure with the static arguments bound."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._base import _jax_compat
from .._keys import ARRAY_TYPES, _args
from .._miss import Box, Call, Statics, abstract_sig, is_static_output
from ._options import JitOptions

__all__ = ["JitWrappers"]

_tree_flatten = jax.tree_util.tree_flatten


def _frozen(v: Any) -> Any:
    """A static value as it is now. What is traced from it is kept (per digest) for later
    signatures too, and an unhashable value (a numpy array, a list) may be changed in place
    after this call: keep a copy, so a later trace sees the value the key says."""
    if not isinstance(v, jax.Array):  # (immutable)
        try:
            hash(v)
        except TypeError:
            with contextlib.suppress(Exception):  # cannot be copied: bound as it is
                return copy.deepcopy(v)
    return v


class JitWrappers:
    """The jax.jit functions of ``fun`` (named ``name``) with ``options``, the flat ones kept
    per static configuration."""

    def __init__(self, fun: Callable[..., Any], name: str, options: JitOptions) -> None:
        self._fun = fun
        self._name = name
        self._options = options
        self._flat: dict[Any, tuple[Any, Any, Box]] = {}

    def clear(self) -> None:
        self._flat.clear()

    def _merge(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> Callable[..., Any]:
        """``call(dyn_args, dyn_kwargs)`` that re-inserts the static arguments and calls fun."""
        if self._options.traced_fun:
            # fun is the hidden first argument (filter_jit of a Module holding arrays), rebuilt
            # from its traced arrays and static leaves
            return lambda dyn, dkw: dyn[0](*dyn[1:], **dkw)
        fun = self._fun
        pos = {w: _frozen(v) for w, v in statics if isinstance(w, int)}
        kw = {w: _frozen(v) for w, v in statics if isinstance(w, str)}
        total = n_dyn + len(pos)
        pos = {(w if w >= 0 else total + w): v for w, v in pos.items()}

        def call(dyn: Sequence[Any], dkw: dict[str, Any]) -> Any:
            it = iter(dyn)
            args = [pos[i] if i in pos else next(it) for i in range(total)]
            return fun(*args, **dkw, **kw)

        return call

    def structured(self, call: Call) -> Any:
        """A plain ``jax.jit`` of fun over the user's argument structure with the statics
        bound: what :meth:`JitFunction.trace` gives with static arguments (static arrays by
        value, which ``jax.jit`` itself refuses)."""
        options = self._options
        n_dyn = len(call.dyn_args)
        merge = self._merge(call.statics, n_dyn)
        dyn_positions = _args.dyn_positions(call.statics, n_dyn)
        donate = tuple(j for j, i in enumerate(dyn_positions) if i in options.donate_argnums)
        static_names = {w for w, _ in call.statics if isinstance(w, str)}
        dnames = tuple(n for n in options.donate_argnames if n not in static_names)

        def inner(*dyn: Any, **dkw: Any) -> Any:
            return merge(dyn, dkw)

        self._name_as_jax(inner, call, {})
        return self._inner_jit(inner, donate_argnums=donate, donate_argnames=dnames or None)

    def flat(self, call: Call, static_leaves: dict[int, Any] | None = None
             ) -> tuple[Callable[..., Any], Any, Box]:
        """(direct, jitted, box): ``jax.jit`` of ``inner(*array_leaves)``, one per static
        configuration; ``direct``: the same function not jitted (``jax.disable_jit``).
        ``static_leaves``: ``Statics.of(call).leaves`` where the caller has it (a miss),
        else resolved here when the configuration is new.

        kiln.filter_jit's static leaves (leaves that are not arrays, such as an equinox
        Module's functions and ints) are bound here, as ``equinox.filter_jit`` does; so are
        its non-array outputs, recorded in ``box`` per traced signature.
        """
        n_dyn, treedef = len(call.dyn_args), call.treedef
        cache_key = (call.static_key, n_dyn, treedef)
        got = self._flat.get(cache_key)
        if got is not None:
            return got
        if static_leaves is None:
            static_leaves = Statics.of(call).leaves
        merge = self._merge(call.statics, n_dyn)
        n_leaves = treedef.num_leaves
        box = Box()
        filtering = self._options.filter_jit
        name = self._name  # (inner must not hold self: the cycle would outlive a del)

        def direct(*dyn_leaves: Any) -> Any:
            it = iter(dyn_leaves)
            leaves = [static_leaves[i] if i in static_leaves else next(it) for i in range(n_leaves)]
            dyn_args, dyn_kwargs = treedef.unflatten(leaves)
            return merge(dyn_args, dyn_kwargs)

        runs = [0]  # how many times jax ran the body: a trace it reused ran nothing

        def inner(*dyn_leaves: Any) -> Any:
            runs[0] += 1
            out = direct(*dyn_leaves)
            if not filtering:
                return out  # jax.jit's contract: jax itself refuses a non-JAX output
            out_leaves, out_tree = _tree_flatten(out)
            static_out = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, ARRAY_TYPES)}
            if not static_out:
                box.pop(abstract_sig(dyn_leaves), None)
                return out
            for x in static_out.values():
                if not is_static_output(x):
                    # jax.jit's error: a traced value escaping in a Python object, a generator
                    raise TypeError(
                        f"function {name} traced for jit returned a value of type "
                        f"{type(x)}, which is not a valid JAX type"
                    )
            # outputs that are not arrays (an equinox Module's functions, ints, strings) are
            # returned outside the executable, as equinox.filter_jit does
            box[abstract_sig(dyn_leaves)] = (out_tree, static_out)
            return [x for i, x in enumerate(out_leaves) if i not in static_out]

        inner._kiln_runs = runs  # type: ignore[attr-defined]  # (Program.trace reads it)
        self._name_as_jax(inner, call, static_leaves)
        jitted = self._inner_jit(inner, donate_argnums=self.donated_leaves(call, static_leaves),
                                 **self._flat_shardings(treedef, static_leaves))
        got = self._flat[cache_key] = (direct, jitted, box)
        return got

    def _name_as_jax(self, wrapper: Callable[..., Any], call: Call,
                     static_leaves: dict[int, Any]) -> None:
        """Name ``wrapper`` as fun; jax then names fun and its arguments in what it says of it
        (an error while tracing, the lowered module) as for ``jax.jit(fun)`` called as ``call``
        was: "the function f at model.py:12", "the argument y['a']", not kiln's leaves."""
        wrapper.__name__ = getattr(self._fun, "__name__", "fun")
        wrapper.__qualname__ = self._name
        total = len(call.dyn_args) + sum(isinstance(w, int) for w, _ in call.statics)
        pos = {(w if w >= 0 else total + w): v for w, v in call.statics if isinstance(w, int)}
        it = iter(call.dyn_args)
        args = [pos[i] if i in pos else next(it) for i in range(total)]
        static_names = tuple(w for w, _ in call.statics if isinstance(w, str))
        kwargs = {**call.dyn_kwargs, **{w: v for w, v in call.statics if isinstance(w, str)}}
        n_all = call.treedef.num_leaves
        keep = [i for i in range(n_all) if i not in static_leaves] if static_leaves else None
        _jax_compat.give_debug_info(wrapper, self._fun, args, kwargs, tuple(pos), static_names,
                                    n_leaves=n_all - len(static_leaves), keep=keep)

    def _flat_shardings(self, treedef: Any, static_leaves: dict[int, Any]) -> dict[str, Any]:
        """``in_shardings`` per array leaf (jax.jit's is a prefix of the dynamic positional
        arguments) and ``out_shardings`` as given."""
        options = self._options
        out: dict[str, Any] = {}
        if options.out_shardings is not None:
            out["out_shardings"] = options.out_shardings
        if options.in_shardings is None:
            return out
        kids = treedef.children()[0].children()  # (checked by _prepare._in_shardings_fit)
        spec = options.in_shardings
        if not isinstance(spec, tuple | list):
            spec = (spec,) * len(kids)
        per_leaf = [x for prefix, child in zip(spec, kids, strict=True)
                    for x in _jax_compat.broadcast_prefix(prefix, child)]
        out["in_shardings"] = tuple(x for i, x in enumerate(per_leaf) if i not in static_leaves)
        return out

    def _inner_jit(self, inner: Callable[..., Any], **kwargs: Any) -> Any:
        """``jax.jit`` of one of kiln's wrappers of fun, with the user's jax.jit options (jax
        warned about a deprecated ``device`` / ``backend`` once, at decoration)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "backend and device argument", DeprecationWarning)
            return jax.jit(inner, **kwargs, **self._options.jax_options)

    def donated_leaves(self, call: Call, static_leaves: dict[int, Any]) -> tuple[int, ...]:
        """The indices of the array leaves the flat jax.jit of ``call`` donates
        (``static_leaves``: ``Statics.of(call).leaves``)."""
        options, treedef = self._options, call.treedef
        args_def, kwargs_def = treedef.children()
        donated: list[int] = []
        if options.donate_rest:  # (kiln.filter_jit's donate mode)
            # every leaf but the first argument's (unless donate_first); the function's own
            # arrays, a hidden argument before it (traced_fun), go with the rest, as equinox's
            kids = args_def.children()
            skip = len(options.traced_fun)
            start = sum(k.num_leaves for k in kids[:skip])
            end = start if options.donate_first or len(kids) <= skip else (
                start + kids[skip].num_leaves)
            donated = [i for i in range(treedef.num_leaves) if not start <= i < end]
        elif not (options.donate_argnums or options.donate_argnames):
            return ()
        dyn_positions = _args.dyn_positions(call.statics, len(call.dyn_args))
        given = [i in options.donate_argnums for i in dyn_positions]
        given += [name in options.donate_argnames for name in kwargs_def.node_data()[1] or []]
        start = 0
        for give, child in zip(given, args_def.children() + kwargs_def.children(), strict=True):
            if give:
                donated += range(start, start + child.num_leaves)
            start += child.num_leaves
        # renumber over dynamic (array) leaves only
        order = [i for i in range(treedef.num_leaves) if i not in static_leaves]
        index = {leaf: k for k, leaf in enumerate(order)}
        return tuple(index[i] for i in donated if i in index)
