"""jax's trace context and config as a trace sees them: the context token and its text, local
config, the default device, whether jit is off, whether a value is a tracer, the API boundary.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import jax

from ._private import _core, _jax_config, _source_info_util, _traceback_util

__all__ = [
    "trace_context_token",
    "trace_context",
    "local_config",
    "apply_local_config",
    "sharding_text",
    "default_device_text",
    "jit_disabled",
    "at_top_level",
    "is_tracer",
    "api_boundary",
]


_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def trace_context_token() -> Any:
    """A hashable token of jax's trace context (for in-process cache keys; ~0.4 us)."""
    return _jax_config.trace_context()


def trace_context() -> list[tuple[str, str]]:
    """(name, repr) of every jax config value that changes tracing, addresses stripped."""
    values = _jax_config.trace_context()
    names = _jax_config.trace_context_names()
    return [(n, _context_text(v)) for n, v in zip(names, values, strict=True)]


def _context_text(v: Any) -> str:
    """Canonical text of one trace-context value: its repr, except for objects whose repr is
    only an address (``jax._src.core.AxisEnv``: the axis names and sizes of enclosing
    ``vmap`` / ``shard_map`` / ``pmap``, which ``jax.lax.axis_size`` reads), spelled out by
    their slots or attributes, sets sorted (no order from the hash seed)."""
    text = repr(v)
    if " object at 0x" not in text:
        return _ADDR.sub("", text)
    fields = [f for f in getattr(type(v), "__slots__", ()) if f != "__weakref__"] or sorted(
        getattr(v, "__dict__", {}))
    parts = []
    for f in fields:
        item = getattr(v, f, None)
        if isinstance(item, set | frozenset):
            item = sorted(map(repr, item))
        elif item is not None and hasattr(item, "items"):
            item = sorted((repr(k), repr(x)) for k, x in item.items())
        parts.append(f"{f}={_ADDR.sub('', repr(item))}")
    return f"{type(v).__module__}.{type(v).__qualname__}({', '.join(parts)})"


def local_config() -> list[tuple[Any, Any]]:
    """This thread's jax config overrides (``jax.enable_x64(True)`` blocks, ``default_device``,
    ...): config states are thread-local, so work done for this thread in another thread (a
    tier-up) must apply them there (:func:`apply_local_config`)."""
    unset = _jax_config.config_ext.unset
    return [(state, value) for state in _jax_config.config_states.values()
            if (value := state.get_local()) is not unset]


@contextlib.contextmanager
def apply_local_config(items: list[tuple[Any, Any]]) -> Iterator[None]:
    """Enter the thread-local config overrides ``items`` in this thread (as ``State(value)``
    context managers do, jax 0.10.2 ``config.StateContextManager``)."""
    unset = _jax_config.config_ext.unset
    previous = []
    try:
        for state, value in items:
            previous.append((state, state.swap_local(value)))
            if state._update_thread_local_hook:
                state._update_thread_local_hook(value)
        yield
    finally:
        for state, prev in reversed(previous):
            state.set_local(prev)
            if state._update_thread_local_hook:
                state._update_thread_local_hook(None if prev is unset else prev)


def sharding_text(sharding: Any) -> str:
    """A canonical description of a sharding for keys: its repr without memory addresses,
    plus the device ids it spans."""
    ids = sorted(d.id for d in sharding.device_set)
    return f"{_ADDR.sub('', repr(sharding))}{ids}"


def default_device_text() -> str:
    """The device a program with no committed argument runs on in this process: the
    ``jax_default_device`` setting, else this process's first local device (its id is global:
    another process of a ``jax.distributed`` job has another one)."""
    d = jax.config.jax_default_device or jax.local_devices()[0]  # type: ignore[attr-defined]
    if isinstance(d, str):  # a platform name ("cpu")
        d = jax.local_devices(backend=d)[0]
    return f"{d.platform}:{d.id}"


def jit_disabled() -> bool:
    """``jax.disable_jit()`` is in force (``jax_disable_jit`` config)."""
    return bool(_jax_config.disable_jit.value)


def at_top_level() -> bool:
    """Whether no transformation or trace is running in this thread (jax's current trace is
    the eval trace). ``jax._src.core.trace_ctx.is_top_level()``, jax 0.4.36 to 0.10.2. Under
    ``jax.jvp`` / ``vmap`` / an outer ``jit`` a function can close over a tracer while its
    arguments are plain values, so the arguments alone cannot tell."""
    return bool(_core.trace_ctx.is_top_level())


def is_tracer(x: Any) -> bool:
    """True for a JAX tracer (abstract value under a transformation)."""
    return isinstance(x, jax.core.Tracer)


# kiln's files count as JAX's (``_private``: traceback_util, source_info_util): an error while
# tracing a kiln.jit function shows the frames a jax.jit one shows
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep

_traceback_util.register_exclusion(_KILN_DIR)
_source_info_util.register_exclusion(_KILN_DIR)

# ``api_boundary(fun)``: an error raised below ``fun`` has jax's and kiln's frames removed from
# its traceback, as an error raised in a jax.jit call has
api_boundary = _traceback_util.api_boundary
