"""Single-flight with leases: wait for another process's compile or take the key
(:func:`await_or_lease`), and hold a lease while compiling (:class:`Held`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base import _stats
from ._base import Lease

__all__ = ["Flight", "Held", "await_or_lease"]


@dataclass(frozen=True)
class Flight:
    """How :func:`await_or_lease` ended: ``found`` (what another process stored, or None),
    ``held`` (this process holds the lease: it compiles), ``waited`` (it waited first)."""

    found: Any
    held: bool
    waited: bool


def await_or_lease(
    lease: Lease, look: Callable[[], tuple[bool, Any]], *, seconds: float, wait: float,
    waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Flight:
    """Take ``lease`` (never blocking), or wait while another process holds it.

    ``look()`` reads the store: ``(True, value)`` another process's result (stop),
    ``(True, None)`` stop and compile here without the lease (an unusable entry), ``(False,
    None)`` nothing yet. Once the lease is taken the store is looked at again, also when it
    was taken at once: a holder may have written and let go between the caller's own read and
    this acquire (4 processes of a job compiled one key twice, 1 run in 3). Polls every 50 ms
    growing to 0.5 s (at most a quarter of ``seconds``); gives up after ``wait`` seconds.
    ``waiting()``: a context entered when the waiting starts (a progress line). Counts
    ``lease_waits`` and ``lease_takeovers``.

    Raises:
        OSError, StoreError: the store failed to answer ``acquire`` (callers compile without a
            lease).
    """
    deadline = time.monotonic() + wait
    pause, waited = 0.05, False
    with contextlib.ExitStack() as showing:
        while True:
            held = lease.acquire()
            stop, found = look()
            if found is not None:
                if held:
                    with contextlib.suppress(Exception):
                        lease.release()
                return Flight(found, False, waited)
            if held:
                if waited:
                    _stats.bump(lease_takeovers=1)
                return Flight(None, True, waited)
            if stop:
                return Flight(None, False, waited)
            if not waited:
                waited = True
                _stats.bump(lease_waits=1)
                if waiting is not None:
                    showing.enter_context(waiting())
            if time.monotonic() > deadline:
                return Flight(None, False, True)
            time.sleep(pause)
            pause = min(pause * 1.5, 0.5, seconds / 4)


class Held:
    """``lease`` (already acquired) renewed every third of ``seconds`` on a daemon thread until
    :meth:`release`. A failed renew only ends the lease early: a waiter may then compile too,
    which costs time, never correctness (entries are content-addressed)."""

    def __init__(self, lease: Lease, seconds: float) -> None:
        self.lease = lease
        self._done = threading.Event()
        self._seconds = seconds
        self._thread: threading.Thread | None = None
        if lease.expires:  # (an OS file lock lasts while its holder lives: nothing to renew)
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
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(Exception):
            self.lease.release()
