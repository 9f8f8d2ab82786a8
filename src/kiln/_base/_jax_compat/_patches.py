"""JAX's modules as the program may patch them: every loaded ``jax`` / ``jaxlib`` module made a
:class:`_WatchedModule`, which records an attribute set or deleted from outside JAX and kiln
(``monkeypatch.setattr(jnp, "sin", ...)``, ``jax._src.lax.lax.sin = ...``). JAX's eager work is
keyed by JAX's installed files (:mod:`kiln._travel._eager`): once the program changed JAX's
code, that key no longer names it.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import copyreg
import importlib
import sys
import types
from typing import Any

__all__ = ["jax_patches", "watch_jax_modules"]

_patches: list[str] = []  # "module.name" of every attribute of a jax module set from outside
_watched: set[str] = set()
_seen = [0]  # len(sys.modules) at the last scan
_EXEMPT_CALLERS = ("jax", "jaxlib", "kiln", "kiln_early", "kiln_pytest", "importlib")


def _outside(caller: str) -> bool:
    return not any(caller == p or caller.startswith(p + ".") for p in _EXEMPT_CALLERS)


class _WatchedModule(types.ModuleType):
    """A jax module whose attributes set or deleted from outside JAX and kiln are recorded
    (``monkeypatch.setattr(jnp, "sin", ...)``): JAX's code then no longer is what its
    distribution holds."""

    def __setattr__(self, name: str, value: Any) -> None:
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        if _outside(caller) and not isinstance(value, types.ModuleType):
            _patches.append(f"{self.__name__}.{name}")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if _outside(str(sys._getframe(1).f_globals.get("__name__", ""))):
            _patches.append(f"{self.__name__}.{name}")
        super().__delattr__(name)


def _reduce(module: _WatchedModule) -> tuple[Any, tuple[str]]:
    return importlib.import_module, (module.__name__,)


# pickled by reference, as cloudpickle pickles a plain module (its dispatch table is by exact
# type: without this a host callback naming jax.numpy could no longer be stored)
copyreg.pickle(_WatchedModule, _reduce)


def watch_jax_modules() -> None:
    """Watch every loaded ``jax`` / ``jaxlib`` module (those loaded since the last call too)
    for attributes set from outside (:func:`jax_patches`)."""
    if len(sys.modules) == _seen[0]:
        return  # (nothing imported since the last call: the usual case, ~50 ns)
    _seen[0] = len(sys.modules)
    for name, mod in list(sys.modules.items()):
        if name in _watched or not (name == "jax" or name.startswith(("jax.", "jaxlib."))):
            continue
        _watched.add(name)
        if type(mod) is types.ModuleType:
            try:
                mod.__class__ = _WatchedModule
            except TypeError:  # pragma: no cover - a module that refuses
                pass


def jax_patches() -> list[str]:
    """The attributes of jax modules the program set from outside since they were watched."""
    return list(_patches)
