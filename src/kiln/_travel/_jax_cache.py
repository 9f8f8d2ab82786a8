"""JAX's own persistent compilation cache, kept in kiln's store: the ``kiln://`` route.

Code that calls ``jax.jit`` itself (libraries, eager operations, scripts nobody changed) gets
persistence through JAX's supported configuration: ``jax_compilation_cache_dir`` is set to
``kiln://store``, a path scheme registered with ``etils.epath.register_path_cls``. With
``jax_compilation_cache_max_size`` at -1 (JAX never evicts), JAX's cache
(``jax._src.lru_cache.LRUCache``) calls only ``mkdir``, ``exists``, ``read_bytes`` and
``write_bytes`` on such a path. Each value JAX writes becomes a kiln entry of kind
``jax-cache``: its digest (or ``KILN_SIGNING_KEY`` signature) is checked before a byte is
decoded, it is written atomically, counted in the store's size cap and LRU order, listed by
``kiln ls`` as ``jax:<module name>``, checked by ``kiln verify``, and counted in
:func:`kiln.stats`. A corrupt, foreign or tampered entry reads as absent: JAX compiles and
writes it again. Problems are logged (logger ``kiln``, WARNING), never raised as warnings: this
code runs inside JAX's cache, where a warning made an error by the user's filters would stop the
call.

Single-flight: when a read misses, the reading thread takes the key's lease before JAX
compiles (it is held until JAX writes the value, or shortly after XLA's compile when JAX does
not write it); another process missing the same key meanwhile waits for the value instead of
compiling it too (:class:`kiln.stores.Leasable`; counted in ``lease_waits``).

In a ``jax.distributed`` job every process writes what it compiled (JAX's own cache is
written by process 0 only; a program only another process compiles, its eager work on its own
devices, would be compiled there in every run:
:func:`kiln._base._jax_compat.write_from_every_process`).

JAX decides what it caches: jax 0.10 never writes an executable that holds host callbacks
(``jax.debug.print``, ``io_callback``, equinox's runtime checks); jax 0.11 and later write
them. kiln's own compiles (:func:`kiln.jit`) skip the route's writes: kiln stores those
executables itself.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jaxlib

import kiln_early

from .._base import (
    FORMAT_VERSION,
    EntryError,
    KilnError,
    StoreError,
    UnverifiableEntry,
    _jax_compat,
    _stats,
    get_config,
    set_in_thread,
    short_key,
)
from .._keys import machine, make_key
from ..stores import (
    Held,
    Leasable,
    await_or_lease,
    open_store,
    reporting,
)
from ._entries import decode_kind, read_blob, write_entry

__all__ = ["ROOT", "SCHEME", "disable_jax_cache", "enable_by_default", "enable_jax_cache",
           "is_enabled", "kiln_compiling", "store_key"]

logger = logging.getLogger("kiln")

SCHEME = "kiln://"
ROOT = SCHEME + "store"
_SUFFIX = "-cache"  # JAX names a value "<key>-cache" (and "<key>-atime" when it evicts)
_KIND = "jax-cache"
_last_key = ("", "", "")  # (jax_key, machine, store key) of the last store_key call

_local = threading.local()  # .own: inside kiln's own compile; .last: (name, value) just read
# store keys found unusable in this process, until JAX writes them again: JAX's put asks
# ``exists`` right after its get missed, and one bad entry is one warning
_unusable: set[str] = set()
_registered = False
_turned_off = False  # disable_jax_cache was called: kiln.jit does not turn the route on again
_enable_lock = threading.Lock()
_saved: dict[str, Any] = {}  # JAX's settings before the route, put back by disable_jax_cache
_SETTINGS = {  # what the route sets (see enable_jax_cache)
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_enable_xla_caches": "none",
    "jax_compilation_cache_max_size": -1,
    "jax_compilation_cache_dir": ROOT,
}


def store_key(jax_key: str) -> str:
    """The store key (64 hex characters) of the value JAX caches under ``jax_key``, on this
    kind of machine: JAX's key holds no CPU features, kiln's store key does."""
    global _last_key
    kind = machine()
    last = _last_key
    if last[0] == jax_key and last[1] == kind:
        return last[2]  # (a miss asks three times: JAX's get, its put's exists, the write)
    key = make_key([("format", str(FORMAT_VERSION)), ("kind", _KIND), ("machine", kind),
                    ("jax-key", jax_key)])
    _last_key = (jax_key, kind, key)
    return key


@contextlib.contextmanager
def kiln_compiling() -> Iterator[None]:
    """Around kiln's own XLA compiles: JAX's cache may still read through the route, but
    writes nothing (kiln stores the executable in its own entry), and does not serialize the
    executable for that write either (:func:`kiln._base._jax_compat.no_persistent_cache_writes`)."""
    with set_in_thread(_local, "own", True, unset=False), _jax_compat.no_persistent_cache_writes():
        yield


class StorePath:
    """A path under ``kiln://``: the store itself, or one value JAX caches in it."""

    def __init__(self, *parts: str | os.PathLike[str]) -> None:
        self._text = "/".join(os.fspath(p).rstrip("/") for p in parts)

    def __fspath__(self) -> str:
        return self._text

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"StorePath({self._text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)

    def __truediv__(self, other: str | os.PathLike[str]) -> StorePath:
        return StorePath(self._text, other)

    def joinpath(self, *others: str | os.PathLike[str]) -> StorePath:
        return StorePath(self._text, *others) if others else self

    @property
    def name(self) -> str:
        return self._text.rpartition("/")[2]

    def mkdir(self, parents: bool = False, exist_ok: bool = False, mode: int = 0o777) -> None:
        """Nothing to make: the store exists once opened."""

    def exists(self) -> bool:
        return self._value() is not None

    def read_bytes(self) -> bytes:
        value = self._value()
        if value is None:
            raise FileNotFoundError(f"{self._text}: no such entry in kiln's store")
        return value

    def write_bytes(self, data: bytes) -> int:
        jax_key = _jax_key(self.name)
        if jax_key is not None and not getattr(_local, "own", False):
            with reporting(logger.warning), _never_raises("write"):  # inside JAX's cache
                _write(jax_key, bytes(data))
        return len(data)

    def _value(self) -> bytes | None:
        """The value stored at this path (JAX's ``get`` asks ``exists`` then ``read_bytes``:
        one store read serves both)."""
        last = getattr(_local, "last", None)
        if last is not None and last[0] == self._text:
            _local.last = None
            return last[1]  # type: ignore[no-any-return]
        jax_key = _jax_key(self.name)
        value = None
        t0 = time.perf_counter()
        with reporting(logger.warning), _never_raises("read"):  # inside JAX's cache
            value = None if jax_key is None else _read(jax_key)
        _stats.bump(jax_cache_read_seconds=time.perf_counter() - t0)
        _local.last = (self._text, value) if value is not None else None
        return value


