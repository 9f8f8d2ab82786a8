"""Ahead-of-time stages of a kiln function, as ``jax.stages``: ``f.lower(...)`` gives a
:class:`Lowered`, whose ``compile()`` loads the executable from the store or compiles and
stores it, giving a :class:`Compiled`.

These classes know nothing of kiln.jit's internals: ``_jit`` hands them the callables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Compiled", "Lowered"]


class Lowered:
    """A lowered kiln function (``jax.stages.Lowered``'s methods), not yet compiled.

    ``compile()`` uses the store: a warm process loads the executable (no XLA compile) and a
    cold one compiles and writes the entry, as a call would. ``compile(compiler_options=...)``
    or ``compile(device_assignment=...)`` is JAX's own compile of this lowering, not stored
    (kiln's key does not hold per-compile options).

    What describes the call as the user wrote it (``args_info``, ``in_avals``, ``in_tree``,
    ``out_info``, ``donate_argnums``, and any other attribute of ``jax.stages.Lowered``) is
    JAX's: the lowering ``jax.jit(fun, <same options>).lower(*args, **kwargs)`` gives, made
    on first use (a trace and a lowering, once per ``Lowered``).
    """

    def __init__(self, lower: Callable[[], jax.stages.Lowered],
                 compile: Callable[..., Compiled],
                 lower_as_jax: Callable[[], jax.stages.Lowered] | None = None) -> None:
        self._lower = lower  # kiln's lowered program (of the flat dynamic leaves)
        self._compile = compile
        self._lower_as_jax = lower_as_jax  # JAX's lowering of the same call, as written
        self._jax_lowered: jax.stages.Lowered | None = None

    def compile(self, compiler_options: dict[str, Any] | None = None, *,
                device_assignment: Any = None) -> Any:
        """The executable for these arguments, from the store or compiled (and stored).

        With ``compiler_options`` or ``device_assignment``: JAX's ``Lowered.compile`` of this
        lowering with them (not stored; JAX's errors for unknown options), as a
        :class:`Compiled` called as any other.
        """
        return self._compile(compiler_options, device_assignment)

    def _as_jax(self) -> jax.stages.Lowered:
        """JAX's lowering of the call as written; kiln's where JAX has none (filter_jit, static
        arrays by value)."""
        if self._jax_lowered is None:
            with contextlib.suppress(Exception):  # static arrays by value: jax.jit refuses
                if self._lower_as_jax is not None:
                    self._jax_lowered = self._lower_as_jax()
            if self._jax_lowered is None:
                self._jax_lowered = self._lower()
        return self._jax_lowered

    def as_text(self, dialect: str | None = None, **kwargs: Any) -> str:
        """The lowered module as text (StableHLO), as ``jax.stages.Lowered.as_text``."""
        lowered = self._lower()
        return lowered.as_text(dialect, **kwargs) if dialect else lowered.as_text(**kwargs)

    def compiler_ir(self, dialect: str | None = None) -> Any:
        return self._lower().compiler_ir(dialect) if dialect else self._lower().compiler_ir()

    def cost_analysis(self) -> Any:
        """XLA's cost estimate of the lowered module (flops, bytes accessed)."""
        return self._lower().cost_analysis()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_lower", "_compile", "_lower_as_jax",
                                              "_jax_lowered"):
            raise AttributeError(name)
        return getattr(self._as_jax(), name)

    def __repr__(self) -> str:
        return "<kiln Lowered>"


class Compiled:
    """A compiled kiln function for one signature (``jax.stages.Compiled``'s methods).

    Call it with the dynamic arguments only (``kiln.jit``: static arguments are part of the
    executable, as with ``jax.jit``'s AOT; ``kiln.filter_jit``: all arguments, as equinox).
    The call's description (``args_info``, ``in_avals``, ``in_tree``, ``out_info``,
    ``donate_argnums``) is its :class:`Lowered`'s; any other attribute of
    ``jax.stages.Compiled`` (``runtime_executable()``, ``input_shardings``, ...) is the
    executable's own (loaded from the store or compiled).

    Raises (on call):
        TypeError: arguments of another pytree structure, shape or dtype than those it was
            compiled for, with ``jax.stages.Compiled``'s messages.
    """

    _DESCRIBED = frozenset({"args_info", "in_avals", "in_tree", "out_info", "donate_argnums",
                            "donate_argnames"})

    def __init__(self, call: Callable[..., Any], check: Callable[[tuple[Any, ...],
                 dict[str, Any]], list[Any]], lower: Callable[[], jax.stages.Lowered],
                 lowered: Lowered | None = None) -> None:
        self._call = call  # the executable (a jax Compiled, or one wrapped by kiln)
        self._check = check
        self._lower = lower  # kiln's lowered program
        self._lowered = lowered

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*self._check(args, kwargs))

    def _jax_compiled(self) -> Any:
        return self._call if isinstance(self._call, jax.stages.Compiled) else None

    def as_text(self) -> str | None:
        """The optimized HLO text of the executable (``jax.stages.Compiled.as_text``)."""
        got = self._jax_compiled()
        return got.as_text() if got is not None else self._lower().compile().as_text()

    def cost_analysis(self) -> Any:
        """XLA's cost estimate of the executable (flops, bytes accessed)."""
        got = self._jax_compiled()
        with contextlib.suppress(Exception):  # a deserialized executable may not say
            if got is not None:
                return got.cost_analysis()
        return self._lower().cost_analysis()

    def memory_analysis(self) -> Any:
        got = self._jax_compiled()
        return got.memory_analysis() if got is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_call", "_check", "_lower", "_lowered"):
            raise AttributeError(name)
        if name in self._DESCRIBED and self._lowered is not None:
            return getattr(self._lowered, name)
        got = self._jax_compiled()
        if got is None:  # kiln's own wrapper (static outputs): the executable it wraps
            got = self._lower().compile()
        return getattr(got, name)

    def __repr__(self) -> str:
        return "<kiln Compiled>"


def pytree_mismatch(got: Any, want: Any) -> str:
    """``jax.stages.Compiled``'s message for arguments of another pytree structure."""
    from .._base import _jax_compat

    errs = _jax_compat.pytree_differences(got, want)
    msg = ["Function compiled with input pytree does not match the input pytree it was called "
           f"with. There are {len(errs)} mismatches, including:"]
    for path, thing1, thing2, explanation in errs:
        fst, *rest = path
        base = ["args", "kwargs"][fst.idx]
        msg.append(f"    * at {base}{jax.tree_util.keystr(tuple(rest))}, seen {thing2} but now "
                   f"given {thing1}, so {explanation}")
    return "\n".join(msg)


def type_mismatch(errors: list[str]) -> str:
    """``jax.stages.Compiled``'s message for arguments of other shapes or dtypes."""
    shown = "\n".join(errors[:5])
    which = f"The first 5 of {len(errors)}" if len(errors) >= 5 else "The"
    return ("Argument types differ from the types for which this computation was compiled. "
            "Perhaps you are calling the compiled executable with a different enable_x64 mode "
            f"than when it was AOT compiled? {which} mismatches are:\n{shown}")
