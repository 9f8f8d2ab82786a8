"""Holding a lease: renewed on a thread while the holder compiles, released when done."""

from __future__ import annotations

import contextlib
import threading

from ._base import Lease

__all__ = ["Held"]


class Held:
    """``lease`` (already acquired) renewed every third of ``seconds`` on a daemon thread until
    :meth:`release`. A failed renew only ends the lease early: a waiter may then compile too,
    which costs time, never correctness (entries are content-addressed)."""

    def __init__(self, lease: Lease, seconds: float) -> None:
        self.lease = lease
        self._done = threading.Event()
        self._seconds = seconds
        self._thread = threading.Thread(target=self._renew, name="kiln-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._done.wait(self._seconds / 3):
            try:
                if not self.lease.renew():
                    return
            except Exception:  # noqa: BLE001 - the store failed: the lease just runs out
                return

    def release(self) -> None:
        """Stop renewing and give the lease up (idempotent; never raises)."""
        if self._done.is_set():
            return
        self._done.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(Exception):
            self.lease.release()
