"""``kiln.noinline``: a sub-function compiled once and called by every program that uses it.

XLA inlines every jitted callee and compiles it again inside each caller and at each call site
(jax-ml/jax #4572, #3847). A ``kiln.noinline`` function is instead compiled once per abstract
signature, as a :func:`kiln.jit` executable (stored like any other entry), and the outer program
calls that executable through a host callback, the mechanism ``equinox.internal.noinline`` uses.

The call is a host callback (the first mechanism DESIGN.md lists; segmented execution is not
built, see docs/benchmarks.md). Its price is a device -> host -> device round trip per call,
until a ``kiln.jit`` caller tiers up (``kiln._tier_up``: the program compiled with its calls
inlined). Use it for sub-functions that are expensive to compile and called from many programs
or sites.

Transformations are derived functions, each itself compiled once: ``jvp`` (the tangent part of
``jax.jvp``), the transpose of a linear function (for ``grad`` / ``vjp``), and ``vmap`` (the
batched function, one per set of batched arguments).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _jax_compat, _stats
from ._errors import KilnError

__all__ = ["noinline", "NoinlineFunction", "DynamicNoinline"]

noinline_p = Primitive("kiln_noinline")
noinline_p.multiple_results = True


class _Sub:
    """One flat function ``(*leaves) -> list of leaves`` with its own kiln.jit executable."""

    def __init__(
        self, flat_fun: Callable[..., list[Any]], name: str, module: str, *, tier_up: bool = True
    ) -> None:
        from ._jit import jit

        self.flat_fun = flat_fun
        self.name = name
        self.module = module
        self.tier_up = tier_up
        # named after the user's function, so `kiln ls` shows e.g. model.vf[noinline jvp]
        flat_fun.__name__ = flat_fun.__qualname__ = name  # type: ignore[attr-defined]
        flat_fun.__module__ = module
        self.jit = jit(flat_fun)
        # its callers tier up; the sub-function's own executable stays as it is
        self.jit._tier_up = False
        self._jaxprs: dict[tuple[Any, ...], Any] = {}
        self._inline_fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._sizes: dict[tuple[Any, ...], int] = {}
        self._derived: dict[Any, _Sub] = {}
        self._lock = threading.Lock()

    def jaxpr(self, in_avals: Sequence[Any]) -> Any:
        """The closed jaxpr of this function at ``in_avals`` (traced once per signature)."""
        key = tuple(in_avals)
        got = self._jaxprs.get(key)
        if got is None:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
            got = self._jaxprs[key] = jax.make_jaxpr(self.flat_fun)(*structs)
        return got

    def out_avals(self, in_avals: Sequence[Any]) -> list[Any]:
        return [jax.core.ShapedArray(o.shape, o.dtype) for o in self.jaxpr(in_avals).out_avals]

    def effects(self, in_avals: Sequence[Any]) -> Any:
        """The side effects of this function (``jax.debug.print``, ``io_callback``), which the
        noinline call carries, so it is never dead-code eliminated.

        Raises:
            KilnError: ordered effects, which cannot cross a separately compiled call.
        """
        effects = self.jaxpr(in_avals).effects
        ordered = _jax_compat.ordered_effects(effects)
        if ordered:
            raise KilnError(
                f"kiln.noinline: {self.name} has ordered side effects "
                f"({', '.join(sorted({type(e).__name__ for e in ordered}))}); a separately "
                "compiled function cannot take part in their ordering. Drop ordered=True "
                "(jax.debug.print / io_callback), or do not make this function noinline"
            )
        return effects

    def inline_fn(self, in_avals: Sequence[Any]) -> Callable[..., Any]:
        """A ``jax.jit`` of this function's jaxpr: what tier-up lowers in place of the callback
        (one outlined function per program, like a nested ``jax.jit``)."""
        key = tuple(in_avals)
        got = self._inline_fns.get(key)
        if got is None:
            run = jex.jaxpr_as_fun(self.jaxpr(in_avals))

            def inlined(*xs: Any) -> Any:
                return run(*xs)

            inlined.__name__ = inlined.__qualname__ = self.name.replace("[noinline", "[inlined")
            got = self._inline_fns[key] = jax.jit(inlined)
        return got

    def inlined_size(self, in_avals: Sequence[Any]) -> int:
        """Equations in this function once every tier-up noinline call in it is inlined."""
        key = tuple(in_avals)
        got = self._sizes.get(key)
        if got is None:
            got = self._sizes[key] = inlined_size(self.jaxpr(in_avals).jaxpr)
        return got

    def derived(self, key: Any, make: Callable[[], _Sub]) -> _Sub:
        with self._lock:
            sub = self._derived.get(key)
            if sub is None:
                sub = self._derived[key] = make()
            return sub

    def __call__(self, *leaves: Any) -> list[Any]:
        return list(self.jit(*leaves))

    def __kiln_digest__(self) -> str:
        """What this function computes, for the keys of functions derived from it."""
        from ._fingerprint import fingerprint

        fp = fingerprint(self.flat_fun)
        if not fp.sound:
            from ._hashing import Unpersistable

            raise Unpersistable(f"noinline function {self.name}: {fp.reason}")
        return f"{self.name}:{fp.digest}"


def _derived_name(name: str, what: str) -> str:
    """``vf[noinline]`` -> ``vf[noinline jvp]`` -> ``vf[noinline jvp transpose]``."""
    return f"{name[:-1]} {what}]"


# -- primitive rules ---------------------------------------------------------------------------
def _impl(*args: Any, fn: _Sub) -> list[Any]:
    return fn(*args)


def _abstract_eval(*avals: Any, fn: Any) -> tuple[list[Any], Any]:
    in_avals = _avals(avals)
    return fn.out_avals(in_avals), fn.effects(in_avals)


def _avals(avals: Sequence[Any]) -> list[Any]:
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]


def _lowering(ctx: Any, *args: Any, fn: _Sub) -> Any:
    if fn.tier_up and getattr(_inlining, "on", False):
        # tier-up (kiln._tier_up): the sub-function's own jaxpr, as a nested jax.jit would be
        inline = fn.inline_fn(_avals(ctx.avals_in))
        return mlir.lower_fun(inline, multiple_results=True)(ctx, *args)

    # ``mlir.emit_python_callback`` (what equinox's noinline uses) rather than
    # ``jax.pure_callback``: measured here, 295 us vs 109 us per call of a tiny sub-function,
    # since pure_callback adds its own argument conversion and device context per call
    def host(*xs: Any) -> list[np.ndarray]:
        _stats.bump(noinline_calls=1)
        return [np.asarray(o) for o in fn(*xs)]

    effects = fn.effects(_avals(ctx.avals_in))
    result, _, keepalive = mlir.emit_python_callback(
        ctx, host, None, list(args), ctx.avals_in, ctx.avals_out,
        has_side_effect=bool(effects), sharding=None,
    )
    ctx.module_context.add_keepalive(keepalive)
    return result


# -- tier-up support ----------------------------------------------------------------------------
_inlining = threading.local()


@contextlib.contextmanager
def inlining() -> Iterator[None]:
    """Lower ``kiln_noinline`` calls (of functions with ``tier_up=True``) inline, in this
    thread, for the duration of the block."""
    before = getattr(_inlining, "on", False)
    _inlining.on = True
    try:
        yield
    finally:
        _inlining.on = before


def inlined_size(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` once its tier-up noinline calls are inlined, counting each call
    site (XLA inlines every call): a recursive ``fib(t)`` grows exponentially with ``t``."""
    total = 0
    for eqn in _jax_compat.eqns_in(jaxpr):
        fn = eqn.params.get("fn") if eqn.primitive is noinline_p else None
        if fn is not None and fn.tier_up:
            total += fn.inlined_size(_avals([v.aval for v in eqn.invars]))
        else:
            total += 1
    return total


