"""A remote store (Redis, an object store) behind the local one, with bounded waits.

Reads go to the local store first, then the remote; a remote hit is copied into the local store,
so the next process on this host reads it from disk. Writes go to both (``remote_mode``
``"read-only"``: the local one only). ``remote_mode="remote-only"``: no local store.

Writes are write-behind: the entry goes to the local store at once and the caller
goes on (its first result never waits for an upload); one daemon thread per store uploads, in
order. The remote lease on the key (single flight across hosts) is given up only when its
upload has landed, so a waiter on another host finds the entry when it is let go. At exit the
process waits for its pending uploads at most ``_EXIT_WAIT`` seconds, then warns and leaves
them (they stay in the local store). ``remote_mode="remote-only"`` writes at once (there is no
local store to serve the entry meanwhile).

Faults (sccache's and ccache's lesson: a cache that is down must cost one timeout, not one per
call): the first contact with the remote store is waited for at most ``remote_timeout`` seconds
(default 0.8; plus one second per MiB it sends), so a hung or dead store costs a process under
a second, once. Once the store has answered, it may take ``ANSWERED_FACTOR`` (5) times that
per answer (the backends' own timeouts: a socket read, so a large entry streaming in is not
cut off), and each operation, on a daemon thread, ``5 * remote_timeout + 1`` seconds plus one
second per MiB it sends (reads: ``_READ_BOUND`` at least). The
first failure (down, hung, rate-limited: any exception) gives one :class:`kiln.StoreWarning`,
is counted in ``kiln.stats().remote_timeouts`` or ``remote_errors``, and the remote store is
skipped for the rest of the process: the local store and the compiler go on, and results stay
right. A write refused because the store is full or read-only (``ENOSPC``, ``EROFS``,
``EACCES``, ``EPERM``, ``EDQUOT``: a full Redis, a read-only replica, a bucket this worker may
only read) only stops the writes and leases: the remote store is still read. With
``KILN_STRICT=1`` the failure raises :class:`kiln.StoreError` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._base import StoreError, StoreWarning, _stats, short_key
from . import _inventory
from ._backend import MIN_RATE, called_at_exit
from ._base import Counting, EntryStat, Leasable, Lease, Replaceable, Store
from ._faults import store_fault

__all__ = ["LayeredStore", "RemoteSkipped", "wait_for_uploads"]

T = TypeVar("T")
_READ_BOUND = 10.0  # seconds a whole read may take (the backends' per-answer timeouts end a
# hung one sooner; this catches a backend without them)
# Once a store has answered, it may take this many times ``remote_timeout`` per answer (the
# backends' own timeout): a hung or dead store is found at the first contact, in
# remote_timeout; later, a store that answered is more likely busy than hung (a loaded CI
# machine, a large write), and taking it out costs every later compile a remote miss.
ANSWERED_FACTOR = 5.0
_EXIT_WAIT = 10.0  # seconds a process waits at exit for its pending uploads


class RemoteSkipped(StoreError):
    """Nothing was written: the store has no local part and its remote one is skipped (it
    failed earlier in this process, and was warned about then)."""
# a write refused for good (full, read-only, not allowed): stop writing, keep reading
_REFUSED_WRITES = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}
_SKIPPED: Any = object()  # the remote store was skipped (dead, or the operation failed)


def _call_bounded(fn: Callable[..., T], args: tuple[Any, ...], timeout: float) -> T:
    """``fn(*args)`` on a daemon thread, waited for ``timeout`` seconds (a daemon thread, not a
    pool: a hung call must never hold up the interpreter's exit).

    Raises:
        TimeoutError: no answer in time (the thread is abandoned).
        BaseException: whatever ``fn`` raised.
    """
    out: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append((False, e))
        finally:
            done.set()

    try:
        threading.Thread(target=run, name="kiln-remote", daemon=True).start()
    except RuntimeError:  # at interpreter exit (3.12+ starts no new threads): the backend's
        return fn(*args)  # own timeouts bound the call
    if not done.wait(timeout):
        raise TimeoutError(f"no answer in {timeout:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


class LayeredStore:
    """``remote`` behind ``local`` (``None``: remote only); see the module docstring.

    Attributes:
        local: the local store, or ``None``.
        remote: the shared store.
        url: the remote store's URL (what warnings and ``kiln ls`` name).
    """

    def __init__(
        self, local: Store | None, remote: Store, *, read_only: bool = False,
        timeout: float = 10.0, strict: bool = False,
    ) -> None:
        self.local = local
        self.remote = remote
        self.url = remote.url
        self.read_only = read_only
        self.timeout = timeout
        self.strict = strict
        self._answered = False  # the remote store has answered once (see ANSWERED_FACTOR)
        self.dead: BaseException | None = None  # the fault that took the remote store out
        self.unwritable: BaseException | None = None  # a refused write: reads go on
        self._counted = _stats.stats().as_dict()  # counters already recorded (see counts)
        # write-behind: uploads waiting for the uploader thread, by key; lease releases
        # waiting for a key's upload to land
        self._uploads: queue.Queue[tuple[str, Callable[..., Any], bytes]] = queue.Queue()
        self._pending: dict[str, int] = {}  # key -> uploads of it queued or running
        self._after: dict[str, list[Callable[[], None]]] = {}
        self._plock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._uploader: threading.Thread | None = None
        _layered.add(self)

    # -- the remote side, bounded -------------------------------------------------------------
    def _remote(self, doing: str, fn: Callable[..., T], *args: Any, write: bool = False) -> T:
        """``fn(*args)`` against the remote store, or ``_SKIPPED`` once it has failed (for a
        ``write``: once writes were refused)."""
        if self.dead is not None or (write and self.unwritable is not None):
            return _SKIPPED  # type: ignore[no-any-return]
        # the backend's own timeouts fire first; this bound catches what they miss (an upload
        # gets a second more per MiB, as the fsspec store's own deadline does)
        size = sum(len(a) for a in args if isinstance(a, bytes | bytearray | memoryview))
        if not self._answered:  # the first contact: a hung or dead store costs remote_timeout
            bound = self.timeout + size / MIN_RATE
        else:
            bound = self.timeout * ANSWERED_FACTOR + 1.0 + size / MIN_RATE
            if not write:
                bound = max(bound, _READ_BOUND)  # (a read's size is not known before)
        try:
            got = _call_bounded(fn, args, bound)
        except Exception as e:  # noqa: BLE001 - any failure of a cache must not stop the program
            self._fault(doing, e, write=write)
            return _SKIPPED  # type: ignore[no-any-return]
        self._answered = True
        return got

    def _fault(self, doing: str, e: BaseException, *, write: bool) -> None:
        _stats.bump(**{"remote_timeouts" if isinstance(e, TimeoutError) else "remote_errors": 1})
        if write and isinstance(e, OSError) and e.errno in _REFUSED_WRITES:
            self.unwritable = e
            then = "reading it only from now on (entries compiled here stay in the local store)"
        else:
            self.dead = e
            then = ("skipping it for the rest of this process (the local store and the "
                    "compiler go on)")
        store_fault(self.remote, doing, e, strict=self.strict, then=then)

    # -- protocol -----------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        if self.local is not None:
            blob = self.local.get(key)
            if blob is not None:
                return blob
        blob = self._remote("read", self.remote.get, key)
        if blob is _SKIPPED:
            return None
        if blob is None:
            _stats.bump(remote_misses=1)
            return None
        _stats.bump(remote_hits=1)
        if self.local is not None:
            try:
                self.local.put(key, blob)
            except (OSError, StoreError) as e:
                store_fault(self.local, "write to", e, strict=self.strict)
        return blob

    def peek(self, key: str) -> bytes | None:
        return self._first(_inventory.peek, key)

    def _first(self, read: Callable[[Store, str], T | None], key: str) -> T | None:
        """``read(store, key)`` of the local store, else (where it found nothing) of the remote
        one; ``None`` where neither has it, or the remote one is skipped."""
        if self.local is not None:
            found = read(self.local, key)
            if found is not None:
                return found
        found = self._remote("read", read, self.remote, key)
        return None if found is _SKIPPED else found

    def put(self, key: str, data: bytes) -> None:
        """Write to the local store (replacing what it holds) and, create-only, to the remote."""
        self._write(key, data, replace=False)

    def replace(self, key: str, data: bytes) -> None:
        """Write to both, replacing what they hold (after the entry there failed verification
        or went stale)."""
        self._write(key, data, replace=True)

    def _write(self, key: str, data: bytes, *, replace: bool) -> None:
        local_error: BaseException | None = None
        if self.local is not None:
            try:
                self.local.put(key, data)
            except (OSError, StoreError) as e:
                local_error = e
        if not self.read_only:
            write = (self.remote.replace if replace and isinstance(self.remote, Replaceable)
                     else self.remote.put)
            if self.local is None or local_error is not None:
                # nothing local serves the entry meanwhile: upload now
                if self._remote("write to", write, key, data, write=True) is _SKIPPED:
                    raise RemoteSkipped(
                        f"entry {short_key(key)} not written: {self.url} is skipped")
                return
            self._upload_later(key, write, data)
        elif self.local is None:
            raise RemoteSkipped(f"entry {short_key(key)} not written: {self.url} is read-only here")
        if local_error is not None:
            raise local_error

    # -- write-behind -------------------------------------------------------------------------
    def _upload_later(self, key: str, write: Callable[..., Any], data: bytes) -> None:
        if self.dead is not None or self.unwritable is not None:
            return
        with self._plock:
            self._pending[key] = self._pending.get(key, 0) + 1
            self._idle.clear()
            self._uploads.put((key, write, data))
            thread = None
            if self._uploader is None or not self._uploader.is_alive():
                thread = self._uploader = threading.Thread(
                    target=self._upload_loop, daemon=True, name="kiln-upload")
        if thread is None:
            return
        try:
            thread.start()
        except RuntimeError:  # at interpreter exit (no new threads): upload here, now
            while True:
                try:
                    item = self._uploads.get_nowait()
                except queue.Empty:
                    return
                self._upload(*item)

    def _upload_loop(self) -> None:
        while True:
            try:
                key, write, data = self._uploads.get(timeout=30.0)
            except queue.Empty:
                with self._plock:  # (nothing queued since: this thread ends)
                    if self._uploads.empty():
                        self._uploader = None
                        return
                continue
            self._upload(key, write, data)

    def _upload(self, key: str, write: Callable[..., Any], data: bytes) -> None:
        try:
            self._remote("write to", write, key, data, write=True)
        finally:
            with self._plock:
                left = self._pending.get(key, 1) - 1
                if left > 0:
                    self._pending[key] = left
                    after: list[Callable[[], None]] = []
                else:
                    self._pending.pop(key, None)
                    after = self._after.pop(key, [])
                if not self._pending:
                    self._idle.set()
            for release in after:
                with contextlib.suppress(Exception):
                    release()

    def _release_after_upload(self, key: str, release: Callable[[], None]) -> bool:
        """Run ``release`` once ``key``'s pending upload has landed; False (nothing done)
        when none is pending."""
        with self._plock:
            if key not in self._pending:
                return False
            self._after.setdefault(key, []).append(release)
            return True

    def wait_for_uploads(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for the pending uploads to land; returns how many
        are still pending."""
        self._idle.wait(timeout)
        with self._plock:
            return sum(self._pending.values())

    def delete(self, key: str) -> bool:
        existed = bool(self.local.delete(key)) if self.local is not None else False
        if not self.read_only:
            gone = self._remote("delete from", self.remote.delete, key, write=True)
            existed = existed or gone is True
        return existed

    def iter(self) -> Iterator[str]:
        seen: set[str] = set()
        if self.local is not None:
            seen.update(self.local.iter())
        keys = self._remote("list", lambda: list(self.remote.iter()))
        if keys is not _SKIPPED:
            seen.update(keys)
        return iter(sorted(seen))

    def stat(self, key: str) -> EntryStat | None:
        return self._first(lambda store, k: store.stat(k), key)

    def header(self, key: str) -> dict[str, Any] | None:
        return self._first(lambda store, k: store.header(k), key)

    def lease(self, key: str, seconds: float) -> Lease:
        """A lease on ``key`` in the remote store (one compile across hosts), falling back to
        the local store's (one compile on this host) once the remote one fails, and always
        for a read-only worker (it writes nothing to the remote store, leases included)."""
        local = self.local.lease(key, seconds) if isinstance(self.local, Leasable) else None
        remote = self.remote.lease(key, seconds) if isinstance(self.remote, Leasable) else None
        return _LayeredLease(self, key, remote, local)

    # -- counters of the fleet -----------------------------------------------------------------
    def record_counts(self, *, timeout: float = 2.0) -> None:
        """Add this process's counters since the last call (remote hits, misses, timeouts,
        errors, lease waits and takeovers, hits, compiles) to both stores' counters, where they
        keep any (``add_counts``), for ``kiln stats``. Runs at exit; best-effort, bounded by
        ``timeout`` seconds per store."""
        now = _stats.stats().as_dict()
        counts = {name: int(now[name] - self._counted.get(name, 0)) for name in COUNTED}
        self._counted = now
        if not any(counts.values()):
            return
        for store in (self.local, self.remote):
            if not isinstance(store, Counting) or (
                    store is self.remote and (self.dead or self.unwritable or self.read_only)):
                continue
            with contextlib.suppress(Exception):
                _call_bounded(store.add_counts, (counts,), min(timeout, self.timeout))


#: The counters a layered store records in its stores (``kiln stats`` shows them).
COUNTED = ("hits", "compiles", "verifies", "remote_hits", "remote_misses", "remote_timeouts",
           "remote_errors", "lease_waits", "lease_takeovers")
_layered: weakref.WeakSet[LayeredStore] = called_at_exit("record_counts")


def wait_for_uploads(timeout: float = _EXIT_WAIT) -> int:
    """Wait at most ``timeout`` seconds for this process's pending uploads to shared stores
    (write-behind) to land; returns how many are still pending (0: all landed). A process
    waits for them at exit anyway (at most 10 s); call this where another host must find an
    entry sooner, e.g. before handing work to it."""
    deadline = time.monotonic() + timeout
    return sum(store.wait_for_uploads(max(0.0, deadline - time.monotonic()))
               for store in list(_layered))


@atexit.register  # (registered last: runs first, before the counters are recorded)
def _wait_for_all_uploads() -> None:
    deadline = time.monotonic() + _EXIT_WAIT
    for store in list(_layered):
        with contextlib.suppress(Exception):
            left = store.wait_for_uploads(max(0.0, deadline - time.monotonic()))
            if left:
                warnings.warn(
                    f"kiln: {left} entr{'y' if left == 1 else 'ies'} not uploaded to "
                    f"{store.url} before exit (uploads still running after {_EXIT_WAIT:g} s); "
                    "they stay in the local store, and the next process here uploads none of "
                    "them: another host compiles them once", StoreWarning, stacklevel=1)


class _LayeredLease:
    """The remote lease while the remote store answers, else the local one."""

    @property
    def expires(self) -> bool:
        """Whether the lease in use (see the class docstring) runs out unless renewed."""
        lease = self._held or self._current()
        return lease is not None and lease.expires

    def __init__(
        self, store: LayeredStore, key: str, remote: Lease | None, local: Lease | None
    ) -> None:
        self._store, self._key, self._remote, self._local = store, key, remote, local
        self._held: Lease | None = None

    def _current(self) -> Lease | None:
        store = self._store
        if (self._remote is not None and store.dead is None and store.unwritable is None
                and not store.read_only):  # (a read-only worker publishes nothing to wait on)
            return self._remote
        return self._local

    def acquire(self) -> bool:
        lease = self._current()
        if lease is None:
            return True  # nothing to coordinate with: compile
        if lease is self._remote:
            got = self._store._remote("lease a key in", lease.acquire, write=True)
            if got is _SKIPPED:
                return self.acquire()  # the remote store just failed: the local lease
        else:
            got = lease.acquire()
        if got:
            self._held = lease
        return bool(got)

    def renew(self) -> bool:
        lease = self._held
        if lease is None:
            return False
        if lease is self._remote:
            got = self._store._remote("renew a lease in", lease.renew, write=True)
            return got is _SKIPPED or bool(got)  # a dead remote: nobody else sees it either
        return lease.renew()

    def release(self) -> None:
        lease, self._held = self._held, None
        if lease is None:
            return
        if lease is self._remote:
            store = self._store

            def release() -> None:
                store._remote("release a lease in", lease.release, write=True)

            # the entry is still on its way to the remote store: other hosts keep waiting
            # for it until it lands (the uploader releases the lease then)
            if not store._release_after_upload(self._key, release):
                release()
        else:
            with contextlib.suppress(OSError):
                lease.release()
