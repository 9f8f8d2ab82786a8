"""Compile options and XLA flags: the digest of the options JAX gives XLA, the flags JAX's own key
leaves out, and XLA_FLAGS / LIBTPU_INIT_ARGS as the backend read them at its start.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import Any

import jax

from ._private import _cache_key, _compiler, _xla_bridge

__all__ = ['compile_options_digest', 'flags_left_out_of_jax_key', 'flags_at_backend_start']


_OPTIONS_CACHE: list[Any] = [None, ""]  # [the config values it was made under, the digest]


# debug options that hold paths into JAX's cache directory while JAX's persistent cache is on
# (get_compile_options, jax 0.10 to 0.12; jax 0.12's cache key clears the first, 0.10's none):
# kiln's keys never depend on where a store lives
_CACHE_PATH_OPTIONS = ("xla_gpu_per_fusion_autotune_cache_dir", "xla_gpu_kernel_cache_file")


def compile_options_digest(backend: Any) -> str:
    """sha256 hex of the compile options JAX gives XLA for a program on ``backend``, as JAX's
    own cache key digests them.

    They come from JAX's own ``get_compile_options`` (every config option that feeds the
    compile: ``jax_disable_most_optimizations``, the optimization and memory-fitting efforts and
    levels, ``jax_compiler_enable_remat_pass``, the shardy partitioner, the XLA-AutoFDO profile
    version, ...), and their debug options are XLA's flags as XLA parsed them when the backend
    started (``XLA_FLAGS``, a flags file by its contents). Cleared as JAX's cache key clears
    them: what does not change the executable (dump settings, the CUDA path, the forced CPU
    device count). Cleared by kiln too: the paths into JAX's cache directory (the ``kiln://``
    route's, or another), and what the key holds elsewhere: the device assignment and counts
    (made for one device here; shardings and devices are in the signature), a program's own
    ``compiler_options`` (``jit:compiler_options``), and whether XLA logs in detail (JAX decides
    by the program's size; it only changes logs).

    Remade only when a jax config value changed since the last call: it runs on every miss of
    the process's table, and costs 62-74 us to make, 7-10 us when reused (the config values
    read and compared; medians of 3 runs of ``python benchmarks/compile_options_digest.py`` on
    a busy 2-core machine).
    """
    # jax.config._value_holders: option name -> its State or Flag, every jax config option
    # (jax 0.10.2 and 0.12); .value is this thread's value. The public jax.config.values builds a
    # dict of the same values (slower)
    holders = jax.config._value_holders  # type: ignore[attr-defined]
    values = tuple([h.value for h in holders.values()])
    cached = _OPTIONS_CACHE
    try:
        if cached[0] is not None and cached[0] == values:
            return str(cached[1])
    except Exception:  # noqa: BLE001 - a config value that does not compare: make it again
        pass
    options = _compiler.get_compile_options(
        num_replicas=1, num_partitions=1, detailed_logging=True, backend=backend)
    debug = options.executable_build_options.debug_options  # (options must outlive it)
    for name in _CACHE_PATH_OPTIONS:
        if hasattr(debug, name):  # set even when empty: a field set serializes apart
            setattr(debug, name, "")  # from one never set (jaxlib 0.10.2)
    h = hashlib.sha256()
    _cache_key._hash_serialized_compile_options(h, options, strip_device_assignment=True)
    digest = h.hexdigest()
    _OPTIONS_CACHE[:] = [values, digest]
    return digest


def flags_left_out_of_jax_key() -> frozenset[str]:
    """The XLA flags (``--name``) JAX's own cache key leaves out: dump settings and others that
    do not change the executable (``cache_key.xla_flags_to_exclude_from_cache_key``)."""
    return frozenset(getattr(_cache_key, "xla_flags_to_exclude_from_cache_key", ()))


_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_start_flags: dict[str, str] | None = None
_start_lock = threading.Lock()


def _flags_text(value: str) -> str:
    """The text XLA parses flags from for an environment variable's ``value``: the value when
    it starts (after white space) with ``-``, else the contents of the file it names (XLA's
    ``parse_flags_from_env.cc``; XLA has no ``--flagfile=``: it stops on it as an unknown flag)."""
    if not value.strip(" \t\r\n") or value.lstrip(" \t\r\n").startswith("-"):
        return value
    try:
        with open(value, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:  # XLA stops the process on it (XLA_FLAGS); libtpu: keep the text
        return value


def _capture_start_flags() -> dict[str, str]:
    global _start_flags
    with _start_lock:
        if _start_flags is None:  # XLA reads its flags once per process: a later backend
            # (after jax.clear_backends(), another platform) runs under the first ones
            flags = {var: _flags_text(os.environ.get(var, "")) for var in _FLAG_VARIABLES}
            prefixes = ("--xla", *getattr(_cache_key, "get_flag_prefixes", list)())
            flags["argv"] = " ".join(a for a in sys.argv if a.startswith(prefixes))
            _start_flags = flags
        return _start_flags


def flags_at_backend_start() -> dict[str, str]:
    """The text of ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` (a file's contents where the value
    names a file) as JAX's first backend started, and the ``--xla`` words of ``sys.argv``
    (JAX's cache key holds them too) at that moment.

    XLA reads its flags once, as the first backend starts; a change of ``os.environ`` after
    that never reaches it, and a flags file can change after it was read. kiln is imported
    before the backend starts in most programs (nothing in ``import kiln`` starts it): the
    wrapper of ``xla_bridge._init_backend`` takes the values right before the factory reads
    them. When the backend already ran before kiln was imported, the values at kiln's import
    are the best evidence left (a change in between is not seen here; the flags XLA parsed
    still reach the key through the compile options' debug options:
    :func:`compile_options_digest`).
    """
    # (taken now if the hook never ran: jax moved _init_backend, the values now are the evidence)
    return dict(_start_flags if _start_flags is not None else _capture_start_flags())


def _install_start_hook() -> None:
    original = getattr(_xla_bridge, "_init_backend", None)
    if callable(original) and not getattr(original, "_kiln_wrapped", False):
        def _init_backend(platform: str) -> Any:
            _capture_start_flags()
            return original(platform)

        _init_backend._kiln_wrapped = True  # type: ignore[attr-defined]
        _xla_bridge._init_backend = _init_backend
    if _xla_bridge.backends_are_initialized():
        _capture_start_flags()  # XLA read its flags before kiln was imported

_install_start_hook()
