"""The ``kiln_noinline`` primitive: a call of a separately compiled function, with its abstract
evaluation, lowering (a host callback into the callee's executable, or the callee inlined while
tiering up), jvp / transpose / batching rules (each a derived function, compiled once), and the
jaxpr walks the miss path needs (``calls_in``, ``inlined_size``, ``separate_size``,
``called_names``).

The ``fn`` of a call is a callee: a :class:`_Sub` (one flat function with its own kiln.jit
executable) or ``kiln._jit._noinline._ArgumentCallee`` (a function chosen at run time). The
rules ask it through one protocol (``out_avals``, ``effects``, ``tier_up``, ``called_name``,
``bind_jvp``, ``bind_transpose``, ``bind_batched``), never by its type.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.interpreters import ad, batching, mlir

from .._base import KilnError, _jax_compat, _stats, set_in_thread
from .._keys import Unpersistable, fingerprint

__all__ = ["noinline_p", "inlining", "inlined_size", "called_names", "separate_size",
           "calls_in"]

noinline_p = _jax_compat.Primitive("kiln_noinline")
noinline_p.multiple_results = True


class _Sub:
    """One flat function ``(*leaves) -> list of leaves`` with its own kiln.jit executable."""

    def __init__(
        self, flat_fun: Callable[..., list[Any]], name: str, module: str,
        make_jit: Callable[[Callable[..., Any]], Any], *, tier_up: bool = True
    ) -> None:
        self.flat_fun = flat_fun
        # kiln.jit of a function that never tiers up itself (its callers do), handed down by
        # kiln._jit._noinline (a layer above)
        self.make_jit = make_jit
        self.name = name
        self.module = module
        self.tier_up = tier_up
        # named after the user's function, so `kiln ls` shows e.g. model.vf[noinline jvp]
        flat_fun.__name__ = flat_fun.__qualname__ = name  # type: ignore[attr-defined]
        flat_fun.__module__ = module
        self.jit = make_jit(flat_fun)
        self._jaxprs: dict[tuple[Any, ...], Any] = {}
        self._inline_fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._sizes: dict[tuple[Any, ...], int] = {}
        self._derived: dict[Any, _Sub] = {}
        self._lock = threading.Lock()

    def jaxpr(self, in_avals: Sequence[Any]) -> Any:
        """The closed jaxpr of this function at ``in_avals`` (traced once per signature)."""
        key = tuple(in_avals)
        if key not in self._jaxprs:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
            self._jaxprs[key] = jax.make_jaxpr(self.flat_fun)(*structs)
        return self._jaxprs[key]

    def outavals_of(self, in_avals: Sequence[Any]) -> list[Any]:
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
        if key not in self._inline_fns:
            run = _jax_compat.jaxpr_as_fun(self.jaxpr(in_avals))

            def inlined(*xs: Any) -> Any:
                return run(*xs)

            inlined.__name__ = inlined.__qualname__ = self.name.replace("[noinline", "[inlined")
            self._inline_fns[key] = jax.jit(inlined)
        return self._inline_fns[key]

    def inlined_size(self, in_avals: Sequence[Any]) -> int:
        """Equations in this function once every tier-up noinline call in it is inlined."""
        key = tuple(in_avals)
        if key not in self._sizes:
            self._sizes[key] = inlined_size(self.jaxpr(in_avals).jaxpr)
        return self._sizes[key]

    def derived(self, key: Any, what: str, flat_fun: Callable[..., Any]) -> _Sub:
        """The function derived from this one as ``key`` says (``what``: its name's suffix),
        made of ``flat_fun`` the first time."""
        with self._lock:
            sub = self._derived.get(key)
            if sub is None:
                sub = self._derived[key] = _Sub(flat_fun, derived_name(self.name, what),
                                                self.module, self.make_jit, tier_up=self.tier_up)
            return sub

    def __call__(self, *leaves: Any) -> list[Any]:
        return list(self.jit(*leaves))

    # -- the callee protocol: what the primitive's rules ask of the ``fn`` of a call --------
    def called_name(self) -> str:
        """``module.name``, as its entries are named in the store (for ``kiln ls``)."""
        return f"{self.module}.{self.name}"

    def bind_jvp(self, primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        return noinline_p.bind(*primals, *tangents, fn=_jvp_sub(self, len(primals)))

    def bind_transpose(self, cts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        linear, known, lin_shapes = split_linear(args)
        ct_lin = iter(noinline_p.bind(*known, *cts, fn=_transpose_sub(self, linear, lin_shapes)))
        return [next(ct_lin) if lin else None for lin in linear]

    def bind_batched(self, args: Sequence[Any], axes: tuple[int | None, ...]) -> Any:
        return noinline_p.bind(*args, fn=_vmap_sub(self, axes))

    def __kiln_digest__(self) -> str:
        """What this function computes, for the keys of functions derived from it."""
        fp = fingerprint(self.flat_fun)
        if not fp.sound:
            raise Unpersistable(f"noinline function {self.name}: {fp.reason}")
        return f"{self.name}:{fp.digest}"


def derived_name(name: str, what: str) -> str:
    """``vf[noinline]`` -> ``vf[noinline jvp]`` -> ``vf[noinline jvp transpose]``."""
    return f"{name[:-1]} {what}]"


# -- primitive rules ---------------------------------------------------------------------------
def _impl(*args: Any, fn: _Sub) -> list[Any]:
    return fn(*args)


def _abstract_eval(*avals: Any, fn: Any) -> tuple[list[Any], Any]:
    in_avals = avals_of(avals)
    outs = fn.outavals_of(in_avals)
    # inside a shard_map body the operands vary over manual mesh axes: so do the results (as
    # for any primitive of them; jax's check_vma refuses an output that drops them)
    vma = _jax_compat.union_vma(avals)
    if vma:
        outs = [_jax_compat.with_vma(o, vma, avals) for o in outs]
    return outs, fn.effects(in_avals)


def avals_of(avals: Sequence[Any]) -> list[Any]:
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]


def _lowering(ctx: Any, *args: Any, fn: _Sub) -> Any:
    if fn.tier_up and getattr(_inlining, "on", False) and not _jax_compat.union_vma(ctx.avals_in):
        # tier-up (kiln._miss._tier_up): the sub-function's own jaxpr, as a nested jax.jit would be
        # (not inside a shard_map body: its jaxpr, traced outside, has no varying mesh axes,
        # so there the call stays a call of the separately compiled function)
        inline = fn.inline_fn(avals_of(ctx.avals_in))
        return mlir.lower_fun(inline, multiple_results=True)(ctx, *args)

    # ``mlir.emit_python_callback`` (what equinox's noinline uses) rather than
    # ``jax.pure_callback``: measured here, 295 us vs 109 us per call of a tiny sub-function,
    # since pure_callback adds its own argument conversion and device context per call
    def host(*xs: Any) -> list[np.ndarray]:
        _stats.bump(noinline_calls=1)
        return [np.asarray(o) for o in fn(*xs)]

    effects = fn.effects(avals_of(ctx.avals_in))
    result, _, keepalive = mlir.emit_python_callback(
        ctx, host, None, list(args), ctx.avals_in, ctx.avals_out,
        has_side_effect=bool(effects), sharding=None,
    )
    ctx.module_context.add_keepalive(keepalive)
    return result


# -- tier-up support ----------------------------------------------------------------------------
_inlining = threading.local()


def inlining() -> contextlib.AbstractContextManager[None]:
    """Lower ``kiln_noinline`` calls (of functions with ``tier_up=True``) inline, in this
    thread, for the duration of the block."""
    return set_in_thread(_inlining, "on", True, unset=False)


def inlined_size(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` once its tier-up noinline calls are inlined, counting each call
    site (XLA inlines every call): a recursive ``fib(t)`` grows exponentially with ``t``."""
    total = 0
    for eqn in _jax_compat.eqns_in(jaxpr):
        fn = eqn.params.get("fn") if eqn.primitive is noinline_p else None
        if fn is not None and fn.tier_up:
            total += fn.inlined_size(avals_of([v.aval for v in eqn.invars]))
        else:
            total += 1
    return total


def called_names(jaxpr: Any) -> list[str]:
    """``module.name`` of every noinline function ``jaxpr`` calls directly (as their entries
    are named in the store; ``(argument)`` for functions passed as arguments), for ``kiln ls``."""
    return sorted({eqn.params["fn"].called_name() for eqn in _jax_compat.eqns_in(jaxpr)
                   if eqn.primitive is noinline_p and eqn.params.get("fn") is not None})


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
            avals = tuple(avals_of([v.aval for v in eqn.invars]))
            if (id(fn), avals) not in out:
                closed = fn.jaxpr(avals)
                out[(id(fn), avals)] = (fn, closed)
                stack.append(closed.jaxpr)
    return list(out.values())


def _jvp_sub(fn: _Sub, n: int) -> _Sub:
    """The tangent part of ``fn`` (``n`` primals): ``(*primals, *tangents) -> tangents_out``."""

    def tangent_part(*pt: Any) -> list[Any]:
        _, t_out = jax.jvp(fn.flat_fun, tuple(pt[:n]), tuple(pt[n:]))
        return list(t_out)

    return fn.derived("jvp", "jvp", tangent_part)


def _transpose_sub(fn: _Sub, linear: tuple[bool, ...], lin_shapes: tuple[Any, ...]) -> _Sub:
    """The transpose of ``fn`` in its ``linear`` arguments: ``(*known, *cts) -> cts_linear``."""
    n_known = len(linear) - len(lin_shapes)

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

    return fn.derived(("transpose", linear, lin_shapes), "transpose", transposed)


def _vmap_sub(fn: _Sub, axes: tuple[int | None, ...]) -> _Sub:
    """``fn`` batched along axis 0 of the arguments whose ``axes`` entry is 0."""

    def batched(*xs: Any) -> Any:
        return jax.vmap(fn.flat_fun, in_axes=axes)(*xs)

    return fn.derived(("vmap", axes), f"vmap{list(axes)}", batched)


DERIVE: dict[str, Callable[..., _Sub]] = {
    "jvp": _jvp_sub, "transpose": _transpose_sub, "vmap": _vmap_sub,
}


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, fn: Any) -> Any:
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    # primal and tangent outputs are separate binds, so reverse mode can linearize (the tangent
    # bind is linear in the tangents and gets transposed below)
    primal_out = noinline_p.bind(*primals, fn=fn)
    return primal_out, fn.bind_jvp(primals, tangents)


