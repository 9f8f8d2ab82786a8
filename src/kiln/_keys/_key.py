"""Persistent keys: sha256 over an ordered list of NAMED parts.

Parts (each logged at DEBUG with its own short hash, so two keys can be diffed):

- ``format``: the entry format version; ``kiln``, ``jax``, ``jaxlib``: versions;
- ``backend``: platform, platform version, device kind and device count (global: every
  process of a ``jax.distributed`` job); ``processes``: the job's process count and devices per
  process (never the process index, so a job's processes share entries); ``machine``: what the
  executable needs from the machine (on CPU the architecture and instruction-set features, on
  GPU the compute capability: :mod:`kiln._keys._machine`);
- ``config:<name>``: every jax config value that changes tracing (jax's own trace context: x64,
  default matmul precision, dtype promotion, ...);
- what the compiler is given (:mod:`kiln._keys._compile_settings`): ``compile-options``, the
  digest of the compile options JAX builds from its config (``jax_disable_most_optimizations``,
  optimization levels, ...) with XLA's flags as XLA parsed them; ``xla-flags:XLA_FLAGS``,
  ``xla-flags:LIBTPU_INIT_ARGS`` (and ``xla-flags:argv``): the flags as the backend read them
  when it started, a flags file by its contents (``os.environ`` changed later is not read);
- ``function``: module + qualname; ``fingerprint``: the static-walk digest
  (:mod:`kiln._keys._fingerprint`), or ``lowered``: the digest of the lowered module on the verify
  path;
- ``signature``: pytree structure, and per leaf shape, dtype, weak_type (and sharding when not
  the default single device); ``static:<name>``: the digest of each static argument;
- ``jit:<option>``: each ``jax.jit`` option set (``keep_unused``, ``device``, ...,
  ``in_shardings``, ``out_shardings``); ``default-device`` (several devices and no committed
  argument); ``jit:donated-leaves``; ``jit:contract`` (``kiln.filter_jit``).

:meth:`KeyParts.for_call` lists them all, in this order, in one place (as jax's
``cache_key.get`` does); the program's own part comes last (:meth:`KeyParts.key`).

Keys never depend on where the store lives (JAX's own cache key does, through an autotune-cache
path in the compile options, so a moved cache never hits).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jaxlib

from .._base import FORMAT_VERSION, _jax_compat, _version, short_key
from . import _args
from ._compile_settings import compile_settings_parts
from ._machine import machine_part

__all__ = ["KeyParts", "avals_text", "environment_parts", "machine", "make_key", "option_text",
           "treedef_parts"]

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
    devices = jax.devices()
    d0 = devices[0]
    return (
        ("format", str(FORMAT_VERSION)),
        ("kiln", _version.__version__),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("backend", f"{d0.client.platform} {d0.client.platform_version}"),
        ("device", f"{d0.device_kind} x{len(devices)}"),
        ("processes", f"{jax.process_count()} x{jax.local_device_count()}"),
        ("machine", machine_part(d0)),
    )


@functools.lru_cache(maxsize=1)
def _default_client() -> Any:
    """The default backend's client (started once: its XLA flags are known after it)."""
    return jax.devices()[0].client


def machine() -> str:
    """This process's ``machine`` key part (its default backend's: :mod:`kiln._keys._machine`)."""
    return dict(_static_environment())["machine"]


def environment_parts() -> list[tuple[str, str]]:
    """Key parts describing versions, backend, tracing config, compile options and XLA flags
    (in this order)."""
    parts = list(_static_environment())
    parts += [(f"config:{n}", v) for n, v in _jax_compat.trace_context()]
    # config that changes tracing but is not in jax's trace context (jax 0.10.2)
    parts += [(f"config:{n}", repr(getattr(jax.config, n, None))) for n in _EXTRA_CONFIG]
    parts += compile_settings_parts(_default_client())
    return parts


def make_key(parts: list[tuple[str, str]]) -> str:
    """sha256 hex digest over ``name=value`` lines, in order; logs each part at DEBUG."""
    h = hashlib.sha256()
    for name, value in parts:
        h.update(f"{name}={value}\n".encode())
    key = h.hexdigest()
    if logger.isEnabledFor(logging.DEBUG):
        for name, value in parts:
            logger.debug(
                "key %s part %s=%s", short_key(key), name,
                hashlib.sha256(value.encode()).hexdigest()[:12],
            )
    return key


def _aval_text(sig: Any) -> str:
    """``float32[3]``, ``float32[]~weak``, ``python-float``: canonical, used in keys."""
    if isinstance(sig, type):
        return f"python-{sig.__name__}"
    sharding = ""
    if isinstance(sig, tuple):  # (aval, sharding) when there are several devices
        if sig[1] is not None:  # (None: an uncommitted array, placed where jax.jit puts it)
            sharding = f"@{_jax_compat.sharding_text(sig[1])}"
        sig = sig[0]
    weak = "~weak" if sig.weak_type else ""
    return f"{sig.dtype}{list(sig.shape)}{weak}{sharding}"


