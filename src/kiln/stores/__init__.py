"""Stores: where entries live. One protocol (:class:`Store`), several backends."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable

from .. import _stats
from .._config import Config
from .._errors import StoreError, StoreWarning
from ._base import EntryStat as EntryStat
from ._base import Store as Store
from ._local import LocalStore as LocalStore
from ._memory import MemoryStore as MemoryStore
from ._memory import NullStore as NullStore

__all__ = ["EntryStat", "LocalStore", "MemoryStore", "NullStore", "Store", "open_store",
           "store_fault", "user_stacklevel"]

logger = logging.getLogger("kiln")

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


# Stores (by URL) that already gave this process its one warning (see store_fault).
_faulted_stores: set[str] = set()
_faulted_lock = threading.Lock()
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def store_fault(
    store: Store, doing: str, e: BaseException, *, strict: bool,
    report: Callable[[str], None] | None = None,
) -> None:
    """The store itself failed (I/O, its index, a refused directory): counted in
    ``kiln.stats().store_errors``; one :class:`kiln.StoreWarning` per store per process (or
    one call of ``report`` with the message, where a warning could stop the program: inside
    JAX's cache, under ``filterwarnings = error``), then quiet (the program goes on compiling
    in memory).

    Raises:
        StoreError: ``strict`` (``KILN_STRICT=1``).
    """
    _stats.bump(store_errors=1)
    message = f"kiln: cannot {doing} store {store.url!r} ({e})"
    if strict:
        raise StoreError(f"{message} (KILN_STRICT=1 makes this an error; unset it to warn "
                         "once and go on without the store)") from None
    with _faulted_lock:
        if store.url in _faulted_stores:
            logger.debug("%s", message)
            return
        _faulted_stores.add(store.url)
    text = (f"{message}; compiling in memory (further problems with this store are counted "
            "in kiln.stats().store_errors, not repeated)")
    if report is not None:
        report(text)
        return
    warnings.warn(text, StoreWarning, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """stacklevel for warnings.warn that points at the first frame outside kiln and jax."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        f = frame.f_code.co_filename
        if not (f.startswith(_KILN_DIR) or f"{os.sep}jax{os.sep}" in f or f"{os.sep}jaxlib" in f):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1