def called_names(jaxpr: Any) -> list[str]:
    """``module.name`` of every noinline function ``jaxpr`` calls directly (as their entries
    are named in the store; ``(argument)`` for functions passed as arguments), for ``kiln ls``."""
    names = set()
    for eqn in _jax_compat.eqns_in(jaxpr):
        fn = eqn.params.get("fn") if eqn.primitive is noinline_p else None
        if isinstance(fn, _Sub):
            names.add(f"{fn.module}.{fn.name}")
        elif isinstance(fn, _Dispatch):
            module = getattr(fn.template._fun, "__module__", None) or "__main__"
            names.add(f"{module}.{fn.name} (argument)")
    return sorted(names)


def separate_size(jaxpr: Any) -> int:
    """Equations compiled when ``jaxpr``'s tier-up noinline calls stay calls: its own (each call
    one equation) plus each distinct noinline function's, once."""
    return sum(1 for _ in _jax_compat.eqns_in(jaxpr)) + sum(
        sum(1 for _ in _jax_compat.eqns_in(sub.jaxpr)) for _, sub in calls_in(jaxpr)
    )


def calls_in(jaxpr: Any) -> list[tuple[_Sub, Any]]:
    """``(sub-function, its closed jaxpr)`` for every tier-up noinline function that inlining
    ``jaxpr`` would bring in, nested calls included (each once)."""
    out: dict[tuple[int, tuple[Any, ...]], tuple[_Sub, Any]] = {}
    stack = [jaxpr]
    while stack:
        for eqn in _jax_compat.eqns_in(stack.pop()):
            fn = eqn.params.get("fn") if eqn.primitive is noinline_p else None
            if fn is None or not fn.tier_up:
                continue
            avals = tuple(_avals([v.aval for v in eqn.invars]))
            if (id(fn), avals) not in out:
                closed = fn.jaxpr(avals)
                out[(id(fn), avals)] = (fn, closed)
                stack.append(closed.jaxpr)
    return list(out.values())


