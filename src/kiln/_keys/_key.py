"""Persistent keys: sha256 over an ordered list of NAMED parts.

Parts (each logged at DEBUG with its own short hash, so two keys can be diffed):

- ``format``: the entry format version; ``kiln``, ``jax``, ``jaxlib``: versions;
- ``backend``: platform, platform version, device kind and device count (global: every
  process of a ``jax.distributed`` job); ``processes``: the job's process count and devices per
  process (never the process index, so a job's processes share entries); ``machine``: what the
  executable needs from the machine (on CPU the architecture and instruction-set features, on
  GPU the compute capability: :mod:`kiln._keys._machine`);
- ``config:<name>``: every jax config value that changes tracing (jax's own trace context: x64,
  default matmul precision, dtype promotion, ...); ``env:XLA_FLAGS``, ``env:LIBTPU_INIT_ARGS``;
- ``function``: module + qualname; ``fingerprint``: the static-walk digest
  (:mod:`kiln._keys._fingerprint`), or ``lowered``: the digest of the lowered module on the verify
  path;
- ``signature``: pytree structure, and per leaf shape, dtype, weak_type (and sharding when not
  the default single device); ``static:<name>``: the digest of each static argument.

Keys never depend on where the store lives (JAX's own cache key does, through an autotune-cache
path in the compile options, so a moved cache never hits).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import jax
import jaxlib

from .._base import _jax_compat
from ..stores._entry import FORMAT_VERSION, short_key
from ._machine import machine_part

__all__ = ["environment_parts", "machine", "make_key"]

logger = logging.getLogger("kiln")

_EXTRA_CONFIG = (
    "jax_default_prng_impl",
    "jax_enable_custom_prng",
    "jax_legacy_prng_key",
    "jax_default_dtype_bits",
    "jax_dynamic_shapes",
    "jax_enable_checks",
    "jax_debug_nans",
    "jax_debug_infs",
)


@functools.lru_cache(maxsize=1)
def _static_environment() -> tuple[tuple[str, str], ...]:
    from .._base._version import __version__

    devices = jax.devices()
    d0 = devices[0]
    backend = d0.client
    return (
        ("format", str(FORMAT_VERSION)),
        ("kiln", __version__),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("backend", f"{backend.platform} {backend.platform_version}"),
        ("device", f"{d0.device_kind} x{len(devices)}"),
        # a multi-process job's topology (jax.distributed): the same in every process of the
        # job, never the process index, so the job's processes share one entry
        ("processes", f"{jax.process_count()} x{jax.local_device_count()}"),
        # a fleet mixes machine kinds: an entry is only loaded on the kind it was compiled for
        ("machine", machine_part(d0)),
    )


def machine() -> str:
    """This process's ``machine`` key part (its default backend's;
    see :mod:`kiln._keys._machine`)."""
    return dict(_static_environment())["machine"]


def environment_parts() -> list[tuple[str, str]]:
    """Key parts describing versions, backend, tracing config and XLA flags (in this order)."""
    parts = list(_static_environment())
    parts += [(f"config:{n}", v) for n, v in _jax_compat.trace_context()]
    # config that changes tracing but is not in jax's trace context (jax 0.10.2)
    for name in _EXTRA_CONFIG:
        parts.append((f"config:{name}", repr(getattr(jax.config, name, None))))
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        parts.append((f"env:{var}", os.environ.get(var, "")))
    return parts


def make_key(parts: list[tuple[str, str]]) -> str:
    """sha256 hex digest over ``name=value`` lines, in order; logs each part at DEBUG."""
    h = hashlib.sha256()
    for name, value in parts:
        line = f"{name}={value}\n".encode()
        h.update(line)
    key = h.hexdigest()
    if logger.isEnabledFor(logging.DEBUG):
        for name, value in parts:
            logger.debug(
                "key %s part %s=%s", short_key(key), name,
                hashlib.sha256(value.encode()).hexdigest()[:12],
            )
    return key
