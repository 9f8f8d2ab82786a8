"""The store protocol every backend implements (get / put / delete / iterate / stat)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .._base._errors import EntryError
from ._entry import peek_header

__all__ = ["EntryStat", "Lease", "Leasable", "Store", "read_header"]


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


def read_header(blob: bytes | None) -> dict[str, Any] | None:
    """Header of a blob, or ``None`` when the blob is missing or unreadable."""
    if blob is None:
        return None
    try:
        return peek_header(blob)
    except EntryError:
        return None
