"""A thread's own setting for the length of a block."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["set_in_thread"]


@contextlib.contextmanager
def set_in_thread(local: threading.local, name: str, value: Any,
                  unset: Any = None) -> Iterator[None]:
    """``local.<name>`` is ``value`` in this thread for the duration of the block, then what it
    was before (``unset`` where this thread never set it)."""
    before = getattr(local, name, unset)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)
