"""What the verbs share: how one fails, the store it works on, JAX started where it runs."""

from __future__ import annotations

from .. import stores
from .._base import _config
from ..stores import Checkable, Store

__all__ = ["Failure", "open_store", "start_jax"]


class Failure(Exception):
    """A verb failed: print ``error: <message>`` and exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def open_store() -> Store:
    """The configured store; a local one that kiln would refuse (not a directory, writable by
    others) is an error here (exit 1), as it is a warning in programs. A remote store URL
    (``redis://``, ``s3://``, ...) is the remote store itself, not layered behind the local
    one: ``kiln ls --store redis://...`` lists what the fleet shares."""
    store = stores.open_store(_config.get_config(), layered=False)
    if isinstance(store, Checkable):
        store.check()
    return store


def start_jax() -> None:
    """Where a verb runs JAX (``run``; ``export`` and ``import``, which read this machine's
    backend), it starts here: kiln as ``import kiln`` leaves a process (the kiln:// route;
    ``KILN_REPLACE_JIT=1``: the jax.jit swap), which the command line did not turn on so as to
    answer the other verbs without importing jax (``kiln_cli``). A no-op where kiln was
    imported as usual (:func:`kiln._cli.main` called in a program)."""
    from .._jit import at_import

    at_import()
