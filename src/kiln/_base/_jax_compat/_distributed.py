"""Multi-host: which processes write JAX's cache and kiln's compiles in a distributed job.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ['write_from_every_process']


class _ProcessZero:
    """``jax._src.distributed.global_state`` as ``compiler._cache_write`` sees it while
    :func:`write_from_every_process` lets this thread write: process 0. Every other attribute,
    and ``process_id`` in every other thread, is the real state's."""

    def __getattr__(self, name: str) -> Any:
        from jax._src import distributed

        if name == "process_id" and getattr(_writing, "on", False):
            return 0
        return getattr(distributed.global_state, name)


class _DistributedSeenByCompiler(types.ModuleType):
    """``jax._src.distributed`` as ``jax._src.compiler`` sees it (its module global
    ``distributed``): the same module, with :class:`_ProcessZero` as ``global_state``."""

    def __getattr__(self, name: str) -> Any:
        from jax._src import distributed

        if name == "global_state":
            return _ProcessZero()
        return getattr(distributed, name)


_writing = threading.local()
_every_process: Callable[[], bool] | None = None


def write_from_every_process(when: Callable[[], bool]) -> bool:
    """Let every process of a ``jax.distributed`` job write JAX's persistent cache while
    ``when()`` is true (kiln's route is on).

    JAX writes its cache from process 0 only ("Not writing persistent cache entry since
    process_id != 0", ``jax._src.compiler._cache_write``, jax 0.10 to 0.12), against write
    contention on file systems such as GCS. A program only process 1 compiles (its eager work
    on its own devices: a key of its own) is then compiled by process 1 in every run, and
    process 0 waits for it at the job's first collective. kiln's store takes
    concurrent writes of one key (atomic rename; a remote store's put keeps what it holds),
    so under the route each process writes what it compiled. JAX's other checks (host
    callbacks, the minimum compile time) are JAX's own. Returns whether it is installed (False
    when jax's private names moved: JAX's behaviour stays).
    """
    global _every_process
    from jax._src import compiler

    if _every_process is not None:
        _every_process = when
        return True
    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(compiler, "distributed", None) is None:
        return False

    def _cache_write(*args: Any, **kwargs: Any) -> Any:
        _writing.on = _every_process is not None and _every_process()
        try:
            return original(*args, **kwargs)
        finally:
            _writing.on = False

    _every_process = when
    compiler.distributed = _DistributedSeenByCompiler("jax._src.distributed")
    compiler._cache_write = _cache_write
    return True


def coordinator_address() -> str | None:
    """The coordinator's address of this process's ``jax.distributed`` job (``host:port``),
    or None outside one (``jax._src.distributed.global_state``, jax 0.4+)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - (jax without the distributed runtime)
        return None
    address = getattr(distributed.global_state, "coordinator_address", None)
    return address if isinstance(address, str) and address else None
