"""In-process stores: ``memory`` (tests, single process) and ``null`` (persistence off)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from .._base import read_header
from ._base import EntryStat

__all__ = ["MemoryStore", "NullStore"]


class MemoryStore:
    """Entries in a dict of this process; nothing outlives it."""

    url = "memory"

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, float, float]] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.writes = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self.reads += 1
            item = self._data.get(key)
            if item is None:
                return None
            self._data[key] = (item[0], item[1], time.time())
            return item[0]

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self.writes += 1
            now = time.time()
            self._data[key] = (bytes(data), now, now)

    replace = put

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def iter(self) -> Iterator[str]:
        with self._lock:
            keys = list(self._data)
        return iter(keys)

    def stat(self, key: str) -> EntryStat | None:
        item = self._data.get(key)
        return None if item is None else EntryStat(key, len(item[0]), item[1], item[2])

    def header(self, key: str) -> dict[str, Any] | None:
        item = self._data.get(key)
        return read_header(item[0] if item else None)


class NullStore:
    """Stores nothing: ``store="null"`` turns persistence off without ``if enabled`` branches."""

    url = "null"

    def get(self, key: str) -> bytes | None:
        return None

    def put(self, key: str, data: bytes) -> None:
        return None

    def delete(self, key: str) -> bool:
        return False

    def iter(self) -> Iterator[str]:
        return iter(())

    def stat(self, key: str) -> EntryStat | None:
        return None

    def header(self, key: str) -> dict[str, Any] | None:
        return None