def _jvp_sub(fn: _Sub, n: int) -> _Sub:
    """The tangent part of ``fn`` (``n`` primals): ``(*primals, *tangents) -> tangents_out``."""

    def make() -> _Sub:
        def tangent_part(*pt: Any) -> list[Any]:
            _, t_out = jax.jvp(fn.flat_fun, tuple(pt[:n]), tuple(pt[n:]))
            return list(t_out)

        return _Sub(tangent_part, _derived_name(fn.name, "jvp"), fn.module, tier_up=fn.tier_up)

    return fn.derived("jvp", make)


def _transpose_sub(fn: _Sub, linear: tuple[bool, ...], lin_shapes: tuple[Any, ...]) -> _Sub:
    """The transpose of ``fn`` in its ``linear`` arguments: ``(*known, *cts) -> cts_linear``."""
    n_known = len(linear) - len(lin_shapes)

    def make() -> _Sub:
        def transposed(*kc: Any) -> list[Any]:
            k, c = kc[:n_known], kc[n_known:]

            def of_linear(*lin_args: Any) -> list[Any]:
                it_k, it_l = iter(k), iter(lin_args)
                full = [next(it_l) if lin else next(it_k) for lin in linear]
                return fn.flat_fun(*full)

            # linear_transpose rather than a vjp at zeros: the jvp of a custom_vjp function
            # (diffrax's checkpointed loops) is a custom_lin, transposable, not differentiable
            structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in lin_shapes]
            return list(jax.linear_transpose(of_linear, *structs)(list(c)))

        return _Sub(transposed, _derived_name(fn.name, "transpose"), fn.module, tier_up=fn.tier_up)

    return fn.derived(("transpose", linear, lin_shapes), make)


def _vmap_sub(fn: _Sub, axes: tuple[int | None, ...]) -> _Sub:
    """``fn`` batched along axis 0 of the arguments whose ``axes`` entry is 0."""

    def make() -> _Sub:
        def batched(*xs: Any) -> Any:
            return jax.vmap(fn.flat_fun, in_axes=axes)(*xs)

        name = _derived_name(fn.name, f"vmap{list(axes)}")
        return _Sub(batched, name, fn.module, tier_up=fn.tier_up)

    return fn.derived(("vmap", axes), make)


_DERIVE: dict[str, Callable[..., _Sub]] = {
    "jvp": _jvp_sub, "transpose": _transpose_sub, "vmap": _vmap_sub,
}


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, fn: Any) -> Any:
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    # primal and tangent outputs are separate binds, so reverse mode can linearize (the tangent
    # bind is linear in the tangents and gets transposed below)
    primal_out = noinline_p.bind(*primals, fn=fn)
    if isinstance(fn, _Dispatch):  # the handle (first operand) has no tangent
        handle, xs = primals[0], primals[1:]
        d = fn.derived(("jvp", len(xs)))
        return primal_out, noinline_p.bind(handle, *xs, *tangents[1:], fn=d)
    jvp_fn = _jvp_sub(fn, len(primals))
    return primal_out, noinline_p.bind(*primals, *tangents, fn=jvp_fn)


def _split_linear(args: Sequence[Any]) -> tuple[tuple[bool, ...], list[Any], tuple[Any, ...]]:
    linear = tuple(ad.is_undefined_primal(a) for a in args)
    known = [a for a, lin in zip(args, linear, strict=True) if not lin]
    lin_shapes = tuple(
        (tuple(a.aval.shape), str(a.aval.dtype))
        for a, lin in zip(args, linear, strict=True) if lin
    )
    return linear, known, lin_shapes


def _transpose(cts: Sequence[Any], *args: Any, fn: Any) -> list[Any]:
    cts = [ad.instantiate_zeros(c) for c in cts]
    if isinstance(fn, _Dispatch):
        handle, rest = args[0], args[1:]
        linear, known, lin_shapes = _split_linear(rest)
        t_fn = fn.derived(("transpose", linear, lin_shapes))
        ct_lin = iter(noinline_p.bind(handle, *known, *cts, fn=t_fn))
        return [None] + [next(ct_lin) if lin else None for lin in linear]
    linear, known, lin_shapes = _split_linear(args)
    ct_lin = iter(noinline_p.bind(*known, *cts, fn=_transpose_sub(fn, linear, lin_shapes)))
    return [next(ct_lin) if lin else None for lin in linear]