_logged: set[str] = set()  # configuration problems the route logged (once each)


@contextlib.contextmanager
def _never_raises(doing: str) -> Iterator[None]:
    """kiln's own errors (a bad setting, a store that cannot be opened) stay out of JAX's
    cache: logged once each (the next kiln.jit call raises them where the user sees them);
    JAX then compiles as if the cache missed."""
    try:
        yield
    except KilnError as e:
        text = f"kiln: JAX cache route cannot {doing} ({e}); JAX compiles without it"
        if text not in _logged:
            _logged.add(text)
            logger.warning("%s", text)


def _jax_key(name: str) -> str | None:
    return name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) and len(name) > len(_SUFFIX) else None


def _read(jax_key: str) -> bytes | None:
    cfg = get_config()
    store = open_store(cfg)
    key = store_key(jax_key)
    if _holds(key):
        # JAX's put asks ``exists`` before it writes the value this thread compiled under the
        # key's lease: nobody else wrote it meanwhile (they wait for the lease), and the lease
        # must stay held until the write, or a waiting process could take it in between, find
        # nothing, and compile the same program again
        return None
    value = _read_value(store, key, jax_key, cfg)
    if value is None and not getattr(_local, "own", False):
        value = _await_or_lease(store, key, jax_key, cfg)
    return value


def _read_value(store: Any, key: str, jax_key: str, cfg: Any) -> bytes | None:
    """The value JAX cached under ``key``, or None (absent, unreadable, unusable)."""
    blob = read_blob(store, key, strict=cfg.strict, unusable=_unusable)
    if blob is None:
        return None
    try:
        value = decode_kind(blob, key, _KIND, cfg).sections["jax"]
    except (EntryError, KeyError) as e:
        if not isinstance(e, UnverifiableEntry):  # (a signed entry this process cannot check
            _unusable.add(key)                    # is left alone: never replaced)
        _stats.bump(bad_entries=1)
        # logged, not warned: this runs inside JAX's cache, where a warning turned into an
        # error (pytest's filterwarnings = error) would fail the user's call before the
        # recompile that replaces the entry
        logger.warning("kiln: JAX cache entry %s (%s) in %r is unusable (%s); JAX compiles it "
                       "again and kiln replaces it", short_key(key), _module_name(jax_key),
                       store.url, e)
        return None
    return value  # type: ignore[no-any-return]


