"""What is in a store, for the tools that look after it (``kiln ls``, ``stats``, ``verify``,
``prune``, ``clear``; bundles): reading an entry without marking it used, entry sizes, writers'
temp files, strays, verifying every entry, pruning, and deleting every entry and stray.

Nothing here prints: each function returns what it did, and the command line says it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._base import KilnError, StoreError, UnverifiableEntry, decode
from ._base import Maintainable, Peekable, Prunable, Store

__all__ = ["Cleared", "Pruned", "Verdict", "clear", "entry_sizes", "peek", "prune", "strays",
           "temp_usage", "verify"]


def peek(store: Store, key: str) -> bytes | None:
    """The blob under ``key``, or ``None``, without marking it used where the store can
    (:class:`Peekable`; elsewhere a plain ``get``)."""
    return store.peek(key) if isinstance(store, Peekable) else store.get(key)


def entry_sizes(store: Store, keys: Iterable[str]) -> dict[str, int]:
    """Bytes of each of ``keys`` the store holds; a key gone since it was listed, or a name
    that is not a key, is left out."""
    sizes = {}
    for key in keys:
        with contextlib.suppress(ValueError):
            st = store.stat(key)
            if st is not None:
                sizes[key] = st.size
    return sizes


def temp_usage(store: Store) -> tuple[int, int]:
    """``(count, bytes)`` of writers' temp files (in progress, or left by killed writers);
    ``(0, 0)`` for a store that writes none."""
    n = size = 0
    if isinstance(store, Maintainable):
        for path in store.temp_files():
            with contextlib.suppress(OSError):
                size += path.stat().st_size
                n += 1
    return n, size


def strays(store: Store) -> list[Any]:
    """What is in the store and is not an entry (see :meth:`Maintainable.strays`); none in a
    store that cannot hold any."""
    return list(store.strays()) if isinstance(store, Maintainable) else []


def _delete(store: Store, key: str) -> tuple[bool, str | None]:
    """Delete ``key``: whether it was there, and why deleting failed (``None``: it did not)."""
    try:
        return bool(store.delete(key)), None
    except OSError as e:
        return False, f"cannot delete {key}: {e}"


def _remove_stray(store: Maintainable, path: Any) -> str | None:
    """Remove one stray: ``None`` when it went, else why it did not."""
    try:
        store.remove_stray(path)
    except OSError as e:
        return f"cannot remove {path}: {e}"
    return None


# -- kiln verify ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found for one entry or stray.

    Attributes:
        key: the entry's key; for a stray, its path (or Redis key name).
        function: the entry's function (``module.qualname``), ``"-"`` where it names none.
        reason: why the entry is bad or unverified; ``None`` when it verified.
        unverified: signed, and no signing key here to check it (never deleted).
        stray: not an entry at all (``reason`` says what it is).
        deleted: it was deleted (``delete=True``).
        error: why deleting it failed; ``None`` when it did not fail.
    """

    key: str
    function: str = "-"
    reason: str | None = None
    unverified: bool = False
    stray: bool = False
    deleted: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """It decoded and verified."""
        return self.reason is None

    @property
    def bad(self) -> bool:
        """It failed verification, or is not an entry (an unverified entry is not bad)."""
        return not self.ok and not self.unverified


def verify(
    store: Store, *, signing_key: str | None, old_keys: tuple[str, ...] = (), delete: bool
) -> Iterator[Verdict]:
    """Decode every entry of ``store`` (its digest or signature, and the key it was written
    for), without marking any used, then list the strays; one :class:`Verdict` each, entries
    in key order.

    Args:
        store: the store to check.
        signing_key: the key entries are signed with (``KILN_SIGNING_KEY``), or ``None``.
        old_keys: earlier signing keys entries may still be signed with.
        delete: delete each bad entry and stray (an unverified one is kept).

    Returns:
        The verdicts, as each entry is checked (a failed delete is in its ``error``).
    """
    for key in sorted(store.iter()):
        reason: str | None = None
        unverified = False
        function = "-"
        try:
            blob = peek(store, key)
        except ValueError:
            blob, reason = None, "not named like an entry key"
        except OSError as e:
            blob, reason = None, f"cannot read: {e}"
        if blob is None and reason is None:
            continue  # removed since iter()
        if blob is not None:
            try:
                entry = decode(blob, signing_key=signing_key, old_keys=old_keys, key=key)
                function = str(entry.header.get("function", "?"))
                if entry.header.get("kind") == "verify-only" and "." not in function:
                    function = "-"  # an old marker: its "function" held the format version
            except UnverifiableEntry as e:
                reason, unverified = str(e), True
            except KilnError as e:
                reason = str(e)
        deleted, error = False, None
        if reason is not None and delete and not unverified:
            deleted, error = _delete(store, key)
        yield Verdict(key, function, reason, unverified, deleted=deleted, error=error)
    if not isinstance(store, Maintainable):
        return
    for path in store.strays():
        kind = "a directory" if path.is_dir() else "not named like an entry key"
        error = _remove_stray(store, path) if delete else None
        yield Verdict(str(path), reason=f"stray: {kind}", stray=True,
                      deleted=delete and error is None, error=error)


# -- kiln prune ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pruned:
    """What :func:`prune` evicted and what it left.

    Attributes:
        evicted: the keys evicted (or that would be, in a dry run), oldest use first.
        freed: their bytes.
        kept: the entries left.
        kept_bytes: their bytes.
        temp_files_removed: temp files of writers that are gone, removed on the way.
    """

    evicted: list[str]
    freed: int
    kept: int
    kept_bytes: int
    temp_files_removed: int


def prune(store: Store, max_size: int, *, dry_run: bool) -> Pruned:
    """Evict least recently used entries until ``store`` holds at most ``max_size`` bytes.

    Args:
        store: the store to prune.
        max_size: bytes the store may hold afterwards.
        dry_run: only find what would go.

    Returns:
        What went (or would go) and what stays.

    Raises:
        StoreError: the store keeps no last-use order (it is not :class:`Prunable`).
    """
    if not isinstance(store, Prunable):
        raise StoreError(f"store {store.url!r} cannot be pruned (it keeps no last-use order)")
    sizes = entry_sizes(store, store.iter())
    temps_before = temp_usage(store)[0]
    evicted = store.prune(max_size, dry_run=dry_run)
    freed = sum(sizes.get(k, 0) for k in evicted)
    return Pruned(evicted, freed, len(sizes) - len(evicted), sum(sizes.values()) - freed,
                  temps_before - temp_usage(store)[0])


# -- kiln clear ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cleared:
    """What :func:`clear` removed.

    Attributes:
        entries: entries deleted.
        strays: strays removed.
        errors: why each entry or stray that stayed could not be removed.
    """

    entries: int
    strays: int
    errors: list[str]


def clear(store: Store, keys: Iterable[str]) -> Cleared:
    """Delete ``keys`` from ``store``, then its strays.

    Args:
        store: the store to empty.
        keys: the keys to delete (those it listed).

    Returns:
        How many entries and strays went, and why any stayed.
    """
    removed, errors = 0, []
    for key in keys:
        deleted, error = _delete(store, key)
        removed += deleted
        if error is not None:
            errors.append(error)
    gone = 0
    if isinstance(store, Maintainable):
        for path in store.strays():
            error = _remove_stray(store, path)
            if error is None:
                gone += 1
            else:
                errors.append(error)
    return Cleared(removed, gone, errors)
