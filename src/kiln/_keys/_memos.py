"""Values a trace got back from a memoising wrapper: keyed by what the memo held.

``functools.lru_cache`` and ``functools.cache`` return what an earlier call computed. When that
call ran before the trace (``load_coeffs()`` at start-up, reading ``coeffs.txt``), the trace
gets the value without running the body: the file it came from is read by no trace, so no
manifest item records it, and the wrapper's code, which the walk keys, says nothing of the
value (issue 43). So a :class:`MemoWatch` around the trace notes each user memo the walk
reached (:func:`user_memos`) whose hit count moved while tracing, and what that memo held when
the trace began: a manifest item ``[module, "<memo>", digest, qualname]``, re-checked on a warm
lookup against what the memo holds then (:func:`check_memo`). A memo the trace only filled
(its misses ran the body while recording: the reads were recorded) adds nothing.

What the memo holds is read through the garbage collector's view of the C wrapper
(``gc.get_referents``: the cache dict of ``functools.cache``; the keys and results of a bounded
``lru_cache``'s entries), each entry digested by value (:class:`kiln._keys._walk.Walker`) and
the digests sorted, so the order of recent use does not count. A memo that holds what has no
value makes the recording unkeyable (the verify path), never a guess.

A memo whose entries differ between processes although the program is the same (it also
caches what other calls in the process computed) misses, and is stored again: never stale.
``cached_property`` needs none of this: its value is in the instance's ``__dict__``, keyed with
the instance by the walk.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from typing import Any

import xxhash

from ._libraries import is_user_file
from ._walk import resolve_name, strict_digest

__all__ = ["MEMO", "MemoWatch", "check_memo", "user_memos"]

MEMO = "<memo>"
_WRAPPER = type(functools.lru_cache(maxsize=1)(lambda: None))


def user_memos(objects: Sequence[Any]) -> list[Any]:
    """The ``lru_cache`` / ``cache`` wrappers of user functions among ``objects`` (what a
    fingerprint's walk visited), once each."""
    out: dict[int, Any] = {}
    for o in objects:
        if type(o) is _WRAPPER:
            code = getattr(getattr(o, "__wrapped__", None), "__code__", None)
            if code is not None and is_user_file(code.co_filename):
                out.setdefault(id(o), o)
    return list(out.values())


def _held(memo: Any) -> list[Any]:
    """What ``memo`` holds: its cached keys and results (references, not copies)."""
    skip = (memo.__wrapped__, getattr(memo, "__dict__", None))
    out: list[Any] = []
    for r in gc.get_referents(memo):
        if isinstance(r, type) or type(r) is object or any(r is s for s in skip):
            continue
        if isinstance(r, dict):  # the cache: results by key (bounded: entries, seen apart)
            for k, v in r.items():
                out.append(k)
                if type(v).__name__ != "_lru_list_elem":
                    out.append(v)
            continue
        out.append(r)
    return out


def _digest(held: list[Any]) -> str:
    """Order-free digest of ``held``, each item by a strict walk.

    Raises:
        ValueError: an item has no value (its reason)."""
    parts = []
    for item in held:
        digest, reason = strict_digest("memo", item)
        if reason is not None:
            raise ValueError(reason)
        parts.append(digest)
    return xxhash.xxh3_128("".join(sorted(parts)).encode()).hexdigest()


class MemoWatch:
    """Around a trace: the user memos it got values from, as ``items`` after the block (see the
    module docstring); ``reason``, why one cannot be keyed (it holds what has no value, or
    cannot be found again by name), else None."""

    def __init__(self, memos: Sequence[Any]) -> None:
        self.memos = list(memos)
        self.items: list[list[str]] = []
        self.reason: str | None = None
        self._before: list[tuple[int, list[Any]]] = []

    def __enter__(self) -> MemoWatch:
        self._before = [(m.cache_info().hits, _held(m)) for m in self.memos]
        return self

    def __exit__(self, *exc: Any) -> None:
        for memo, (hits, held) in zip(self.memos, self._before, strict=True):
            if memo.cache_info().hits == hits:
                continue
            fn = memo.__wrapped__
            module, qualname = getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", "?")
            if resolve_name(module, qualname) is not memo:
                self.reason = self.reason or (
                    f"the trace got a value from the memo {module}.{qualname}, which cannot "
                    "be found again by name")
                continue
            try:
                self.items.append([module, MEMO, _digest(held), qualname])
            except ValueError as e:
                self.reason = self.reason or (
                    f"the trace got a value from the memo {module}.{qualname}, which holds "
                    f"what has no value: {e}")
        self._before = []


def check_memo(module: str, qualname: str, digest: str) -> str | None:
    """None if memo ``module.qualname`` holds what it held when the cold trace got a value
    from it, else what changed."""
    memo = resolve_name(module, qualname)
    if type(memo) is not _WRAPPER:
        return f"memo {module}.{qualname} no longer exists"
    try:
        now = _digest(_held(memo))
    except ValueError as e:
        return f"memo {module}.{qualname}: {e}"
    return None if now == digest else (
        f"the trace got a value from the memo {module}.{qualname} (lru_cache), which holds "
        "other values now")
