"""Run a function right after a module is first imported, by whoever imports it (a post-import
hook, as ``wrapt.register_post_import_hook`` does), so that ``kiln run`` imports jax when the
program does and not before: JAX reads ``JAX_ENABLE_X64``, ``JAX_DEBUG_NANS`` and the rest of
its settings from the environment when it is imported, and a program may set them first.

A finder placed first on ``sys.meta_path`` answers for the module's name only: it asks the
finders after it for the module's spec and hands the import system the same spec with a loader
that, once the module's own code has run, puts the real loader back in the module and calls
the function. Standard library only."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]


class _Then(importlib.abc.Loader):
    """The loader of one import of the watched module: the real ``loader``'s, then ``then``."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module sees its own loader, as without the hook (importlib.resources reads it)
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.then()


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` until ``name`` is imported: see :func:`after_import`."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then
        self._asking = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._asking, "on", False):
            return None
        self._asking.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._asking.on = False
        remove(self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # (not found, a namespace package: nothing to run after)
        spec.loader = _Then(spec.loader, self.then)
        return spec


def remove(finder: Any) -> None:
    """Take ``finder`` (an :func:`after_import` handle) off ``sys.meta_path``, if it is there."""
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def after_import(name: str, then: Callable[[], None]) -> Any:
    """Call ``then()`` right after top-level module ``name`` is first imported (in the thread
    that imports it, before the ``import`` statement returns), or now where it already is. A
    handle for :func:`remove` when ``then`` has not run yet, else None.

    ``then`` runs with the module complete in ``sys.modules``; what it raises propagates out of
    the import that ran it (callers catch their own errors)."""
    if name in sys.modules:
        then()
        return None
    finder = _Finder(name, then)
    sys.meta_path.insert(0, finder)
    return finder
