"""The options of a kiln function, made once from ``kiln.jit``'s (or ``kiln.filter_jit``'s)
arguments, as equinox's ``_JitWrapper`` holds its own: static and donated arguments resolved by
position and by name, filter_jit's donate mode as booleans, ``jax.jit``'s options as given."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import jax

from .._keys import _args, option_text

__all__ = ["JAX_PASSED_ON", "JIT_DEFAULTS", "JitKeywords", "JitOptions", "check_keywords",
           "jit_signature"]


class JitKeywords(TypedDict, total=False):
    """``jax.jit``'s keyword options, as ``kiln.jit`` takes them (jax 0.10 to 0.12: all of
    them), written once: ``kiln.jit`` and :class:`~kiln._jit._function.JitFunction` take
    ``**Unpack[JitKeywords]``, the jax.jit swap reads which options kiln takes from its keys,
    ``kiln.jit``'s signature is made from it (:func:`jit_signature`)."""

    static_argnums: int | Sequence[int] | None
    static_argnames: str | Sequence[str] | None
    donate_argnums: int | Sequence[int] | None
    donate_argnames: str | Sequence[str] | None
    keep_unused: bool
    device: Any
    backend: str | None
    inline: bool
    compiler_options: dict[str, Any] | None
    in_shardings: Any
    out_shardings: Any


#: :class:`JitKeywords`' defaults, ``jax.jit``'s
JIT_DEFAULTS: JitKeywords = {
    "static_argnums": None, "static_argnames": None, "donate_argnums": None,
    "donate_argnames": None, "keep_unused": False, "device": None, "backend": None,
    "inline": False, "compiler_options": None, "in_shardings": None, "out_shardings": None,
}

#: the options passed on as given to every ``jax.jit`` kiln makes of a function (and key parts)
JAX_PASSED_ON = ("keep_unused", "device", "backend", "inline", "compiler_options")


def check_keywords(where: str, options: dict[str, Any], allowed: Sequence[str] = ()) -> None:
    """Python's ``TypeError`` for a keyword ``where`` does not take (``allowed``: all of
    :class:`JitKeywords` when empty)."""
    unknown = sorted(set(options) - set(allowed or JIT_DEFAULTS))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")


def jit_signature(fun: Callable[..., Any]) -> inspect.Signature:
    """``fun``'s signature with its ``**options`` spelled out as :class:`JitKeywords`, each
    keyword-only with its default, for ``help()`` and ``inspect`` (as ``jax.jit`` shows)."""
    sig = inspect.signature(fun)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = JitKeywords.__annotations__
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v,
                                 annotation=getattr(hints[k], "__forward_arg__", hints[k]))
               for k, v in JIT_DEFAULTS.items()]
    return sig.replace(parameters=params)


