"""Entries of one kind read from and written to the store, for the routes that keep JAX's own
work there (``_jax_cache``: JAX's persistent cache; ``_eager``: JAX's eager work)."""

from __future__ import annotations

from typing import Any

from .._base import Config, Entry, EntryError, StoreError, decode, encode
from ..stores import RemoteSkipped, Replaceable, Store, store_fault

__all__ = ["decode_kind", "read_blob", "write_entry"]


def read_blob(store: Store, key: str, *, strict: bool, unusable: set[str]) -> bytes | None:
    """The blob under ``key``; None where there is none, the store failed (a
    :func:`kiln.stores.store_fault`, raised when ``strict``) or ``key`` is among the
    ``unusable`` ones already found."""
    try:
        blob = store.get(key)
    except (OSError, StoreError) as e:
        store_fault(store, "read", e, strict=strict)
        return None
    return None if key in unusable else blob


def decode_kind(blob: bytes, key: str, kind: str, cfg: Config) -> Entry:
    """``blob``, the entry under ``key``, decoded.

    Raises:
        EntryError: it is not an entry that verifies here, or not one of ``kind``.
    """
    entry = decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old, key=key)
    if entry.header.get("kind") != kind:
        raise EntryError(f"entry is of kind {entry.header.get('kind')!r}, not {kind!r}")
    return entry


def write_entry(store: Store, key: str, header: dict[str, Any], sections: dict[str, bytes],
                cfg: Config, *, strict: bool, unusable: set[str]) -> bool:
    """Write the entry ``header`` + ``sections`` under ``key`` (signed with ``cfg.signing_key``
    where set), in place of the one there where ``key`` is among the ``unusable`` ones and the
    store can replace. False where the store skipped it or failed (a
    :func:`kiln.stores.store_fault`, raised when ``strict``)."""
    replace = key in unusable  # (a remote store's put keeps what it holds)
    write = store.replace if replace and isinstance(store, Replaceable) else store.put
    try:
        write(key, encode(header, sections, signing_key=cfg.signing_key))
    except RemoteSkipped:
        return False  # (a remote-only store skipped since its fault, warned about then)
    except (OSError, StoreError) as e:
        store_fault(store, "write to", e, strict=strict)
        return False
    unusable.discard(key)
    return True
