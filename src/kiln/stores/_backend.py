"""What the backends share: the key check, an entry's header read from its first bytes, the
least recently used entries to evict, a store URL without its password, and the live objects
called at exit."""

from __future__ import annotations

import atexit
import contextlib
import urllib.parse
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .._base import EntryError, is_key, peek_header, read_header

__all__ = ["HEADER_READ", "MIN_RATE", "called_at_exit", "check_key", "check_lease", "header_of",
           "redact_url", "to_evict"]

HEADER_READ = 1 << 16  # bytes read for a header before falling back to the whole blob
MIN_RATE = 1 << 20  # bytes per second: a write slower than this (beyond its timeout) is hung


def check_key(key: str) -> str:
    """``key``, when it is a key (lowercase hex); else ``ValueError``."""
    if not is_key(key):
        raise ValueError(f"store key must be lowercase hex, got {key!r}")
    return key


def check_lease(key: str, seconds: float) -> str:
    """``key``, for a lease of ``seconds`` on it; else ``ValueError``."""
    check_key(key)
    if not seconds > 0:
        raise ValueError(f"a lease lasts a positive number of seconds, got {seconds!r}")
    return key


def header_of(head: bytes | None, whole: Callable[[], bytes | None]) -> dict[str, Any] | None:
    """An entry's JSON header from ``head``, its first :data:`HEADER_READ` bytes, or from
    ``whole()`` (the whole blob) when the header is longer; ``None`` when there is no entry
    or it is not one."""
    if not head:
        return None
    try:
        return peek_header(head)
    except EntryError:
        if len(head) < HEADER_READ:
            return None
    return read_header(whole())


def to_evict(rows: Iterable[tuple[str, int]], total: int, max_size: int) -> list[str]:
    """The keys of ``rows`` (``(key, bytes)``, least recently used first) to evict so that
    ``total`` bytes come down to at most ``max_size``."""
    evicted: list[str] = []
    for key, size in rows:
        if total <= max_size:
            break
        evicted.append(key)
        total -= size
    return evicted


def redact_url(url: str) -> str:
    """``url`` without its password (in the authority or a ``password=`` query parameter).

    >>> redact_url("redis://me:secret@cache:6379/1")
    'redis://me@cache:6379/1'
    >>> redact_url("unix:///run/redis.sock?db=2&password=secret")
    'unix:///run/redis.sock?db=2'
    """
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(k.lower() == "password" for k, _ in query):
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{host}" if user else host
    kept = urllib.parse.urlencode([(k, v) for k, v in query if k.lower() != "password"])
    # by hand: urlunsplit drops the empty authority of unix:///path
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{kept}" if kept else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def called_at_exit(method: str) -> weakref.WeakSet[Any]:
    """A set of live objects (held weakly) whose ``method()`` is called at exit, each best-effort
    (an error is ignored). Registered now: a set made later has its calls run earlier."""
    live: weakref.WeakSet[Any] = weakref.WeakSet()

    def call_all() -> None:
        for obj in list(live):
            with contextlib.suppress(Exception):
                getattr(obj, method)()

    atexit.register(call_all)
    return live