def _both_ways(
    nums: tuple[int, ...], names: tuple[str, ...], nums_given: bool, names_given: bool,
    positional: list[str],
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Argument numbers and names, one inferred from the other where only that one was given
    (``jax.jit``'s ``api_util.infer_argnums_and_argnames``)."""
    if not nums_given:
        nums = tuple(positional.index(n) for n in names if n in positional)
    if not names_given:
        names = tuple(positional[i] for i in nums if 0 <= i < len(positional))
    return nums, names


def _holds_arrays(fun: Any) -> bool:
    """Whether ``fun`` is a pytree with array leaves (what ``equinox.filter_jit`` traces of
    its function: a Module's weights, a bound method of a Module, a ``jax.tree_util.Partial``
    over arrays). A plain function is a leaf of its own, and holds none."""
    try:
        leaves = jax.tree_util.tree_leaves(fun)
    except Exception:  # noqa: BLE001 - a flatten that fails: not a pytree of arrays
        return False
    return any(isinstance(x, _args.ARRAY_TYPES) for x in leaves)


@dataclasses.dataclass(frozen=True)
class JitOptions:
    """What a kiln function was made with.

    Attributes:
        static_argnums, static_argnames: the static arguments, both ways: like ``jax.jit``
            (``api_util.infer_argnums_and_argnames``), when only one of them is given the other
            is inferred, so a parameter is static whether passed by position or by name; when
            both are given, each is used as given. ``donate_argnums`` / ``donate_argnames``
            likewise.
        jax_options: ``jax.jit``'s ``keep_unused``, ``device``, ``backend``, ``inline``,
            ``compiler_options``, those set: passed on to every ``jax.jit`` kiln makes of the
            function (and key parts).
        in_shardings, out_shardings: ``jax.jit``'s (None: not given), applied by kiln per
            array leaf.
        positional: the names of the function's positional parameters (``"<function>"`` first
            where the function is a hidden first argument: ``traced_fun``).
        signature: the function's, or None where ``inspect`` cannot tell.
        filter_jit: ``kiln.filter_jit`` (equinox's contract) rather than ``kiln.jit``.
        donate_first, donate_rest: filter_jit donates the first argument's arrays, the others'.
        quiet_donation: filter_jit silences jax's warning about donated buffers it could not
            use (``donate="all"`` / ``"all-except-first"``), as equinox does.
        given: the arguments as given, to make the function again where it is unpickled.
        traced_fun: ``(fun,)`` when filter_jit traces the function's own arrays, else ``()``:
            ``fun`` is a pytree holding arrays (an equinox Module passed as the function,
            ``filter_jit(model)``), which equinox partitions as it does the arguments. Each
            call then passes it as a first, hidden argument: its arrays are traced (and donated
            with the rest of the arguments, as equinox does), its other leaves static.
    """

    static_argnums: frozenset[int]
    static_argnames: frozenset[str]
    donate_argnums: frozenset[int]
    donate_argnames: tuple[str, ...]
    jax_options: dict[str, Any]
    in_shardings: Any
    out_shardings: Any
    positional: list[str]
    signature: inspect.Signature | None
    filter_jit: bool
    donate_first: bool
    donate_rest: bool
    quiet_donation: bool
    given: dict[str, Any]
    traced_fun: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @classmethod
    def make(cls, fun: Callable[..., Any], given: dict[str, Any]) -> JitOptions:
        """The options of ``fun`` from ``given``: :class:`JitFunction`'s keyword arguments
        (``_filter``: filter_jit's donate mode; None for kiln.jit).

        Raises:
            TypeError, ValueError: ``jax.jit``'s errors for argument numbers and names that
                are not ints / strings, and an argname naming no parameter of ``fun`` (with
                its parameters and the closest one).
        """
        g = given
        nums = _args.normalize_argnums(g["static_argnums"], "static_argnums")
        names = _args.normalize_argnames(g["static_argnames"], "static_argnames")
        dnums = _args.normalize_argnums(g["donate_argnums"], "donate_argnums")
        dnames = _args.normalize_argnames(g["donate_argnames"], "donate_argnames")
        try:
            signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            signature = None
        params = list(signature.parameters.values()) if signature is not None else []
        positional = [
            p.name for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        _args.check_argnames(fun, params, [("static_argnames", n) for n in names]
                             + [("donate_argnames", n) for n in dnames])
        nums, names = _both_ways(nums, names, g["static_argnums"] is not None,
                                 g["static_argnames"] is not None, positional)
        dnums, dnames = _both_ways(dnums, dnames, g["donate_argnums"] is not None,
                                   g["donate_argnames"] is not None, positional)
        mode = g["_filter"]
        traced_fun = (fun,) if mode is not None and _holds_arrays(fun) else ()
        if traced_fun:
            positional = ["<function>", *positional]  # (its leaves' paths: "<function>.w")
        return cls(
            static_argnums=frozenset(nums),
            static_argnames=frozenset(names),
            donate_argnums=frozenset(dnums),
            donate_argnames=tuple(dnames),
            jax_options={k: g[k] for k in JAX_PASSED_ON if g[k]},
            in_shardings=g["in_shardings"],
            out_shardings=g["out_shardings"],
            positional=positional,
            signature=signature,
            filter_jit=mode is not None,
            donate_first=mode in ("all", "warn"),
            donate_rest=mode in ("all", "warn", "all-except-first", "warn-except-first"),
            quiet_donation=mode in ("all", "all-except-first"),
            given=given,
            traced_fun=traced_fun,
        )

    @property
    def has_statics(self) -> bool:
        return bool(self.static_argnums or self.static_argnames)

    def identity(self) -> tuple[Any, ...]:
        """What two kiln functions of one function object must share to share their
        executables in this process (``kiln._jit._function._shared_state``)."""
        return (self.static_argnums, self.static_argnames, self.donate_argnums,
                self.donate_argnames, repr(sorted(self.jax_options.items())),
                (self.filter_jit, self.donate_first, self.donate_rest, self.quiet_donation),
                option_text(self.in_shardings), option_text(self.out_shardings))

    def jax_jit(self, fun: Callable[..., Any]) -> Any:
        """The plain ``jax.jit`` of ``fun`` with these options as given: jax's checks and
        errors at decoration (out-of-range argnums, positional-only static_argnames, static
        and donated at once, generator functions, staticmethod objects, non-callables), and
        later jax's errors, with jax's text and argument paths, for arguments kiln.jit does
        not take (a string, a function)."""
        g = self.given
        shardings = {k: g[k] for k in ("in_shardings", "out_shardings") if g[k] is not None}
        return jax.jit(fun, static_argnums=g["static_argnums"],
                       static_argnames=g["static_argnames"],
                       donate_argnums=g["donate_argnums"], donate_argnames=g["donate_argnames"],
                       **shardings, **self.jax_options)
