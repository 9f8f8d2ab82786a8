"""What the miss path is given: one call (:class:`Call`, made by ``kiln._jit``'s
``JitFunction._prepare``) and, for a miss of it, one record of everything the miss reads
(:class:`Request`, made once by ``kiln._jit._function.JitFunction``, which the miss path never
imports): the function's name, options and flat jax.jit, the call's static values resolved
once (:class:`Statics`), and where the function says it warned already (:class:`Once`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .._keys import STATIC_LEAF

__all__ = ["Call", "Once", "Options", "Request", "Statics"]


class Call(NamedTuple):
    """One call of a kiln function, split into its dynamic and static parts and keyed."""

    key: Any  # its in-process table key; None under a transformation (see JitFunction._prepare)
    leaves: list[Any]  # the array leaves the executable takes
    dyn_args: tuple[Any, ...]
    dyn_kwargs: dict[str, Any]
    statics: tuple[tuple[Any, Any], ...]  # (position or name, value) of the static arguments
    static_key: tuple[Any, ...]  # (key name, digest) of static arguments and static leaves
    treedef: Any  # of (dyn_args, dyn_kwargs)
    sigs: tuple[Any, ...]  # per leaf of (dyn_args, dyn_kwargs): kiln._keys._args.leaf_sig


class Statics(NamedTuple):
    """A call's static values, resolved once per miss (:meth:`of`).

    ``leaves``: kiln.filter_jit's leaves that are not arrays (keyed by value), by their index
    among all leaves of (dyn_args, dyn_kwargs). ``all``: the static arguments, then those
    leaves by ``("leaf", index)``.
    """

    leaves: dict[int, Any]
    all: tuple[tuple[Any, Any], ...]

    @classmethod
    def of(cls, call: Call) -> Statics:
        if STATIC_LEAF not in call.sigs:
            return cls({}, call.statics)
        all_leaves = call.treedef.flatten_up_to((call.dyn_args, call.dyn_kwargs))
        leaves = {i: x for i, (x, s) in enumerate(zip(all_leaves, call.sigs, strict=True))
                  if s is STATIC_LEAF}
        return cls(leaves, call.statics + tuple((("leaf", i), x) for i, x in leaves.items()))


class Options(Protocol):
    """What the miss path reads of a function's options (``kiln._jit._options.JitOptions``)."""

    @property
    def positional(self) -> list[str]: ...  # the names of the positional parameters

    @property
    def jax_options(self) -> dict[str, Any]: ...  # jax.jit's options that are set

    @property
    def in_shardings(self) -> Any: ...

    @property
    def out_shardings(self) -> Any: ...

    @property
    def filter_jit(self) -> bool: ...  # equinox's contract (kiln.filter_jit)

    @property
    def traced_fun(self) -> tuple[Any, ...]: ...  # (fun,): a hidden first argument, or ()


class Once:
    """A thing said once per kiln function (its owner keeps one): :meth:`first` is True the
    first time it is asked only."""

    def __init__(self) -> None:
        self.done = False

    def first(self) -> bool:
        first, self.done = not self.done, True
        return first


@dataclasses.dataclass(frozen=True)
class Request:
    """What one miss reads of the function it compiles and of the call, made once per miss.

    Attributes:
        call: the call that missed.
        statics: its static values, resolved once (the keys, the program and the flat jax.jit
            take them from here).
        fun: the user's function (its code and globals are fingerprinted and checked).
        name, module: its qualified name and module (``kiln ls``'s ``module.name``).
        options: its options record.
        uncompiled: the function of the array leaves as plain Python (``jax.disable_jit``).
        jitted: its flat jax.jit, which the miss traces, lowers and compiles.
        box: where that trace leaves kiln.filter_jit's non-array outputs.
        donated: the indices of the array leaves ``jitted`` donates.
        may_tier_up: False for kiln.noinline's own executables.
        same_program_alias: a fingerprint miss looks up the lowered module under the call's
            alias entry (the jax.jit swap's functions).
        not_stored: said once per function: its executable cannot be stored.
    """

    call: Call
    statics: Statics
    fun: Any
    name: str
    module: str
    options: Options
    uncompiled: Callable[..., Any]
    jitted: Any
    box: Any
    donated: tuple[int, ...]
    may_tier_up: bool
    same_program_alias: bool
    not_stored: Once

    @property
    def function(self) -> str:
        """``module.name``, as entry headers and explanations name the function."""
        return f"{self.module}.{self.name}"