def split_linear(args: Sequence[Any]) -> tuple[tuple[bool, ...], list[Any], tuple[Any, ...]]:
    linear = tuple(ad.is_undefined_primal(a) for a in args)
    known = [a for a, lin in zip(args, linear, strict=True) if not lin]
    lin_shapes = tuple(
        (tuple(a.aval.shape), str(a.aval.dtype))
        for a, lin in zip(args, linear, strict=True) if lin
    )
    return linear, known, lin_shapes


def _transpose(cts: Sequence[Any], *args: Any, fn: Any) -> list[Any]:
    cts = [ad.instantiate_zeros(c) for c in cts]
    return fn.bind_transpose(cts, args)  # type: ignore[no-any-return]


def _batch(args: Sequence[Any], dims: Sequence[Any], *, fn: Any) -> Any:
    args = [a if d is None else jax.numpy.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)]
    axes = tuple(None if d is None else 0 for d in dims)  # None: not batched
    outs = fn.bind_batched(args, axes)
    return outs, [0] * len(outs)


noinline_p.def_impl(_impl)
noinline_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(noinline_p, _lowering)
ad.primitive_jvps[noinline_p] = _jvp
ad.primitive_transposes[noinline_p] = _transpose
batching.primitive_batchers[noinline_p] = _batch
