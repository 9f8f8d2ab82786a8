"""``kiln.noinline``: a sub-function compiled once and called by every program that uses it.

XLA inlines every jitted callee and compiles it again inside each caller and at each call site
(jax-ml/jax #4572, #3847). A ``kiln.noinline`` function is instead compiled once per abstract
signature, as a :func:`kiln.jit` executable (stored like any other entry), and the outer program
calls that executable through a host callback, the mechanism ``equinox.internal.noinline`` uses.

The call is a host callback (segmented execution is not
built, see docs/benchmarks.md). Its price is a device -> host -> device round trip per call,
until a ``kiln.jit`` caller tiers up (``kiln._miss._tier_up``: the program compiled with its calls
inlined). Use it for sub-functions that are expensive to compile and called from many programs
or sites.

Transformations are derived functions, each itself compiled once: ``jvp`` (the tangent part of
``jax.jvp``), the transpose of a linear function (for ``grad`` / ``vjp``), and ``vmap`` (the
batched function, one per set of batched arguments).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._base import KilnError
from .._keys import check_argnames, static_digest
from .._miss import DERIVE, Sub, avals_of, derived_name, noinline_p, split_linear
from .._travel import _pickling
from . import _api

__all__ = ["noinline", "NoinlineFunction", "DynamicNoinline"]

# -- public wrapper ---------------------------------------------------------------------------
class _OutTree(dict[Any, Any]):
    """Where a flat function leaves its output pytree structure, per input avals (it may
    depend on shapes); not part of any key."""

    def __kiln_digest__(self) -> bytes:
        return b"out-tree-holder"

    __hash__ = object.__hash__  # type: ignore[assignment]

class NoinlineFunction:
    """A function compiled once per abstract signature and called, not inlined, by every
    program that uses it. Create with :func:`kiln.noinline`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        static_argnames: str | Sequence[str] = (),
        tier_up: bool = True,
    ) -> None:
        if not callable(fun):
            raise TypeError(f"kiln.noinline: fun must be callable, got {fun!r}")
        if not isinstance(tier_up, bool):
            raise TypeError(f"kiln.noinline: tier_up must be True or False, got {tier_up!r}")
        self._tier_up = tier_up
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._static_argnames = frozenset(
            (static_argnames,) if isinstance(static_argnames, str) else static_argnames
        )
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        check_argnames(fun, params, [("static_argnames", n) for n in sorted(self._static_argnames)],
                       prefix="kiln.noinline: ")
        # positional parameters, so a static argument may be passed by position too
        self._positional = [
            (p.name, p.kind == p.POSITIONAL_ONLY) for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._subs: dict[Any, tuple[Sub, _OutTree]] = {}
        self._dispatch: dict[Any, _ArgumentCallee] = {}
        self._lock = threading.Lock()
        with _registry_lock:
            # the leaf of self.dynamic(): a program taking it calls whichever function the
            # handle names (no retrace, no recompile)
            self._handle = np.asarray(next(_next_handle), dtype=np.int32)
            _registry[int(self._handle)] = self

    def __repr__(self) -> str:
        return f"<kiln.noinline {getattr(self._fun, '__qualname__', self._fun)!r}>"

    def __reduce__(self) -> Any:
        """By reference when this very object can be found again by module and name; otherwise
        by value (with cloudpickle), carrying the stored entries of the executables compiled
        for it so far (``pickle_max_size``), as a :class:`kiln.JitFunction` does. Unpickling
        is trusted, as pickle always is."""
        name = _pickling.name_if_found(self)
        if name is not None:
            return name
        with self._lock:
            subs = [sub for sub, _ in self._subs.values()]
        entries = [e for sub in subs for per_miss in list(sub.jit._entries)
                   for e in list(per_miss)]
        return (_unpickle, (_pickling.portable(self._fun), sorted(self._static_argnames),
                            self._tier_up, _pickling.carried_entries(entries)))

    def dynamic(self) -> DynamicNoinline:
        """This function as a dynamic argument of a jitted program: exchanging it for another
        noinline function with the same static argument names and output avals reuses the
        program's trace and executable (see :class:`DynamicNoinline`).

        A :class:`NoinlineFunction` itself is not a JAX type: pass it as a static argument
        (``static_argnames``, or to ``equinox.filter_jit`` / :func:`kiln.filter_jit`, which
        treat it as static), or call it from the program's body.

        Example:
            >>> import jax, jax.numpy as jnp, kiln
            >>> sin2 = kiln.noinline(lambda x: jnp.sin(x) * 2)
            >>> cos2 = kiln.noinline(lambda x: jnp.cos(x) * 2)
            >>> apply = jax.jit(lambda f, x: f(x) + 1)
            >>> [round(float(apply(f.dynamic(), jnp.float32(0.0))), 3) for f in (sin2, cos2)]
            [1.0, 3.0]
        """
        return DynamicNoinline(self, self._handle)

    def _sub(self, treedef: Any, statics: dict[str, Any], static_key: Any) -> Any:
        key = (treedef, static_key)
        with self._lock:
            got = self._subs.get(key)
            if got is None:
                out = _OutTree()
                fun = self._fun

                def flat(*leaves: Any) -> list[Any]:
                    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
                    result = fun(*args, **kwargs, **statics)
                    out_leaves, tree = jax.tree_util.tree_flatten(result)
                    out[tuple(avals_of([jax.typeof(x) for x in leaves]))] = tree
                    return out_leaves

                name = f"{getattr(fun, '__qualname__', 'fun')}[noinline]"
                module = getattr(fun, "__module__", None) or "__main__"
                sub = Sub(flat, name, module, _own_jit, tier_up=self._tier_up)
                got = self._subs[key] = (sub, out)
            return got

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """(leaves, (treedef, statics, static_key), sub-function, output tree)."""
        # arguments that can be passed by name are, so f(x, 2, y) and f(x, n=2, y=y) share
        # one sub-function, and a static argument may be passed by position
        only = sum(1 for _, po in self._positional if po)
        if len(args) <= len(self._positional):
            named = {name: a for (name, _), a in zip(self._positional[only:], args[only:],
                                                     strict=False)}
            args, kwargs = tuple(args[:only]), {**named, **kwargs}
        else:
            kwargs = dict(kwargs)
        positional_statics = [
            name for name, _ in self._positional[: len(args)] if name in self._static_argnames
        ]
        if positional_statics:
            name = getattr(self._fun, "__name__", self._fun)
            raise TypeError(
                f"kiln.noinline: pass the static argument {positional_statics[0]!r} of "
                f"{name!r} by keyword (it is positional-only or followed by *args)"
            )
        statics = {k: kwargs.pop(k) for k in list(kwargs) if k in self._static_argnames}
        static_key = tuple((k, static_digest(v, argname=k)) for k, v in sorted(statics.items()))
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        sub, out = self._sub(treedef, statics, static_key)
        avals = tuple(avals_of([jax.typeof(x) for x in leaves]))
        tree = out.get(avals)
        if tree is None:
            sub.outavals_of(avals)  # traces the function at these avals: sets its output tree
            tree = out[avals]
        return leaves, (treedef, statics, static_key), sub, tree

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _, sub, tree = self._prepare(args, kwargs)
        return jax.tree_util.tree_unflatten(tree, noinline_p.bind(*leaves, fn=sub))


def _own_jit(flat_fun: Callable[..., Any]) -> Any:
    """The kiln.jit of a noinline function's flat function (and of those derived from it): its
    callers tier up; its own executable stays as it is."""
    jf = _api.jit(flat_fun)
    jf._may_tier_up = False
    return jf


def _unpickle(fun: Any, static_argnames: list[str], tier_up: bool,
              entries: list[tuple[str, bytes]]) -> NoinlineFunction:
    """A noinline function pickled by value, made again; its carried entries go to this
    process's store (verified first), where its calls find them."""
    if entries:
        _pickling.store_carried(entries)
    return NoinlineFunction(fun, static_argnames=static_argnames, tier_up=tier_up)


_registry: weakref.WeakValueDictionary[int, NoinlineFunction] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_next_handle = itertools.count()


class _Interface:
    """The pytree aux data of a :class:`DynamicNoinline`: every noinline function with the
    same static argument names has the same interface, so exchanging one for another as an
    argument of a jitted program keeps its cache key (as ``equinox.internal.noinline``'s
    ``abstract_fn``)."""

    __slots__ = ("template",)

    def __init__(self, template: NoinlineFunction) -> None:
        self.template = template

    def _id(self) -> tuple[str, ...]:
        return tuple(sorted(self.template._static_argnames))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Interface) and self._id() == other._id()

    def __hash__(self) -> int:
        return hash(self._id())

    def __kiln_digest__(self) -> str:
        return "kiln.noinline interface: " + ",".join(self._id())

    def __repr__(self) -> str:
        return f"kiln.noinline interface(static_argnames={list(self._id())})"


