"""What the miss path is given: one call (:class:`Call`, made by ``kiln._jit``'s
``JitFunction._prepare`` and passed whole) and the function it calls (:class:`KilnFunction`,
what the miss path reads of ``kiln._jit._function.JitFunction``, which it never imports).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .._keys import STATIC_LEAF

__all__ = ["Call", "KilnFunction", "Options"]


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

    def static_leaves(self) -> dict[int, Any]:
        """kiln.filter_jit's leaves that are not arrays (keyed by value), by their index among
        all leaves of (dyn_args, dyn_kwargs)."""
        if STATIC_LEAF not in self.sigs:
            return {}
        all_leaves = self.treedef.flatten_up_to((self.dyn_args, self.dyn_kwargs))
        return {i: x for i, (x, s) in enumerate(zip(all_leaves, self.sigs, strict=True))
                if s is STATIC_LEAF}

    def all_statics(self, static_leaves: dict[int, Any]) -> tuple[tuple[Any, Any], ...]:
        """The static arguments, then the static leaves (``static_leaves()``) by
        ``("leaf", index)``."""
        return self.statics + tuple((("leaf", i), x) for i, x in static_leaves.items())


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


class KilnFunction(Protocol):
    """What the miss path reads of the function it compiles
    (``kiln._jit._function.JitFunction``)."""

    _fun: Any
    _name: str
    _module: str
    _may_tier_up: bool  # False for kiln.noinline's own executables
    _same_program_alias: bool  # a fingerprint miss looks up the lowered module (the jax.jit swap)

    @property
    def _options(self) -> Options: ...

    def _flat_jitted(self, call: Call) -> tuple[Callable[..., Any], Any, Any]: ...

    def _donated_leaves(self, call: Call) -> tuple[int, ...]: ...
