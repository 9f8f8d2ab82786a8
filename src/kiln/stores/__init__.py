"""Stores: where entries live. One protocol (:class:`Store`), several backends."""

from __future__ import annotations

import threading

from .._config import Config
from ._base import EntryStat as EntryStat
from ._base import Store as Store
from ._local import LocalStore as LocalStore
from ._memory import MemoryStore as MemoryStore
from ._memory import NullStore as NullStore

__all__ = ["EntryStat", "LocalStore", "MemoryStore", "NullStore", "Store", "open_store"]

_cache: dict[tuple[str, str, int, bool], Store] = {}
_lock = threading.Lock()


def open_store(config: Config) -> Store:
    """The store named by ``config.store`` (one instance per distinct setting per process).

    ``None`` / ``"local"``: :class:`LocalStore` at ``config.cache_dir``; ``"memory"``;
    ``"null"`` / ``"off"``; any other string is a local directory path (``file://`` allowed).
    """
    url = config.store
    shared = config.signing_key is not None  # a signed store may be shared (see LocalStore)
    ident: tuple[str, str, int, bool]
    if url is None or url in ("", "local"):
        ident = ("local", str(config.cache_dir), config.max_size, shared)
    elif url in ("memory", "null", "off"):
        ident = ("memory" if url == "memory" else "null", "", 0, False)
    else:
        path = url[len("file://"):] if url.startswith("file://") else url
        ident = ("local", path, config.max_size, shared)
    with _lock:
        store = _cache.get(ident)
        if store is None:
            if ident[0] == "local":
                store = LocalStore(str(ident[1]), max_size=config.max_size, shared=shared)
            elif ident[0] == "memory":
                store = MemoryStore()
            else:
                store = NullStore()
            _cache[ident] = store
        return store
