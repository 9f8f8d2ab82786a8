"""``kiln.jit`` and ``kiln.filter_jit``: the public constructors of :class:`JitFunction`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Unpack, overload

from ._function import JitFunction
from ._options import JAX_PASSED_ON, JitKeywords, check_keywords, jit_signature

__all__ = ["jit", "filter_jit"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def jit(fun: F, **options: Unpack[JitKeywords]) -> JitFunction: ...


@overload
def jit(fun: None = None, **options: Unpack[JitKeywords]) -> Callable[[F], JitFunction]: ...


def jit(fun: Callable[..., Any] | None = None, **options: Unpack[JitKeywords]) -> Any:
    """Compile ``fun`` with XLA like ``jax.jit``, and keep the executable in a store.

    A drop-in for :func:`jax.jit`: same results for pytrees in and out, keyword arguments,
    equinox Modules and dataclass pytrees. The first call with a given abstract signature
    (pytree structure; per leaf shape, dtype, weak_type; static argument values) compiles and
    writes an entry; any later process with the same store runs that executable without
    tracing, lowering or compiling (see the module docstring for programs with host
    callbacks). A stored executable is used only when nothing it was built from changed: the
    function's code and the code of user helpers it calls, module globals, closure values and
    defaults it reads, static argument values, argument avals and structure, jax config that
    changes tracing, compile options from jax's config and ``XLA_FLAGS`` as the backend read
    them at start, jax / jaxlib / library versions, backend and device kind.

    Arguments follow ``jax.jit``'s contract: dynamic arguments are pytrees of arrays and
    Python scalars (traced); any other leaf (a string, a function) raises jax's
    ``TypeError``, as ``jax.jit`` does. For equinox's contract (every leaf that is not an
    array static by value), use :func:`kiln.filter_jit`.

    Args:
        fun: the function to compile. Its dynamic arguments are pytrees of arrays.
        static_argnums: positions of static arguments. Unlike ``jax.jit``, numpy arrays, jax
            Arrays, numpy scalars and pytrees of them may be static: they are compared by value,
            bitwise (same shape, dtype and bytes; NaN equals itself; -0.0 differs from 0.0).
        static_argnames: names of static arguments (the same rules).
        donate_argnums: positions of arguments whose buffers the executable may reuse.
        donate_argnames: names of such arguments.
        keep_unused, device, backend, inline, compiler_options: as ``jax.jit`` (jax 0.10 to
            0.12): passed to every ``jax.jit`` kiln makes of ``fun``, and part of the key.
        in_shardings, out_shardings: as ``jax.jit``: ``in_shardings`` is a sharding, or a
            tuple with one pytree prefix of shardings per dynamic positional argument (static
            ones excluded; no dynamic keyword arguments then); ``out_shardings`` a prefix of
            the outputs. Part of the key (mesh shape, axis names, device ids, partition spec).

    Returns:
        A :class:`JitFunction` (or, with ``fun=None``, a decorator making one).

    Raises:
        StaticArgumentError: at call time, a static argument that cannot be hashed by value
            (an object array, a traced value, an unhashable object); the message names the
            argument and its pytree path.
        StoreError: with ``KILN_STRICT=1``, a store that cannot be read or written or an entry
            that is corrupt. Otherwise such problems are a :class:`StoreWarning` and a recompile.
        VerifyError: with ``KILN_VERIFY=1``, a stored entry that differs from a fresh lowering.

    Example:
        >>> import jax.numpy as jnp, kiln
        >>> @kiln.jit(static_argnames="n")
        ... def power(x, n):
        ...     return x**n
        >>> power(jnp.arange(3.0), n=2).tolist()
        [0.0, 1.0, 4.0]
    """

    check_keywords("jit", dict(options))

    def make(f: Callable[..., Any]) -> JitFunction:
        return JitFunction(f, **options)

    return make if fun is None else make(fun)


# help(kiln.jit) and inspect.signature(kiln.jit) show jax.jit's keywords, each with its default
jit.__signature__ = jit_signature(jit)  # type: ignore[attr-defined]


_FILTER_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")


def filter_jit(fun: Callable[..., Any] | None = None, *, donate: str = "none",
               **jitkwargs: Any) -> Any:
    """``equinox.filter_jit`` whose executables outlive the process.

    equinox's contract and signature: every JAX or numpy array leaf of the arguments is
    traced, every other leaf (Python ``int`` /
    ``float`` / ``bool``, functions, strings, an equinox Module's static fields) is static,
    compared by value (kiln's digests; a value with none is compared with ``==`` in this
    process only). Arguments are bound to ``fun``'s signature first, so ``f(x, y=1)`` and
    ``f(x, 1)`` are one program. Outputs that are not arrays are returned as they are,
    outside the executable. So an equinox user swaps ``eqx.filter_jit`` for
    ``kiln.filter_jit`` and nothing else changes; what is stored and when is as for
    :func:`kiln.jit`. When ``fun`` itself is a pytree holding arrays (a Module:
    ``filter_jit(model)``), it is split as equinox splits it: its arrays are traced (and
    donated with the arguments after the first), its other leaves static; a new Module of the
    same structure is the same program.

    Args:
        fun: the function to compile (``None``: a decorator).
        donate: ``"all"`` (donate every array, silence jax's unused-donation warnings),
            ``"all-except-first"`` (all but the first argument's arrays), ``"warn"`` /
            ``"warn-except-first"`` (the same, keeping the warnings), ``"none"`` (default).
        **jitkwargs: ``jax.jit``'s ``keep_unused``, ``device``, ``backend``, ``inline``,
            ``compiler_options``.

    Returns:
        A :class:`JitFunction` (or, with ``fun=None``, a decorator making one).

    Raises:
        ValueError: ``donate`` not one of the above; ``jitkwargs`` holding
            ``static_argnums``, ``static_argnames``, ``donate_argnums``, ``in_shardings`` or
            ``out_shardings`` (equinox's errors).

    Example:
        >>> import jax.numpy as jnp, kiln
        >>> @kiln.filter_jit
        ... def scale(x, factor, name):
        ...     return x * factor, name
        >>> out, name = scale(jnp.arange(3.0), 2, "double")
        >>> out.tolist(), name
        ([0.0, 2.0, 4.0], 'double')
    """
    if any(k in jitkwargs for k in ("static_argnums", "static_argnames", "donate_argnums",
                                   "in_shardings", "out_shardings")):
        raise ValueError(
            "`jitkwargs` cannot contain 'static_argnums', 'static_argnames', "
            "'donate_argnums', 'in_shardings', or 'out_shardings'."
        )
    if donate not in _FILTER_DONATE:
        raise ValueError(
            "`filter_jit(..., donate=...)` must be one of 'all', 'all-except-first', "
            "'warn', 'warn-except-first', or 'none'."
        )
    unknown = set(jitkwargs) - set(JAX_PASSED_ON)
    if unknown:
        raise TypeError(f"filter_jit() got unexpected keyword arguments {sorted(unknown)}")

    def make(f: Callable[..., Any]) -> JitFunction:
        return JitFunction(f, _filter=donate, **jitkwargs)

    return make if fun is None else make(fun)