# the lease this thread holds while JAX compiles the key it just missed: (store key, Held)
_held = threading.local()


def _holds(key: str) -> bool:
    """This thread holds ``key``'s lease (it missed the key and JAX is compiling it)."""
    held = getattr(_held, "item", None)
    return held is not None and held[0] == key


def _release_held(key: str | None = None) -> None:
    """Give up this thread's lease (only if it is on ``key``, when given)."""
    held = getattr(_held, "item", None)
    if held is not None and (key is None or held[0] == key):
        _held.item = None
        held[1].release()


def _await_or_lease(store: Any, key: str, jax_key: str, cfg: Any) -> bytes | None:
    """After a miss: take the key's lease (JAX compiles it next, and its write releases the
    lease), or, while another process holds it, wait for its value (bounded by
    ``lease_wait``; taken over when the holder's lease runs out). The value, or None."""
    _release_held()
    if key in _unusable or not isinstance(store, Leasable):
        return None  # (an unusable entry: JAX writes it again, nothing to wait for)
    try:
        lease = store.lease(key, cfg.lease_seconds)
    except (OSError, StoreError, ValueError):
        return None

    def look() -> tuple[bool, bytes | None]:
        value = _read_value(store, key, jax_key, cfg)
        return value is not None, value

    try:
        flight = await_or_lease(lease, look, seconds=cfg.lease_seconds, wait=cfg.lease_wait)
    except (OSError, StoreError):
        return None
    if flight.held:
        _held.item = (key, Held(lease, cfg.lease_seconds))
    elif flight.waited and flight.found is None:
        logger.debug("kiln: stopped waiting for %s (JAX cache)", _module_name(jax_key))
    return flight.found  # type: ignore[no-any-return]


def _write(jax_key: str, value: bytes) -> None:
    cfg = get_config()
    store = open_store(cfg)
    key = store_key(jax_key)
    header: dict[str, Any] = {
        "kind": _KIND,
        "key": key,
        "function": f"jax:{_module_name(jax_key)}",
        "signature": "-",
        "jax_key": jax_key,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "machine": machine(),
        "created": time.time(),
    }
    try:
        written = write_entry(store, key, header, {"jax": value}, cfg, strict=cfg.strict,
                              unusable=_unusable)
    finally:
        _release_held(key)
    if written:
        _stats.bump(jax_cache_writes=1)


def _module_name(jax_key: str) -> str:
    """``jit_fit-0f3a...`` -> ``jit_fit``: JAX's key is the module name, '-', a hash."""
    return jax_key.rpartition("-")[0] or jax_key


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    """After XLA's compile in a thread holding a route lease: JAX writes the value next, or
    never (an executable it does not cache); release the lease shortly in either case. And
    JAX's retrieval time of a hit, and its lowerings, counted while the route is on."""
    if event == _RETRIEVAL:
        if is_enabled():
            _stats.bump(jax_cache_load_seconds=duration_secs)
        return
    if event == _LOWER:
        if is_enabled():
            _stats.bump(jax_lowerings=1, jax_lower_seconds=duration_secs)
        return
    if event != _BACKEND_COMPILE or getattr(_held, "item", None) is None:
        return
    key = _held.item[0]
    delay = max(2.0, duration_secs)
    _release_later(_held.item[1], delay)
    logger.debug("kiln: route lease on %s released within %.1f s", short_key(key), delay)


_due: list[tuple[float, int, Held]] = []  # (monotonic deadline, tie-break, lease): a heap
_due_changed = threading.Condition()
_releaser: threading.Thread | None = None


def _release_later(held: Held, delay: float) -> None:
    """Release ``held`` in ``delay`` seconds (idempotent: JAX's write may release it first),
    on one daemon thread for the process (a ``threading.Timer`` a miss cost a thread start)."""
    global _releaser
    with _due_changed:
        heapq.heappush(_due, (time.monotonic() + delay, id(held), held))
        if _releaser is None or not _releaser.is_alive():
            _releaser = threading.Thread(target=_release_due, name="kiln-route-leases",
                                         daemon=True)
            _releaser.start()
        _due_changed.notify()


def _release_due() -> None:
    while True:
        with _due_changed:
            while not _due or _due[0][0] > time.monotonic():
                _due_changed.wait(_due[0][0] - time.monotonic() if _due else None)
            held = heapq.heappop(_due)[2]
        held.release()


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one per program JAX lowers


