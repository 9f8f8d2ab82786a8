"""The store protocol every backend implements (get / put / delete / iterate / stat), and the
capabilities some backends add (:class:`Leasable`, :class:`Peekable`, :class:`Replaceable`,
:class:`Prunable`, :class:`Checkable`, :class:`Maintainable`, :class:`Counting`): callers ask
``isinstance(store, Peekable)``, never ``getattr(store, "peek", None)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Checkable", "Counting", "EntryStat", "Leasable", "Lease", "Maintainable", "Peekable",
           "Prunable", "Replaceable", "Store"]


@dataclass(frozen=True)
class EntryStat:
    """Metadata of one stored entry.

    Attributes:
        key: the entry's key (64 hex characters).
        size: bytes.
        created: POSIX seconds when the entry was written.
        last_used: POSIX seconds when it was last read or written.
    """

    key: str
    size: int
    created: float
    last_used: float


@runtime_checkable
class Store(Protocol):
    """Where entries live. Keys are 64-character hex strings; values are entry blobs (bytes).

    Implementations never raise on a missing key (``get`` returns ``None``, ``delete`` returns
    ``False``); I/O failures raise ``OSError`` and callers turn them into warnings.
    """

    url: str

    def get(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or ``None``. Marks the entry as used."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (readers see the old blob or the new one)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""
        ...

    def iter(self) -> Iterator[str]:
        """Iterate over all keys."""
        ...

    def stat(self, key: str) -> EntryStat | None:
        """Size and times of ``key``, or ``None``."""
        ...

    def header(self, key: str) -> dict[str, Any] | None:
        """The entry's JSON header without reading its payload (for listings), or ``None``."""
        ...


@runtime_checkable
class Lease(Protocol):
    """A time-limited claim on one key, so that one process compiles it while others wait
    (single-flight; see :meth:`Leasable.lease`). Methods never block for long and raise
    ``OSError`` when the store fails (callers then compile without the lease).

    ``expires``: the lease runs out unless renewed (a Redis or object-store lease); False for
    one that lasts while its holder lives (an OS file lock): nothing renews it."""

    @property
    def expires(self) -> bool: ...

    def acquire(self) -> bool:
        """Take the lease if nobody holds it, or if its holder's lease ran out (the holder died:
        ``kill -9``, a lost host). ``True``: this process holds it now. Never waits."""
        ...

    def renew(self) -> bool:
        """Extend a held lease by its full duration; ``False`` if it was lost (taken over)."""
        ...

    def release(self) -> None:
        """Give the lease up (only if this process still holds it)."""
        ...


@runtime_checkable
class Leasable(Protocol):
    """A store that can lease keys (the single-flight capability)."""

    def lease(self, key: str, seconds: float) -> Lease:
        """A lease on ``key`` lasting ``seconds`` unless renewed (not yet acquired)."""
        ...


@runtime_checkable
class Peekable(Protocol):
    """A store that can read an entry without marking it used (audits, exports: the LRU order
    stays the programs' own)."""

    def peek(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or ``None``, its last use left as it was."""
        ...


@runtime_checkable
class Replaceable(Protocol):
    """A store whose ``put`` keeps what it holds (create-only: Redis ``SET NX``, an object
    store's ``If-None-Match: *``) and that can also overwrite, for an entry that failed
    verification."""

    def replace(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what is there."""
        ...


@runtime_checkable
class Prunable(Protocol):
    """A store that keeps a last-use order and can evict by it (``kiln prune``)."""

    def prune(self, max_size: int, *, dry_run: bool = False) -> list[str]:
        """Evict least recently used entries until the store holds at most ``max_size`` bytes.

        Args:
            max_size: bytes the store may hold afterwards.
            dry_run: only say which entries would go.

        Returns:
            The evicted keys (or those that would be, with ``dry_run``), oldest use first.
        """
        ...


@runtime_checkable
class Checkable(Protocol):
    """A store that can tell, before it is used, that kiln would refuse it (a local directory
    writable by others, a bucket that does not exist)."""

    def check(self) -> None:
        """Return when the store may be used; raise when kiln would refuse it.

        Raises:
            StoreError: it would be refused; the message says why and what to do.
            OSError: the store did not answer.
        """
        ...


@runtime_checkable
class Maintainable(Protocol):
    """A store that can hold things that are not entries (strays: a file not named like a key,
    a folder where an entry should be, a foreign Redis key under its prefix) and writers' temp
    files, and can list and remove them (``kiln verify``, ``kiln stats``, ``kiln clear``)."""

    def strays(self) -> Sequence[Any]:
        """What is in the store and is neither an entry nor a temp file: each ``str()`` names
        it and ``is_dir()`` says whether it is a folder."""
        ...

    def remove_stray(self, path: Any) -> None:
        """Delete one of :meth:`strays` (a folder with what it holds).

        Raises:
            ValueError: ``path`` is not in this store.
            OSError: it could not be removed.
        """
        ...

    def temp_files(self) -> Sequence[Any]:
        """Writers' temp files (in progress, or left by killed writers), each with ``stat()``."""
        ...


@runtime_checkable
class Counting(Protocol):
    """A store that keeps counters processes add at exit (a fleet's hits, misses, remote
    faults and lease waits, for ``kiln stats``)."""

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add ``counts`` to the store's counters.

        Raises:
            OSError: the store cannot be written.
        """
        ...

    def counts(self) -> dict[str, int]:
        """The counters added so far, by name."""
        ...