class DynamicNoinline:
    """A :class:`NoinlineFunction` as a *dynamic* argument (from ``f.dynamic()``): a pytree
    whose one leaf is the function's int32 handle, so a jitted program taking it runs any noinline
    function with the same static argument names and output avals without retracing or
    recompiling. Calls inside the program go to whichever function the handle names when it runs
    (a host callback into that function's executable; never inlined by tier-up).

    Its leaf is an int32 array: keep it out of numerical tree maps (``eqx.is_inexact_array``
    filters it out), since a changed handle names another function.
    """

    # the fingerprint walk follows __wrapped__ (the code), not the process-local handle
    _kiln_walk_wrapped = True

    def __init__(self, template: NoinlineFunction, handle: Any) -> None:
        self.template = template
        self.handle = handle
        self.__wrapped__ = template._fun

    def __repr__(self) -> str:
        return f"<kiln.noinline {getattr(self.template._fun, '__qualname__', '?')!r} (dynamic)>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = self.template
        if self.handle is t._handle:  # not traced: this very function
            return t(*args, **kwargs)
        leaves, call, sub, tree = t._prepare(args, kwargs)
        key = (call[0], call[2])
        with t._lock:
            d = t._dispatch.get(key)
            if d is None:
                d = t._dispatch[key] = _ArgumentCallee(t, call, sub.name)
        handle = jax.numpy.asarray(self.handle, dtype=jax.numpy.int32)
        return jax.tree_util.tree_unflatten(tree, noinline_p.bind(handle, *leaves, fn=d))