def _batch(args: Sequence[Any], dims: Sequence[Any], *, fn: Any) -> Any:
    args = [a if d is None else jax.numpy.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)]
    axes = tuple(None if d is None else 0 for d in dims)  # None: not batched
    if isinstance(fn, _Dispatch):
        if axes[0] is not None:
            raise KilnError(
                f"jax.vmap over a batch of noinline functions ({fn.name}) is not supported: "
                "map over the function's arguments, or call each function separately"
            )
        outs = noinline_p.bind(*args, fn=fn.derived(("vmap", axes[1:])))
    else:
        outs = noinline_p.bind(*args, fn=_vmap_sub(fn, axes))
    return outs, [0] * len(outs)


noinline_p.def_impl(_impl)
noinline_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(noinline_p, _lowering)
ad.primitive_jvps[noinline_p] = _jvp
ad.primitive_transposes[noinline_p] = _transpose
batching.primitive_batchers[noinline_p] = _batch


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
        from ._jit import check_argnames

        check_argnames(fun, params, [("static_argnames", n) for n in sorted(self._static_argnames)],
                       prefix="kiln.noinline: ")
        # positional parameters, so a static argument may be passed by position too
        self._positional = [
            (p.name, p.kind == p.POSITIONAL_ONLY) for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._subs: dict[Any, tuple[_Sub, _OutTree]] = {}
        self._dispatch: dict[Any, _Dispatch] = {}
        self._lock = threading.Lock()
        with _registry_lock:
            # the leaf of self.dynamic(): a program taking it calls whichever function the
            # handle names (no retrace, no recompile)
            self._handle = np.asarray(next(_next_handle), dtype=np.int32)
            _registry[int(self._handle)] = self

    def __repr__(self) -> str:
        return f"<kiln.noinline {getattr(self._fun, '__qualname__', self._fun)!r}>"

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
                    out[tuple(_avals([jax.typeof(x) for x in leaves]))] = tree
                    return out_leaves

                name = f"{getattr(fun, '__qualname__', 'fun')}[noinline]"
                module = getattr(fun, "__module__", None) or "__main__"
                got = self._subs[key] = (_Sub(flat, name, module, tier_up=self._tier_up), out)
            return got

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """(leaves, (treedef, statics, static_key), sub-function, output tree)."""
        from ._hashing import static_digest

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
        static_key = tuple(
            (k, static_digest(v, argname=k)) for k, v in sorted(statics.items())
        )
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        sub, out = self._sub(treedef, statics, static_key)
        avals = tuple(_avals([jax.typeof(x) for x in leaves]))
        tree = out.get(avals)
        if tree is None:
            sub.out_avals(avals)  # traces the function at these avals: sets its output tree
            tree = out[avals]
        return leaves, (treedef, statics, static_key), sub, tree

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _, sub, tree = self._prepare(args, kwargs)
        return jax.tree_util.tree_unflatten(tree, noinline_p.bind(*leaves, fn=sub))


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
                d = t._dispatch[key] = _Dispatch(t, call, sub.name)
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


class _Dispatch:
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
        self._derived: dict[Any, _Dispatch] = {}
        self._lock = threading.Lock()

    def resolve(self, f: NoinlineFunction) -> _Sub:
        sub: _Sub = f._sub(*self.call)[0]
        for step in self.path:
            sub = _DERIVE[step[0]](sub, *step[1:])
        return sub

    def out_avals(self, in_avals: Sequence[Any]) -> list[Any]:
        return self.resolve(self.template).out_avals(in_avals[1:])

    def effects(self, in_avals: Sequence[Any]) -> Any:
        return self.resolve(self.template).effects(in_avals[1:])

    def derived(self, step: tuple[Any, ...]) -> _Dispatch:
        with self._lock:
            got = self._derived.get(step)
            if got is None:
                name = _derived_name(self.name, step[0] if step[0] != "vmap"
                                     else f"vmap{list(step[1])}")
                got = self._derived[step] = _Dispatch(
                    self.template, self.call, name, self.path + (step,)
                )
            return got

    def __call__(self, handle: Any, *leaves: Any) -> list[Any]:
        f = _lookup(handle)
        sub = self.resolve(f)
        if f is not self.template:
            avals = _avals([jax.typeof(x) for x in leaves])
            want, got = self.resolve(self.template).out_avals(avals), sub.out_avals(avals)
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
