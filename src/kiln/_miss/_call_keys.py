"""What keys one call in the store: its named key parts (:class:`kiln._keys._key.KeyParts`),
the fingerprint of the function and of what shapes its trace (static values, pytree aux data),
and whether that fingerprint can key the call at all (else the verify path)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import _stats
from .._keys import (
    Fingerprint,
    KeyParts,
    _args,
    avals_text,
    fingerprint,
    make_key,
    static_digest_by_code,
    treedef_parts,
    watchable,
)
from ._call import Request

__all__ = ["CallKeys"]

# Static values whose digest is all there is to them (no code, no class behind them).
_DIGEST_IS_ALL = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic,
                  jax.Array)


@dataclasses.dataclass(frozen=True)
class CallKeys:
    """The keys of one call.

    Attributes:
        parts: the named key parts but the program's own.
        fp: the static walk of the function and the ``extra`` values that shape its trace.
        signature: the argument types and static digests as text (``float32[3]; static
            n=1a2b3c4d``), for explanations, entry headers and ``kiln ls``.
        unsound: why the fingerprint cannot key this call (the verify path), or None.
        watched: ``(static:<name>, value)`` of the static objects keyed by the fields their
            trace reads (:mod:`kiln._keys._static_reads`), for the trace to watch.
        reads: the fields each of those was keyed by here (None: its whole state).
    """

    parts: KeyParts
    fp: Fingerprint
    signature: str
    unsound: str | None
    watched: tuple[tuple[str, Any], ...] = ()
    reads: dict[str, tuple[str, ...] | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, request: Request,
           hint: Callable[[KeyParts], dict[str, Any] | None] | None = None) -> CallKeys:
        """The keys of ``request``'s call. ``hint``: given the key parts, the fields each
        watched static object's trace read last (the store's ``static-reads`` record,
        :meth:`reads_key`), or None: those objects are then keyed by their whole state."""
        call, options = request.call, request.options
        sigs = tuple(s for s in call.sigs if s is not _args.STATIC_LEAF)
        structure, extra = treedef_parts(call.treedef)
        signature = avals_text(sigs)
        statics = request.statics.all
        values = {_args.param_name(options.positional, where): value
                  for where, value in statics}
        leaf_paths = (_args.leaf_paths(options.positional, call.dyn_args, call.dyn_kwargs,
                                       statics) if request.statics.leaves else [])
        static_parts, static_text, watched = [], [], []
        for keyname, digest in call.static_key:
            value = values[keyname]
            if isinstance(keyname, str):
                name = keyname
            else:
                i = keyname[1]
                name = f"leaf {leaf_paths[i] if i < len(leaf_paths) else i}"
            if isinstance(digest, tuple):
                # callables are fingerprinted by code in the walk below; a value holding them
                # (a tuple of functions and tree structures: equinox's filter_jit statics under
                # the jax.jit swap) by its digest with those keyed by code; any other object
                # (a library's environment or strategy as static ``self``) by its class and
                # state, in the walk below (``Walker.static_value``: unsound, naming the
                # field, where that state holds what has no value)
                by_code = None if callable(value) else static_digest_by_code(value,
                                                                             argname=name)
                digest = by_code or "see-fingerprint"
            if not isinstance(value, _DIGEST_IS_ALL):
                # a static value is walked with the function's code, each one: a function's
                # code and closure, a dataclass's methods and class variables count too
                extra.append((f"static:{name}", value))
                if watchable(value):
                    # keyed in the walk by the fields its trace reads (a run id, a progress
                    # bar, a lock it holds and never reads do not count)
                    watched.append((f"static:{name}", value))
                    digest = "see-fingerprint"
            static_parts.append((name, str(digest)))
            static_text.append(
                f"{name}=(by code)" if digest == "see-fingerprint" else f"{name}={str(digest)[:8]}"
            )
        if static_text:
            signature += "; static " + ", ".join(static_text)
        parts = KeyParts.for_call(
            function=request.function, structure=structure, sigs=sigs,
            statics=static_parts, jit_options=options.jax_options,
            in_shardings=options.in_shardings, out_shardings=options.out_shardings,
            donated=request.donated, filter_jit=options.filter_jit,
        )
        reads: dict[str, tuple[str, ...] | None] = {name: None for name, _ in watched}
        asked = hint is not None and bool(watched)
        found = hint(parts) if hint is not None and watched else None
        _take_reads(reads, found)
        t0 = time.perf_counter()
        # a function whose arrays are a hidden first argument (filter_jit of a Module: its
        # leaves and structure are keyed as an argument's) counts by its class's code
        walked = type(request.fun) if options.traced_fun else request.fun
        fp = fingerprint(walked, extra=extra, reads=reads)
        if fp.watchable:
            # globals and a bound method's ``self`` that the walk met: keyed by the fields
            # their trace read where the record names them (walked again with those)
            if hint is not None and not asked:
                found = hint(parts)
            more: dict[str, tuple[str, ...] | None] = {n: None for n, _ in fp.watchable}
            _take_reads(more, found)
            watched += [(n, v) for n, v in fp.watchable if n not in reads]
            reads = {**more, **reads}
            if any(f is not None for f in more.values()):
                fp = fingerprint(walked, extra=extra, reads=reads)
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        return cls(parts, fp, signature, None if fp.sound else fp.reason, tuple(watched), reads)

    def reads_key(self) -> str:
        """The key of this call's ``static-reads`` record: the fields its watched static
        objects' trace read last (every key part but the program's own)."""
        return self.parts.key("static-reads", "")

    def fingerprint_key(self) -> str:
        """The key by the function's fingerprint (when it is sound)."""
        return self.parts.key("fingerprint", self.fp.digest)

    def alias_key(self) -> str:
        """The key of this call's alias entry: which fingerprint key holds the executable this
        function and signature last compiled, from which lowered module (every key part but
        the program's own)."""
        return self.parts.key("alias", "")

    def guards_key(self, key: str, guard: str) -> str:
        """The key of the record that the call under ``key`` was verified with the inputs of
        digest ``guard`` (``kiln._keys._guard``): which entry it runs with them, compiled from
        which module. One record per guard: processes that verify at once never overwrite
        each other's."""
        return make_key([("kind", "guard"), ("entry", key), ("guard", guard)])

    def guarded_key(self, key: str, guard: str) -> str:
        """The key of the entry the call under ``key`` compiled with the inputs of digest
        ``guard``, where they made another program than that entry's."""
        return make_key([("kind", "guarded"), ("entry", key), ("guard", guard)])

    def verify_key(self, digest: str, *, inlined: bool = False) -> str:
        """The key of the verify path: by the digest of the lowered module, or of the inlined
        one for an entry of tier-up's form (that form holds the noinline functions' code too)."""
        return self.parts.key("lowered-inlined" if inlined else "lowered", digest)


def _take_reads(reads: dict[str, tuple[str, ...] | None], found: dict[str, Any] | None) -> None:
    """Fill ``reads`` (name -> None) with the field names a ``static-reads`` record holds for
    each name (anything else in it is ignored: a record is a hint, never trusted)."""
    for name in reads:
        fields = (found or {}).get(name)
        if isinstance(fields, list | tuple) and all(isinstance(f, str) for f in fields):
            reads[name] = tuple(sorted(set(fields)))