def _flatten(f: DynamicNoinline) -> tuple[tuple[Any], _Interface]:
    return (f.handle,), _Interface(f.template)


def _unflatten(aux: _Interface, children: Sequence[Any]) -> Any:
    (handle,) = children
    if isinstance(handle, np.ndarray | np.generic | jax.Array) and not isinstance(
        handle, jax.core.Tracer
    ):
        f = _lookup(handle)
        return DynamicNoinline(f, f._handle)
    return DynamicNoinline(aux.template, handle)  # traced: resolved at run time, on the host


jax.tree_util.register_pytree_node(DynamicNoinline, _flatten, _unflatten)


def _lookup(handle: Any) -> NoinlineFunction:
    if np.ndim(handle) != 0:
        raise KilnError(
            f"a batch of noinline functions (handles {np.asarray(handle).tolist()}) is not "
            "supported: map over the function's arguments, or call each function separately"
        )
    try:
        return _registry[int(np.asarray(handle))]
    except (KeyError, TypeError, ValueError):
        raise KilnError(
            f"no kiln.noinline function has handle {handle!r} in this process (handles are "
            "process-local: pass f.dynamic(), not a number)"
        ) from None


class _ArgumentCallee:
    """The ``fn`` of a noinline call whose function is a run-time argument: operand 0 is the
    function's handle; the host looks the function up and calls its executable (or the
    executable of its derived function along ``path``: jvp, transpose, vmap)."""

    tier_up = False  # which function runs is only known at run time

    def __init__(self, template: NoinlineFunction, call: Any, name: str,
                 path: tuple[Any, ...] = ()) -> None:
        self.template = template
        self.call = call  # (treedef, statics, static_key) of the call site
        self.name = name
        self.path = path
        self._derived: dict[Any, _ArgumentCallee] = {}
        self._lock = threading.Lock()

    def resolve(self, f: NoinlineFunction) -> Sub:
        sub: Sub = f._sub(*self.call)[0]
        for step in self.path:
            sub = DERIVE[step[0]](sub, *step[1:])
        return sub

    def outavals_of(self, in_avals: Sequence[Any]) -> list[Any]:
        return self.resolve(self.template).outavals_of(in_avals[1:])

    def effects(self, in_avals: Sequence[Any]) -> Any:
        return self.resolve(self.template).effects(in_avals[1:])

    # -- the callee protocol (kiln._miss._noinline_p): the handle (operand 0) has no tangent, no
    # cotangent, and is never batched
    def called_name(self) -> str:
        module = getattr(self.template._fun, "__module__", None) or "__main__"
        return f"{module}.{self.name} (argument)"

    def bind_jvp(self, primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        handle, xs = primals[0], primals[1:]
        d = self.derived(("jvp", len(xs)))
        return noinline_p.bind(handle, *xs, *tangents[1:], fn=d)

    def bind_transpose(self, cts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        handle, rest = args[0], args[1:]
        linear, known, lin_shapes = split_linear(rest)
        t_fn = self.derived(("transpose", linear, lin_shapes))
        ct_lin = iter(noinline_p.bind(handle, *known, *cts, fn=t_fn))
        return [None] + [next(ct_lin) if lin else None for lin in linear]

    def bind_batched(self, args: Sequence[Any], axes: tuple[int | None, ...]) -> Any:
        if axes[0] is not None:
            raise KilnError(
                f"jax.vmap over a batch of noinline functions ({self.name}) is not supported: "
                "map over the function's arguments, or call each function separately"
            )
        return noinline_p.bind(*args, fn=self.derived(("vmap", axes[1:])))

    def derived(self, step: tuple[Any, ...]) -> _ArgumentCallee:
        with self._lock:
            got = self._derived.get(step)
            if got is None:
                name = derived_name(self.name, step[0] if step[0] != "vmap"
                                     else f"vmap{list(step[1])}")
                got = self._derived[step] = _ArgumentCallee(
                    self.template, self.call, name, self.path + (step,)
                )
            return got

    def __call__(self, handle: Any, *leaves: Any) -> list[Any]:
        f = _lookup(handle)
        sub = self.resolve(f)
        if f is not self.template:
            avals = avals_of([jax.typeof(x) for x in leaves])
            want, got = self.resolve(self.template).outavals_of(avals), sub.outavals_of(avals)
            if want != got:
                raise KilnError(
                    f"kiln.noinline: {sub.name} returns {[str(a) for a in got]} where the "
                    f"program was traced with {self.name} returning {[str(a) for a in want]}; "
                    "functions exchanged as an argument must have the same output shapes and "
                    "dtypes"
                )
        return sub(*leaves)


def noinline(
    fun: Callable[..., Any] | None = None,
    *,
    static_argnames: str | Sequence[str] = (),
    tier_up: bool = True,
) -> Any:
    """Compile ``fun`` once per abstract signature; every caller calls that executable.

    Args:
        fun: a function of pytrees of arrays (outputs: pytrees of arrays).
        static_argnames: keyword arguments passed by value (hashed as :func:`kiln.jit`
            hashes static arguments).
        tier_up: under :func:`kiln.jit`, let the caller's fully inlined program compile in a
            background thread and replace the not-inlined one once ready (steady-state runtime
            of plain ``jax.jit``). ``False`` keeps this function a separate executable in
            every caller (e.g. a recursive function, whose inlined form grows exponentially).
            The global setting is ``kiln.configure(tier_up=...)`` / ``KILN_TIER_UP``.

    Returns:
        A :class:`NoinlineFunction` (or a decorator making one when ``fun`` is None).

    Raises:
        TypeError: ``fun`` is not callable, or ``tier_up`` is not a bool.

    Works under ``jax.jit`` / ``kiln.jit``, ``grad``, ``jvp``, ``vjp``, ``vmap``, ``scan``,
    ``while_loop`` and ``cond``; each derived function (tangent, transpose, batched) is compiled
    once too. Until tier-up (and always under plain ``jax.jit``) each call site executed costs a
    host round trip (a host callback, ~80 us on CPU), so prefer it for sub-functions whose
    compile time dominates. See docs/noinline.md.

    Example:
        >>> import jax, jax.numpy as jnp, kiln
        >>> @kiln.noinline
        ... def layer(x):
        ...     return jnp.tanh(x) * 2.0
        >>> f = jax.jit(lambda x: layer(layer(x)).sum())
        >>> round(float(f(jnp.ones(3))), 4)
        5.4555
    """
    if fun is None:
        return lambda f: NoinlineFunction(f, static_argnames=static_argnames, tier_up=tier_up)
    return NoinlineFunction(fun, static_argnames=static_argnames, tier_up=tier_up)
