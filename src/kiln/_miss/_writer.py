"""Writing a store entry for one call: compile the program (lowered, or inlined), serialize the
executable (before its first run) and write the entry with its header; or, where it cannot be
stored, say why once and leave a marker."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any

from .._base import Entry, KilnWarning, StoreError, _jax_compat, _stats, encode
from .._keys import is_user_object, make_key, manifest_for
from .._travel import kiln_compiling
from ..stores import RemoteSkipped, Replaceable, Store, store_fault, user_stacklevel
from . import _noinline_p
from ._context import MissContext
from ._outputs import wrap_static_outputs
from ._program import arg_avals
from ._progress import compiling
from ._reader import Fact

__all__ = ["EntryWriter"]


class EntryWriter:
    """The compiles and store writes of one miss (``ctx``), which keeps nothing: a write is
    told whether to use the store's ``replace`` (a remote store's put keeps what it holds) and
    returns the (store, key) entries it wrote ([]: the store failed, warned about; None: the
    executable cannot be stored)."""

    def __init__(self, ctx: MissContext) -> None:
        self.cfg, self.store, self.request = ctx.cfg, ctx.store, ctx.request
        self.program, self.keys, self.explain = ctx.program, ctx.keys, ctx.explain

    def compiling(self) -> Any:
        """The progress line while this call's program compiles."""
        return compiling(f"{self.request.name} ({self.keys.signature})", self.cfg.progress)

    def compile_and_write(self, key: str, manifest: list[list[str]] | None, t_start: float, *,
                          replace: bool, alias: Fact, tier_up_candidate: bool,
                          ) -> tuple[Any, list[tuple[Store, str]] | None]:
        """Compile the lowered program and write it under ``key`` (``manifest`` None: keyed by
        the lowered module; ``alias``: what the miss knows of the alias key): the callable
        executable and the entries written (None: a not-storable marker, written instead)."""
        lowered = self.program.lower()
        # The header's facts (the lowered module's digest, the noinline calls) are Python work
        # XLA's compile does not wait on: computed on a thread while compile runs without the
        # GIL (~0.05 s of the Lotka-Volterra fit's cold start off the critical path).
        facts = threading.Thread(target=self._header_facts, name="kiln-header-facts",
                                 daemon=True)
        facts.start()
        t0 = time.perf_counter()
        try:
            with self.compiling(), kiln_compiling():
                compiled = _jax_compat.compile_to_store(
                    lowered, lambda: self.program.lowered_facts[0])
        finally:
            facts.join()
        compile_s = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        _stats.bump(misses=1, compiles=1, compile_seconds=total)
        result, sections, mode = self._serialize(compiled)
        if sections is None:
            self._put_not_storable(key, mode)
            return result, None
        header = self._header(mode, manifest, total, compile_s, *self.program.lowered_facts)
        if tier_up_candidate:
            header["tier"] = "noinline"  # replaced by its inlined form after a tier-up
        written = self.put(key, header, sections, replace=replace)
        if manifest is not None and not tier_up_candidate and self.request.same_program_alias:
            self.put_alias(key, alias, copies=0)
        return result, written

    def put_alias(self, key: str, known: Fact, *, copies: int, unstored: str | None = None) -> None:
        """Under the call's alias key (``CallKeys.alias_key``): the entry ``key`` holds what
        this function and signature compiled last, and from which lowered module. A later
        process whose fingerprint of the function differs but whose lowering is the same loads
        it instead of compiling (``_Miss._same_program``). ``copies``: how many times in a row
        it was stored again under a new fingerprint that way; ``unstored``: the last
        fingerprint key it was loaded for and not stored under (stored when it comes again).
        ``known``: what the miss knows of the alias key (KEEP: an alias this process cannot
        verify, signed with no key here, is left as it is)."""
        if Fact.KEEP in known:
            return
        header = {"kind": "alias", "function": self.request.function,
                  "signature": self.keys.signature, "lowered": self.program.lowered_facts[0],
                  "entry": key, "copies": copies, "created": time.time()}
        if unstored is not None:
            header["unstored"] = unstored
        # (an alias this miss read is replaced: EntryReader.alias; the mode reads it before
        # every compile that writes one)
        self.put(self.keys.alias_key(), header, {}, counted=False, replace=Fact.REPLACE in known)

    def put_same_program(self, key: str, manifest: list[list[str]], entry: Entry, *,
                         replace: bool) -> list[tuple[Store, str]] | None:
        """Store under ``key`` (this call's fingerprint key) the executable of ``entry``, an
        entry of this very program under another fingerprint, with what this process's trace
        gives and the lowered module does not hold (host callbacks bound to its objects, the
        output tree, non-array outputs)."""
        program = self.program
        assert program.traced is not None  # internal invariant: loaded after tracing
        try:
            sections, mode = _jax_compat.sections_for_trace(
                entry.sections, _jax_compat.host_callbacks(program.lower()),
                program.traced.out_tree, program.static_out(), program.input_objects(),
                live=self.keys.fp.objects, is_user=is_user_object, codes=self.keys.fp.codes)
        except _jax_compat.Unserializable as e:
            self.explain("same-program", f"not stored under this fingerprint: {e}")
            return None
        old = entry.header
        header = self._header(mode, manifest, float(old.get("compile_seconds", 0.0)),
                              float(old.get("xla_compile_seconds", 0.0)),
                              *program.lowered_facts)
        return self.put(key, header, sections, replace=replace)

    def same_outputs(self, entry: Entry) -> bool:
        """Whether ``entry`` (of this very lowered module) holds what this process's trace
        gives besides the module (the output tree, non-array outputs, how host callbacks are
        bound), so that a process with the same inputs may load it without tracing."""
        program = self.program
        try:
            sections, mode = _jax_compat.sections_for_trace(
                entry.sections, _jax_compat.host_callbacks(program.lower()),
                program.traced.out_tree if program.traced is not None else None,
                program.static_out(), program.input_objects(),
                live=self.keys.fp.objects, is_user=is_user_object, codes=self.keys.fp.codes)
        except _jax_compat.Unserializable:
            return False
        return (mode == entry.header.get("callbacks") and sections.keys() == entry.sections.keys()
                and all(sections[k] == entry.sections[k] for k in sections))

    def put_guard(self, key: str, entry_key: str) -> None:
        """Record under ``key`` (``CallKeys.guards_key``: this entry and guard) that with this
        process's inputs the call runs the entry under ``entry_key``, compiled from the module
        this process lowered."""
        guard = self.program.guard
        self.put(key, {"kind": "guard", "function": self.request.function,
                       "signature": self.keys.signature, "items": guard.items,
                       "entry": entry_key, "lowered": self.program.lowered_facts[0],
                       "created": time.time()},
                 {}, counted=False, replace=True)

    def compile_inlined_and_write(self, key: str | None, args: list[Any], t0: float, *,
                                  fingerprinted: bool, replace: bool,
                                  ) -> tuple[Any, list[tuple[Store, str]]]:
        """Compile the program with its noinline calls inlined, and write it (header ``tier:
        inlined``) under ``key``: the fingerprint key (``fingerprinted``: its manifest holds the
        noinline functions' code too), or on the verify path the inlined module's key (None:
        not written). ``args``: its abstract arguments. The callable executable, and the entries
        written."""
        program = self.program
        assert program.traced is not None  # internal invariant
        inlined_lowered = program.lower_inlined(args)
        want, got = arg_avals(program.traced), arg_avals(inlined_lowered)
        if want != got:  # never swap in or store an executable of another signature
            raise RuntimeError(f"inlined program takes {got}, the program {want}")
        with kiln_compiling():
            compiled = _jax_compat.with_out_tree(_jax_compat.compile_to_store(inlined_lowered),
                                                 program.traced.out_tree)
        seconds = time.perf_counter() - t0
        _stats.bump(compiles=1, compile_seconds=seconds)
        result, sections, mode = self._serialize(compiled)
        if sections is None or key is None:
            return result, []
        manifest = None
        if fingerprinted:
            # the inlined executable also depends on the noinline functions' own code
            codes, primitives = set(program.calls), list(program.primitives)
            for _, sub_jaxpr in _noinline_p.calls_in(program.traced.jaxpr.jaxpr):
                codes |= _jax_compat.codes_in_jaxpr(sub_jaxpr)
                primitives += _jax_compat.primitives_in(sub_jaxpr)
            manifest, reason = manifest_for(codes, self.keys.fp, program.imported,
                                            program.reads, program.read_reason,
                                            primitives=primitives,
                                            library_codes=codes - program.calls
                                            | program.emitted)
            if reason is not None:
                self.explain("tier-up", f"inlined program not stored: {reason}")
                return result, []
        # the digest of what was compiled: a warm process checks it (audit mode, callbacks
        # rebuilt by tracing) against its own inlined lowering
        header = self._header(mode, manifest, seconds, seconds, *program.inlined_facts)
        header["tier"] = "inlined"
        return result, self.put(key, header, sections, replace=replace)

    def _header_facts(self) -> None:
        with contextlib.suppress(Exception):  # raised again where the header reads them
            self.program.lowered_facts, self.program.called_names  # noqa: B018 - cached

    def _serialize(self, compiled: Any) -> tuple[Any, dict[str, bytes] | None, str]:
        """(the callable, its entry sections, callbacks mode), or (the callable, None, why it
        cannot be stored). Must run before the executable's first run (``serialize_compiled``)."""
        static_out = self.program.static_out()
        result = compiled if static_out is None else wrap_static_outputs(compiled, *static_out)
        try:
            inputs = self.program.input_objects()
            sections, mode = _jax_compat.serialize_compiled(
                compiled, inputs, live=self.keys.fp.objects, is_user=is_user_object,
                codes=self.keys.fp.codes)
            if static_out is not None:
                sections["static_out"] = _jax_compat.pickle_tree(static_out, inputs)
        except _jax_compat.Unserializable as e:
            self.explain("unstorable", f"executable not stored: {e}")
            self._not_stored(str(e), e.advice)
            return result, None, str(e)
        return result, sections, mode

    def _put_not_storable(self, key: str, reason: str) -> None:
        """Under the key this process just compiled and could not store (while it still holds
        the key's lease): a marker that lasts ``lease_seconds``. The processes waiting for the
        entry read it and compile at once, together, instead of taking the key over one after
        another (N waiters: N compiles in sequence). Once it has expired a process
        tries to store the executable again (another version of a library may manage)."""
        now = time.time()
        marker = {"kind": "not-storable", "function": self.request.function,
                  "signature": self.keys.signature, "reason": reason,
                  "created": now, "expires": now + self.cfg.lease_seconds}
        self.put(key, marker, {}, counted=False, replace=True)  # (over an expired marker)

    def _not_stored(self, reason: str, advice: str) -> None:
        """Never silent: a function whose executable cannot be stored warns once per
        process with the reason and what to do, and leaves a marker (kind ``unstorable``) that
        ``kiln stats`` and ``kiln ls`` list."""
        request = self.request
        if not request.not_stored.first():
            return
        warnings.warn(
            f"kiln: {request.name}: its executable is not stored ({reason}), so every process "
            f"compiles it again; {advice or 'KILN_EXPLAIN=1 says more'}",
            KilnWarning, stacklevel=user_stacklevel(),
        )
        function = request.function
        marker = {"kind": "unstorable", "function": function, "signature": self.keys.signature,
                  "reason": reason, "created": time.time()}
        key = make_key([("kind", "unstorable"), ("function", function)])
        try:
            self.store.put(key, encode({**marker, "key": key}, {},
                                       signing_key=self.cfg.signing_key))
        except (OSError, StoreError) as e:
            store_fault(self.store, "write to", e, strict=self.cfg.strict)

    def _header(
        self, mode: str, manifest: list[list[str]] | None, total: float, compile_s: float,
        lowered: str, lapack: bool,
    ) -> dict[str, Any]:
        """The header of an executable entry (``manifest`` None: keyed by the lowered module;
        ``lowered``, ``lapack``: the facts of the module it was compiled from)."""
        program = self.program
        header: dict[str, Any] = {
            "kind": "executable",
            "function": self.request.function,
            "signature": self.keys.signature,
            "key_parts": [list(p) for p in self.keys.parts.parts],
            "fp_parts": [list(p) for p in self.keys.fp.parts] if manifest is not None else [],
            "manifest": manifest or [],
            "callbacks": mode,
            "lowered": lowered,
            "lapack": lapack,
            "compile_seconds": total,
            "xla_compile_seconds": compile_s,
            "trace_seconds": program.trace_seconds,
            "created": time.time(),
        }
        if manifest is not None:
            # keyed by the fingerprint, used without a trace: only where the process's inputs
            # are as they were here (kiln._keys._guard), else verified first
            header["guard"] = program.guard.items
        if program.lower_warnings:
            header["warnings"] = program.lower_warnings  # replayed by every load (the reader)
        if program.called_names:
            header["noinline"] = program.called_names  # for `kiln ls`: the noinline functions
        return header

    def put(self, key: str, header: dict[str, Any], sections: dict[str, bytes], *,
            replace: bool, counted: bool = True) -> list[tuple[Store, str]]:
        """Write an entry (or a marker: ``sections`` empty) under ``key``, with the store's
        ``replace`` where ``replace`` says so: [(store, key)], or [] where it was not written."""
        blob = encode({**header, "key": key}, sections, signing_key=self.cfg.signing_key)
        write = self.store.put
        if replace and isinstance(self.store, Replaceable):
            write = self.store.replace  # (a remote store's put keeps what it holds)
        try:
            write(key, blob)
        except RemoteSkipped:
            return []  # (a remote-only store skipped since its fault, warned about then)
        except (OSError, StoreError) as e:
            store_fault(self.store, "write to", e, strict=self.cfg.strict)
            return []
        if counted:
            _stats.bump(stores_written=1)
        return [(self.store, key)]
