"""JAX's modules as the program may patch them (``monkeypatch.setattr(lax, "sin", ...)``,
``jax._src.lax.lax.sin = ...``): JAX's eager work is keyed by JAX's installed files
(:mod:`kiln._travel._eager`), and once the program changed JAX's code that key no longer names
it.

:func:`snapshot_jax_modules` copies the namespace of every loaded ``jax`` / ``jaxlib`` module
when eager work is turned on (~1 ms: 290 modules, 18,000 names); :func:`patched_reads` then
compares, for one function, the names its code reads (its module's globals, and the attributes
of the JAX modules among them that its code names: ``lax.sin`` in ``jnp.sinc``) with that copy,
at the first call of each signature only. A module is not made a subclass that records its
writes: every attribute read of a module subclass is ~5x slower (Python 3.11 specializes
module attribute reads for the exact type only), ~20% more per eager call. What this does not
see: a name read by a function the called one calls (not named in its own code), and a module
patched before it was first loaded under eager work.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import sys
import types
from typing import Any

from ._values import _code_names

__all__ = ["patched_reads", "snapshot_jax_modules"]

_snapshot: dict[str, dict[str, Any]] = {}
_seen = [0]  # len(sys.modules) at the last snapshot
_reads: dict[types.CodeType, tuple[tuple[str, str], ...]] = {}  # code -> (module, name) read


def _is_jax(name: str) -> bool:
    return name == "jax" or name.startswith(("jax.", "jaxlib."))


def snapshot_jax_modules() -> None:
    """Copy the namespace of every loaded jax module not copied yet (those loaded since the
    last call too; ~50 ns when nothing was imported since)."""
    if len(sys.modules) == _seen[0]:
        return
    _seen[0] = len(sys.modules)
    for name, mod in list(sys.modules.items()):
        if name not in _snapshot and _is_jax(name) and isinstance(mod, types.ModuleType):
            _snapshot[name] = dict(mod.__dict__)


def _reads_of(fun: types.FunctionType) -> tuple[tuple[str, str], ...]:
    """(module, name) of what ``fun``'s code reads from JAX's modules by name."""
    code = fun.__code__
    got = _reads.get(code)
    if got is None:
        names = _code_names(code)
        home = fun.__globals__.get("__name__", "")
        pairs = {(home, n) for n in names if n in fun.__globals__}
        for n in names:
            value = fun.__globals__.get(n)
            if isinstance(value, types.ModuleType) and _is_jax(value.__name__):
                pairs |= {(value.__name__, a) for a in names if a in value.__dict__}
        got = _reads[code] = tuple(sorted(pairs))
    return got


def patched_reads(fun: types.FunctionType) -> str | None:
    """The first ``module.name`` ``fun``'s code reads from a JAX module that differs from the
    module's namespace when it was copied (:func:`snapshot_jax_modules`), or None."""
    for module, name in _reads_of(fun):
        before = _snapshot.get(module)
        mod = sys.modules.get(module)
        if before is None or mod is None:
            continue
        if mod.__dict__.get(name, _MISSING) is not before.get(name, _MISSING):
            return f"{module}.{name}"
    return None


_MISSING = object()
