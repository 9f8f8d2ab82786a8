"""Stores: where entries live. One protocol (:class:`Store`), several backends."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .._base import Config, ConfigError, StoreError, StoreWarning
from ._base import Checkable as Checkable
from ._base import Counting as Counting
from ._base import EntryStat as EntryStat
from ._base import Leasable as Leasable
from ._base import Lease as Lease
from ._base import Maintainable as Maintainable
from ._base import Peekable as Peekable
from ._base import Prunable as Prunable
from ._base import Replaceable as Replaceable
from ._base import Store as Store
from ._faults import reporter
from ._faults import reporting as reporting
from ._faults import store_fault as store_fault
from ._faults import user_stacklevel as user_stacklevel
from ._layered import ANSWERED_FACTOR
from ._layered import LayeredStore as LayeredStore
from ._layered import RemoteSkipped as RemoteSkipped
from ._layered import wait_for_uploads as wait_for_uploads
from ._lease import Flight as Flight
from ._lease import Held as Held
from ._lease import await_or_lease as await_or_lease
from ._local import LocalStore as LocalStore
from ._local_files import write_atomic as write_atomic
from ._memory import MemoryStore as MemoryStore
from ._memory import NullStore as NullStore

# The public names (docs/how-it-works.md, docs/fleets.md). The face binds kiln's own names too,
# for the layers above, which import them from here and never from a module of this folder:
# single-flight (Flight, Held, await_or_lease), a failing store (reporting, store_fault,
# user_stacklevel), RemoteSkipped (a write the layered store skipped) and write_atomic (a temp
# file, then os.replace); they take _inventory (sizes, strays, verify, prune, clear) as a
# module (tests/test_layers.py, FACE_MODULES).
__all__ = ["Checkable", "Counting", "EntryStat", "LayeredStore", "Leasable", "Lease", "LocalStore",
           "Maintainable", "MemoryStore", "NullStore", "Peekable", "Prunable", "Replaceable",
           "Store", "open_store", "wait_for_uploads"]

_cache: dict[tuple[Any, ...], Store] = {}
_lock = threading.Lock()
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_warned_unsigned: set[str] = set()


def open_store(
    config: Config, *, layered: bool = True, report: Callable[[str], None] | None = None
) -> Store:
    """The store named by ``config.store`` (one instance per distinct setting per process).

    ``None`` / ``"local"``: :class:`LocalStore` at ``config.cache_dir``; ``"memory"``;
    ``"null"`` / ``"off"``; ``redis://``, ``rediss://``, ``unix://``: a Redis server; any other
    ``scheme://``: an fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...); anything
    else is a local directory path (``file://`` allowed). A remote store is returned inside a
    :class:`LayeredStore` (behind the local store, per ``config.remote_mode``) unless
    ``layered`` is false (the CLI works on the remote store itself). A shared store without a
    signing key gives one :class:`kiln.StoreWarning` per process (or one call of ``report``
    with its text, where a warning could stop the program: inside JAX's cache).

    Raises:
        ConfigError: an unknown URL scheme.
        StoreError: the scheme's library is not installed (the message names the extra).
    """
    url = config.store
    shared = config.signing_key is not None  # a signed store may be shared (see LocalStore)
    scheme = url.partition("://")[0].lower() if url and "://" in url else ""
    ident: tuple[Any, ...]
    if url is None or url in ("", "local"):
        ident = ("local", str(config.cache_dir), config.max_size, shared)
    elif url in ("memory", "null", "off"):
        ident = ("memory" if url == "memory" else "null",)
    elif scheme in ("", "file"):
        ident = ("local", url[len("file://"):] if scheme else url, config.max_size, shared)
    else:
        ident = ("remote", url, config.remote_timeout)
    with _lock:
        store = _cache.get(ident)
        if store is None:
            store = _cache[ident] = _open(ident, scheme)
    if ident[0] != "remote":
        return store
    if not config.signing_key:
        _warn_unsigned(store.url, report)
    if not layered:
        return store
    local = None
    if config.remote_mode != "remote-only":
        local = open_store(dataclasses.replace(config, store=None))
    key = ("layered", ident, local.url if local else None, config.remote_mode, config.strict)
    with _lock:
        layers = _cache.get(key)
        if layers is None:
            layers = _cache[key] = LayeredStore(
                local, store, read_only=config.remote_mode == "read-only",
                timeout=config.remote_timeout, strict=config.strict)
    return layers


def _open(ident: tuple[Any, ...], scheme: str) -> Store:
    kind = ident[0]
    if kind == "local":
        return LocalStore(str(ident[1]), max_size=ident[2], shared=ident[3])
    if kind == "memory":
        return MemoryStore()
    if kind == "null":
        return NullStore()
    # the backends' own per-answer timeout: what a store that has answered may take
    # (LayeredStore bounds the first contact by remote_timeout itself)
    url, timeout = ident[1], ident[2] * ANSWERED_FACTOR
    if scheme in _REDIS_SCHEMES:
        from ._redis import RedisStore

        return RedisStore(url, timeout=timeout)
    try:
        import fsspec
    except ImportError:
        raise StoreError(f"store {url!r} needs fsspec: pip install 'jax-kiln[s3]' (or fsspec "
                         "and the filesystem for that scheme)") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise ConfigError(
            f"store {url!r}: unknown store scheme {scheme!r}; use 'local', 'memory', 'null', a "
            "directory path, redis://host:port/db, or a URL fsspec knows (s3://, gs://, ...)"
        ) from None
    except ImportError as e:
        raise StoreError(f"store {url!r} needs a library that is not installed ({e}); for "
                         "s3:// run pip install 'jax-kiln[s3]'") from None
    from ._fsspec import FsspecStore

    return FsspecStore(url, timeout=timeout)


def _warn_unsigned(url: str, report: Callable[[str], None] | None) -> None:
    """Once per remote store per process: without a signing key, a shared store is code."""
    with _lock:
        if url in _warned_unsigned:
            return
        _warned_unsigned.add(url)
    text = (f"kiln: store {url!r} is shared and KILN_SIGNING_KEY is not set: anyone who can "
            "write to it can run code in every process that reads it. Set KILN_SIGNING_KEY to "
            "the same secret on every worker (entries are then HMAC-signed and unsigned ones "
            "never loaded)")
    report = report or reporter()
    if report is not None:
        report(text)
        return
    warnings.warn(text, StoreWarning, stacklevel=user_stacklevel())