def avals_text(sigs: Sequence[Any]) -> str:
    """The leaf signatures of a call (per array leaf, ``kiln._keys._args.leaf_sig``) as text:
    ``float32[3], python-int``."""
    return ", ".join(_aval_text(s) for s in sigs)


def treedef_parts(treedef: Any) -> tuple[str, list[tuple[str, Any]]]:
    """(structure text with node types only, [(name, aux data)] for the fingerprint)."""
    aux: list[tuple[str, Any]] = []

    def walk(t: Any, path: str) -> str:
        data = t.node_data()
        if data is None:
            return "*"
        typ, node_aux = data
        kids = [walk(c, f"{path}/{i}") for i, c in enumerate(t.children())]
        if typ not in (tuple, list, dict, type(None)):
            aux.append((f"pytree-aux{path}", (typ, node_aux)))
        elif typ is dict:
            aux.append((f"pytree-keys{path}", tuple(node_aux)))
        return f"{typ.__module__}.{typ.__qualname__}({','.join(kids)})"

    return walk(treedef, ""), aux


def _jit_option_text(v: Any) -> str:
    """Canonical text of a jax.jit option for the key: a device by platform, kind and id; a
    dict by sorted items."""
    if isinstance(v, dict):
        return repr(sorted((str(k), repr(x)) for k, x in v.items()))
    if hasattr(v, "platform") and hasattr(v, "id"):
        return f"{v.platform}:{getattr(v, 'device_kind', '?')}:{v.id}"
    return repr(v)


def option_text(v: Any) -> str | None:
    """Canonical text of ``in_shardings`` / ``out_shardings`` (a pytree of shardings): each
    sharding by mesh, devices and partition spec (``_jax_compat.sharding_text``)."""
    if v is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten(v, is_leaf=lambda x: x is None)
    texts = [
        "None" if x is None else
        _jax_compat.sharding_text(x) if isinstance(x, jax.sharding.Sharding) else repr(x)
        for x in leaves
    ]
    return f"{tree}:{texts}"


@dataclasses.dataclass(frozen=True)
class KeyParts:
    """The named parts of one call's key but the last, in key order. The last names the
    program: ``fingerprint`` (the static walk's digest), or on the verify path ``lowered`` /
    ``lowered-inlined`` (the lowered module's digest): :meth:`key`.

    Attributes:
        parts: ``(name, value)`` pairs (stored in an entry's header as ``key_parts``, so that
            ``KILN_EXPLAIN`` can name the part that differs).
    """

    parts: tuple[tuple[str, str], ...]

    @classmethod
    def for_call(
        cls,
        *,
        function: str,
        structure: str,
        sigs: Sequence[Any],
        statics: Sequence[tuple[str, str]],
        jit_options: Mapping[str, Any],
        in_shardings: Any,
        out_shardings: Any,
        donated: Sequence[int],
        filter_jit: bool,
    ) -> KeyParts:
        """Every part of a call's key (see the module docstring), in order.

        Args:
            function: ``module.qualname``.
            structure: the arguments' pytree structure (:func:`treedef_parts`).
            sigs: per array leaf, its signature (``kiln._keys._args.leaf_sig``).
            statics: ``(name, digest text)`` per static argument and static leaf, in key order.
            jit_options: the ``jax.jit`` options set (``keep_unused``, ``device``, ...).
            in_shardings, out_shardings: as given to ``kiln.jit`` (None: not given).
            donated: the indices of the donated array leaves.
            filter_jit: whether the function follows ``kiln.filter_jit``'s contract.
        """
        parts = [
            *environment_parts(),
            ("function", function),
            ("signature", f"{structure} :: {avals_text(sigs)}"),
            *[(f"static:{name}", digest) for name, digest in statics],
            *[(f"jit:{k}", _jit_option_text(v)) for k, v in sorted(jit_options.items())],
            *[(f"jit:{k}", str(option_text(v))) for k, v in
              (("in_shardings", in_shardings), ("out_shardings", out_shardings))
              if v is not None],
        ]
        if _args.multi_device() and in_shardings is None and not any(
                isinstance(s, tuple) and s[1] is not None for s in sigs):
            # no committed argument: jax.jit runs the program on this process's default
            # device, so the executable is bound to it (in a multi-process job each process
            # has its own); with a committed argument its sharding decides (in the signature)
            parts.append(("default-device", _jax_compat.default_device_text()))
        if donated:
            # a donating executable deletes its inputs: never served to a call that keeps them
            parts.append(("jit:donated-leaves", str(list(donated))))
        if filter_jit:
            # equinox's contract (non-array outputs outside the executable)
            parts.append(("jit:contract", "filter_jit"))
        return cls(tuple(parts))

    def key(self, name: str, digest: str) -> str:
        """The key of these parts followed by the program's own part ``(name, digest)``."""
        return make_key([*self.parts, (name, digest)])
