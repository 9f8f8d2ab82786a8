"""kiln's counters for this process: :func:`stats`, :func:`reset_stats`, and :func:`bump` for
the modules that count. Per-function hot-path counters register a reader here
(:func:`register_hot_counter`), so this module imports nothing of kiln's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["Stats", "stats", "reset_stats", "bump", "count_reason", "register_hot_counter"]

@dataclasses.dataclass
class Stats:
    """Counters for this process (all functions together).

    Attributes:
        calls_hot: calls served by kiln's Python in-process table (functions with static
            arguments, and first calls); calls dispatched by the C++ fast path, as ``jax.jit``
            dispatches them, are not counted.
        hits: persistent hits (executable loaded from the store; no compile).
        misses: persistent misses (compiled).
        traces: times a function body was traced by kiln.
        compiles: XLA compiles kiln ran.
        compile_seconds: seconds spent tracing + lowering + compiling on misses.
        saved_seconds: compile seconds recorded in the entries that were loaded instead.
        load_seconds: seconds spent loading (deserializing) entries (kiln.jit's; the eager
            work's count in ``eager_seconds``).
        read_seconds: seconds spent reading kiln's entries from the store (before they are
            checked and loaded; misses included).
        fingerprint_seconds: seconds spent fingerprinting functions (the static walk before a
            store lookup, building a manifest after a cold trace, re-checking one on a hit).
        verifies: warm lookups whose key matched and whose guard did not (an input of the
            process differs from the writer's: a file, a variable user code read, the command
            line, ...), so the function was traced, lowered and compared with the entry once
            (a hit when the module is the same, a compile when not); a guard verified so is
            remembered, and the next run with the same inputs traces nothing.
        guard_seconds: seconds spent checking entries' guards (the inputs of the process).
        bad_entries: corrupt / foreign / tampered entries seen (each replaced).
        store_errors: failures of the store itself (I/O errors, a full or read-only disk, its
            index, a refused directory); the first per store gives a ``StoreWarning``.
        stores_written: entries written.
        noinline_calls: host round trips into :func:`kiln.noinline` executables (one per call
            site executed, while a program runs in its not-inlined form).
        tier_ups: inlined programs compiled in the background and swapped in (tier-up).
        jax_cache_hits, jax_cache_misses: JAX's own persistent-cache lookups (its
            ``jax.monitoring`` events), counted while the ``kiln://`` route is on
            (:func:`kiln.enable_jax_cache`). JAX counts a miss where it writes the value, so
            kiln's own compiles (kept in kiln's entries, never written by JAX) are not misses.
        jax_cache_writes: values JAX's cache wrote into kiln's store through the route.
        jax_cache_read_seconds: seconds the route spent reading and checking values JAX's cache
            asked for (hits and misses).
        jax_cache_load_seconds: seconds JAX spent retrieving its hits through the route (its
            ``/jax/compilation_cache/cache_retrieval_time_sec``: the route's read, then JAX's
            decompress and deserialize).
        jax_lowerings, jax_lower_seconds: programs JAX lowered to MLIR itself, and the seconds
            it spent on it (its ``/jax/core/compile/jaxpr_to_mlir_module_duration``, one per
            program, never nested), counted while the route is on: what a warm run still pays
            for every eager operation and every ``jax.jit`` that :func:`kiln.jit` does not
            cover (JAX's own jits, jits kept by ``kiln.keep_jax_jit``) before JAX's cache can
            look its key up; kiln.jit's own lowerings (misses, the verify path) count too.
            Tracing is not counted (JAX times nested traces inside outer ones).
        remote_hits, remote_misses: lookups a remote store (Redis, an object store) answered
            with an entry / without one (the local store had none).
        remote_timeouts, remote_errors: remote store operations that got no answer in
            ``remote_timeout`` seconds / that failed otherwise (down, full, read-only,
            rate-limited). The first of either skips the remote store for the rest of the
            process.
        lease_waits: misses that waited for another process compiling the same key
            (single-flight) instead of compiling.
        lease_takeovers: of those, the waits that ended by taking the key over (the other
            process's lease ran out: it died, or gave up without writing the entry).
        eager_hits, eager_misses, eager_writes: JAX's eager work under the ``jax.jit`` swap
            (its own jitted functions and primitives applied outside a trace,
            ``kiln._travel._eager``): first calls of a signature answered from the store (no
            trace, no lowering, no compile), not found there (JAX compiled them), and entries
            written for them.
        eager_seconds: seconds kiln spent on those first calls before JAX or the stored
            executable ran them: keying, reading and loading (JAX's own compile of a miss
            does not count).
        eager_left: eager calls left to JAX's own path (not plain data, a monkeypatched JAX, ...;
            ``KILN_EXPLAIN=1`` says why, once per function and reason).
        reasons: count of miss reasons by kind.
    """

    calls_hot: int = 0
    hits: int = 0
    misses: int = 0
    traces: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    saved_seconds: float = 0.0
    load_seconds: float = 0.0
    read_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    verifies: int = 0
    guard_seconds: float = 0.0
    bad_entries: int = 0
    store_errors: int = 0
    stores_written: int = 0
    noinline_calls: int = 0
    tier_ups: int = 0
    jax_cache_hits: int = 0
    jax_cache_misses: int = 0
    jax_cache_writes: int = 0
    jax_cache_read_seconds: float = 0.0
    jax_cache_load_seconds: float = 0.0
    jax_lowerings: int = 0
    jax_lower_seconds: float = 0.0
    remote_hits: int = 0
    remote_misses: int = 0
    remote_timeouts: int = 0
    remote_errors: int = 0
    lease_waits: int = 0
    lease_takeovers: int = 0
    eager_hits: int = 0
    eager_misses: int = 0
    eager_writes: int = 0
    eager_seconds: float = 0.0
    eager_left: int = 0
    reasons: Counter[str] = dataclasses.field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["reasons"] = dict(self.reasons)
        return d


_stats = Stats()
_lock = threading.Lock()
_hot_offset = 0  # _hot_calls() at the last reset_stats
_hot_counters: list[Callable[[], int]] = []


def stats() -> Stats:
    """A snapshot of this process's counters (see :class:`Stats`)."""
    with _lock:
        return dataclasses.replace(
            _stats, calls_hot=_hot_calls() - _hot_offset, reasons=Counter(_stats.reasons)
        )


def reset_stats() -> None:
    """Zero the counters."""
    global _stats, _hot_offset
    with _lock:
        _stats = Stats()
        _hot_offset = _hot_calls()


def bump(**kwargs: float) -> None:
    with _lock:
        for name, value in kwargs.items():
            setattr(_stats, name, getattr(_stats, name) + value)


def register_hot_counter(read: Callable[[], int]) -> None:
    """Add a reader of calls served from an in-process table (summed into ``calls_hot``)."""
    _hot_counters.append(read)


def _hot_calls() -> int:
    return sum(read() for read in _hot_counters)


def count_reason(kind: str) -> None:
    """Count one miss reason of ``kind`` (see ``kiln._miss._explain.explain``)."""
    with _lock:
        _stats.reasons[kind] += 1
