"""Compiled programs that travel with a pickled kiln function.

A kiln function that cannot be found again by module and name (defined in ``__main__``, a
notebook, a closure) pickles by value (with cloudpickle) and carries the stored entries of the
signatures it has compiled: :func:`carried_entries` reads them from the store, up to
``pickle_max_size`` bytes; :func:`store_carried` writes them into the receiving process's store,
each verified first (digest or signature, and the key it was written for) like any entry read
from a store. The receiving process then finds them as it would its own (jax-ml/jax #4572: a
pickled jitted function "behaves like an uncompiled function").
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import cloudpickle

from .._base import EntryError, StoreError, StoreWarning, decode, get_config, short_key
from ..stores import Store, open_store

__all__ = ["carried_entries", "name_if_found", "portable", "store_carried"]

logger = logging.getLogger("kiln")


def carried_entries(entries: Iterable[tuple[Store, str]]) -> list[tuple[str, bytes]]:
    """``(key, entry bytes)`` of each ``(store, key)`` (the store it was loaded from or written
    to), in order, while their total stays within ``pickle_max_size`` (0: none). A store that
    cannot be read gives what was read so far."""
    budget = get_config().pickle_max_size
    out: list[tuple[str, bytes]] = []
    if budget <= 0:
        return out
    seen: set[str] = set()
    try:
        for store, key in entries:
            if key in seen:
                continue
            seen.add(key)
            blob = store.get(key)
            if blob is None:
                continue
            if len(blob) > budget:
                logger.debug("kiln: entry %s not carried (pickle_max_size reached)", short_key(key))
                continue
            budget -= len(blob)
            out.append((key, blob))
    except (OSError, StoreError) as e:
        logger.debug("kiln: carried entries cut short: %s", e)
    return out


def store_carried(entries: Iterable[tuple[str, bytes]]) -> int:
    """Write carried entries into this process's store; each one is decoded first (digest or
    signature, and the key it was written for) and refused with a :class:`StoreWarning` when
    it does not verify. Returns how many were written. Never raises for a store problem."""
    cfg = get_config()
    written = 0
    try:
        store = open_store(cfg)
        for key, blob in entries:
            try:
                decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old, key=key)
            except EntryError as e:
                warnings.warn(f"kiln: a carried entry {short_key(key)} is unusable ({e}); it will "
                              "be compiled", StoreWarning, stacklevel=3)
                continue
            if store.get(key) is None:
                store.put(key, blob)
            written += 1
    except (OSError, StoreError) as e:  # (the store cannot be opened, read or written)
        warnings.warn(f"kiln: carried entries not stored ({e}); they will be compiled",
                      StoreWarning, stacklevel=3)
    return written


_SCRIPT_MODULES = ("__main__", "__mp_main__")


def name_if_found(obj: Any) -> str | None:
    """``obj``'s qualified name when importing its module and looking the name up gives back
    ``obj`` itself (pickle by reference, as functions and ``jax.jit``'s are); else None.

    A script's or notebook's ``__main__`` is never found this way: another process has its own
    ``__main__`` (cloudpickle pickles such functions by value too)."""
    module = str(getattr(obj, "__module__", ""))
    if module in _SCRIPT_MODULES:
        return None
    name = str(getattr(obj, "__qualname__", ""))
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return name if name and found is obj else None


class _ByValue:
    """A script function (``__main__``) inside a kiln function pickled by value, as cloudpickle
    bytes: any pickler carries it (plain pickle, as ``multiprocessing`` uses, would look the
    function up by name in the receiver's ``__main__`` and find the kiln function there, or
    nothing)."""

    def __init__(self, fun: Any) -> None:
        self.payload = cloudpickle.dumps(fun)

    def __reduce__(self) -> Any:
        return (cloudpickle.loads, (self.payload,))


def portable(fun: Any) -> Any:
    """``fun`` as a kiln function pickled by value should carry it: a function of a script's
    ``__main__`` by value (cloudpickle), anything else as it is."""
    if str(getattr(fun, "__module__", "")) in _SCRIPT_MODULES:
        return _ByValue(fun)
    return fun