def _on_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _stats.bump(jax_cache_hits=1)
    elif event == "/jax/compilation_cache/cache_misses":
        _stats.bump(jax_cache_misses=1)


def is_enabled() -> bool:
    """Whether JAX's persistent cache is routed to kiln's store in this process."""
    return str(_cache_dir() or "").startswith(SCHEME)


def _cache_dir() -> str | None:
    return getattr(jax.config, "jax_compilation_cache_dir", None)


def enable_jax_cache() -> bool:
    """Route JAX's own persistent compilation cache into kiln's store, for every ``jax.jit``
    in this process (libraries, eager operations, unchanged code).

    Sets ``jax_compilation_cache_dir`` to ``kiln://store`` (the store kiln is configured with,
    looked up at each read and write), ``jax_persistent_cache_min_compile_time_secs`` to 0
    (sub-second compiles are kept: a process's many small ones add up),
    ``jax_persistent_cache_enable_xla_caches`` to ``"none"`` (XLA's own caches would be handed
    a ``kiln:`` path) and ``jax_compilation_cache_max_size`` to -1 (kiln's store evicts). May be
    called at any time: JAX's cache is reset, so later compiles use the route.

    Returns:
        True if the route is on. False, leaving JAX's configuration alone, when the user set
        their own ``jax_compilation_cache_dir`` (or ``JAX_COMPILATION_CACHE_DIR``), or when
        ``etils`` (``etils[epath]``) is not installed (with a warning).
    """
    global _registered, _turned_off
    with _enable_lock:
        _turned_off = False
        if is_enabled():
            return True
        if _cache_dir():
            logger.debug("kiln: jax_compilation_cache_dir is set by the user; route not used")
            return False
        if not _registered:
            try:
                from etils import epath
            except ImportError:
                warnings.warn(
                    "kiln: JAX's persistent cache cannot be routed to kiln's store without "
                    "etils (pip install 'etils[epath]'); plain jax.jit code compiles as before",
                    stacklevel=2,
                )
                return False
            epath.register_path_cls(SCHEME)(StorePath)
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            # each process of a jax.distributed job writes what it compiled (JAX: process 0)
            _jax_compat.write_from_every_process(is_enabled)
            _registered = True
        for name, value in _SETTINGS.items():
            _saved[name] = getattr(jax.config, name)
            jax.config.update(name, value)
        _jax_compat.reset_compilation_cache()
        return True


def disable_jax_cache() -> None:
    """Undo :func:`enable_jax_cache`: JAX's cache settings as they were before it (entries
    already written stay in the store), for the rest of the process: a later :func:`kiln.jit`
    does not turn the route on again (:func:`enable_jax_cache` does). Does nothing to JAX's
    settings when the route is off."""
    global _turned_off
    with _enable_lock:
        _turned_off = True
        if not is_enabled():
            return
        for name, value in _saved.items():
            jax.config.update(name, value)
        _saved.clear()
        _jax_compat.reset_compilation_cache()


def enable_at_import() -> None:
    """The route from ``import kiln`` on, unless ``KILN_JAX_CACHE=0`` or the user set
    their own ``jax_compilation_cache_dir``: what a script compiles before its first
    :func:`kiln.jit` exists (drawing data, initialising a model: eager operations and library
    ``jax.jit`` calls) is cached too, as JAX's cache configured from the environment would be.
    Never raises: a cache must not stop ``import kiln``."""
    try:
        if _turned_off or is_enabled() or not get_config().jax_cache:
            return
        enable_jax_cache()
    except Exception as e:  # noqa: BLE001 - a cache: never stop the program over it
        logger.debug("kiln: JAX cache route not enabled at import: %s", e)


def enable_by_default() -> None:
    """The route for a process that uses :func:`kiln.jit`, unless ``KILN_JAX_CACHE=0`` or the
    user set their own ``jax_compilation_cache_dir``. The program's next run turns the route on
    before its first compile, wherever it imports kiln (``kiln_early``)."""
    kiln_early.remember()
    cfg = get_config()
    if cfg.store and "://" in cfg.store and not cfg.signing_key:
        # the unsigned-shared-store notice as a warning here, where the user's code creates a
        # kiln.jit function: inside JAX's cache (the route's first read) it could only be logged
        with contextlib.suppress(OSError, KilnError):
            open_store(cfg)
    enable_at_import()  # the same opt-outs; a no-op once the route is on
