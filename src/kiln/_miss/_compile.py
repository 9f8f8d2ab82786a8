"""The miss path of one call of a kiln function: key it, load its entry from the store, or
(single-flight with other processes) trace, lower, compile and write it; and which form of a
program that calls noinline functions is compiled when (``_tier_up.Policy``).

One :class:`_Miss` per in-process miss of one signature. It takes one record of what it reads
of the function and the call (:class:`Request`, made by ``kiln._jit._function.JitFunction``;
the miss path never imports ``_jit``) and :meth:`_Miss.run` returns one :class:`Result` (the
executable, the entries it loaded or wrote, the tier-up to start, why it took the verify path).
It is made of: :class:`CallKeys` (the keys), :class:`Program` (the trace and its lowerings, see
``_program`` for the words), an :class:`EntryReader` and an :class:`EntryWriter` (reading one
:class:`MissContext`, returning what they found or wrote: the miss keeps what its reads find out
per key), and a tier-up ``Policy``, whose ``Plan`` says which form compiles when.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .._base import StoreError, _stats, get_config, short_key
from .._keys import check_guard, manifest_for
from ..stores import Held, Leasable, Lease, Store, await_or_lease, open_store
from . import _tier_up
from ._call import Request
from ._call_keys import CallKeys
from ._context import MissContext
from ._explain import Explainer
from ._program import Program, structs
from ._progress import compiling
from ._reader import EntryReader, Fact, Loaded, Outcome, read_records
from ._writer import EntryWriter

logger = logging.getLogger("kiln")

_MANIFEST_UNSOUND = "manifest could not be fingerprinted (recorded on the first run)"
# how many times in a row a new fingerprint of an unchanged program is stored (_same_program)
_SAME_PROGRAM_COPIES = 2
# how many read sets of a static object a static-reads record keeps (_Miss._rekey_by_reads)
_READ_SETS = 4


def _holding(lease: Lease | None, seconds: float) -> contextlib.ExitStack:
    """Hold ``lease`` (if any) for the block (see :class:`kiln.stores.Held`)."""
    holding = contextlib.ExitStack()
    if lease is not None:
        holding.callback(Held(lease, seconds).release)
    return holding


@dataclasses.dataclass(frozen=True)
class Result:
    """What one miss gives the function's table (:meth:`_Miss.run`).

    Attributes:
        executable: the callable executable, loaded or compiled (or the flat jax.jit itself,
            for a trace jax.jit must run: ``_Miss._jax_runs_it``).
        entries: (store, key) of the executable entries the miss loaded or wrote: what a kiln
            function pickled by value carries with it (a tier-up started adds its own later).
        verify_reason: why the call took the verify path; None: keyed by its fingerprint.
        tier_up: the tier-up to start once ``executable`` is in the table
            (:func:`_tier_up.start`), or None.
    """

    executable: Any
    entries: list[tuple[Store, str]]
    verify_reason: str | None
    tier_up: _tier_up.Plan | None


class _Miss:
    """One in-process miss of ``request``'s call: load from the store or compile, then store."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.cfg = cfg = get_config()
        self.store: Store = open_store(cfg)
        call = request.call
        # (made right before the keys: the modules the fingerprint's static walk can see)
        self.program = Program(request.name, request.jitted, call.leaves, request.box,
                               call.treedef, request.statics.all, cfg)
        # the read sets of the static-reads record found (None: no record)
        self._hint_read: list[dict[str, Any]] | None = None
        self.keys = CallKeys.of(request, hint=self._static_reads_hint)
        self.program.watched = self.keys.watched
        self.unsound = self.keys.unsound  # why this call takes the verify path, or None
        self.explain = Explainer(request.name, cfg.explain)
        self.policy = _tier_up.Policy(self.program, cfg.tier_up, request.may_tier_up,
                                      self.explain)
        self.ctx = MissContext(request, cfg, self.store, self.program, self.keys, self.explain)
        self.reader, self.writer = EntryReader(self.ctx), EntryWriter(self.ctx)
        self.fp_key: str | None = None
        self.inlined_key: str | None = None  # the verify path's key of the inlined form
        self._manifest_made: tuple[list[list[str]], str | None] | None = None
        self._facts = collections.defaultdict[str, Fact](lambda: Fact.NONE)  # what reads found
        self._entries: list[tuple[Store, str]] = []  # executable entries loaded or written
        self._plan: _tier_up.Plan | None = None  # the last tier-up plan made (Policy.plan)

    # -- static objects keyed by the fields their trace read (kiln._keys._static_reads) -----
    def _static_reads_hint(self, parts: Any) -> dict[str, Any] | None:
        """The first of the read sets in the ``static-reads`` record under ``parts``' key
        (``CallKeys.reads_key``, :func:`read_records`; :meth:`_other_read_sets` tries the
        others), or None."""
        self._hint_read = read_records(self.store, self.cfg, parts.key("static-reads", ""),
                                       "static-reads", "reads")
        return self._hint_read[0] if self._hint_read else None

    def _other_read_sets(self) -> Loaded | None:
        """A hit under one of the record's other read sets (a read set that depends on the
        values: ``if self.use_bias: ... self.bias``), adopting its keys; None if none hits."""
        for reads in (self._hint_read or [])[1:]:
            keys = CallKeys.of(self.request, hint=lambda _: reads)  # noqa: B023 - called here
            if keys.unsound is not None or keys.reads == self.keys.reads:
                continue
            with self.explain.quietly():
                got = self._load(keys.fingerprint_key())
            if got.outcome is Outcome.HIT:
                self._use_keys(keys)
                return got
        return None

    def _use_keys(self, keys: CallKeys) -> None:
        self.ctx = dataclasses.replace(self.ctx, keys=keys)
        self.reader, self.writer = EntryReader(self.ctx), EntryWriter(self.ctx)
        self.keys = keys
        self.fp_key = None if keys.unsound is not None else keys.fingerprint_key()

    def _rekey_by_reads(self) -> str | None:
        """After a trace: where a watched static object's trace read other fields than its
        keys assumed, the keys by what it read, in use from here on, and the record of those
        fields written for later processes (the last ``_READ_SETS`` read sets, most recent
        first). Returns the new fingerprint key (None: unchanged, or no longer sound)."""
        reads = self.program.static_reads
        if not self.keys.watched or not reads or reads == self.keys.reads:
            return None
        self._use_keys(CallKeys.of(self.request, hint=lambda _: reads))
        keys = self.keys
        stored = {name: list(f) for name, f in reads.items() if f is not None}
        sets = [stored] + [r for r in self._hint_read or [] if r != stored][:_READ_SETS - 1]
        if stored and sets != self._hint_read:
            self.writer.put(keys.reads_key(), {
                "kind": "static-reads", "function": self.request.function,
                "signature": keys.signature, "reads": sets, "created": time.time()},
                {}, counted=False, replace=self._hint_read is not None)  # (create-only remote)
            self._hint_read = sets
        self.explain("static-reads", "static objects keyed by the fields their trace read: "
                     + "; ".join(f"{n.removeprefix('static:')}: "
                                 + (", ".join(f) if f is not None else "(all)")
                                 for n, f in reads.items()))
        return self.fp_key

    def lower(self) -> Any:
        """The call's program lowered (``jax.stages.Lowered``), as compiling it would."""
        return self.program.lower()

    # -- the flow -----------------------------------------------------------------------------
    def run(self, memory_reason: Callable[[], tuple[str, str] | None] | None = None) -> Result:
        """Load or compile the call's executable, and store it.

        ``memory_reason``: (kind, message) saying why the call missed the process's table,
        asked only when explanations are wanted; said when the store misses too, or at once
        for kind ``re-created`` (costly even when the store hits)."""
        if self.explain.wanted and memory_reason is not None:
            reason = self.explain.memory_reason = memory_reason()
            if reason and reason[0] == "re-created":
                self.explain.memory_miss()
        executable = self._run()
        plan = self._plan
        return Result(executable, list(self._entries), self.unsound,
                      self._target(plan) if plan is not None and plan.start else None)

    def _kept(self, key: str, got: Loaded) -> Loaded:
        """``got``, a read of ``key``, its facts kept (its error raised: ``KILN_STRICT=1``)."""
        self._facts[key] |= got.facts
        if got.error is not None:
            raise got.error
        return got

    def _load(self, key: str, *, lowered: str | None = None) -> Loaded:
        """The reader's :meth:`EntryReader.load` of ``key``, kept (a hit's entry too); tier-up's
        first tier found there makes the plan (a tier-up in this process, where it is on)."""
        got = self._kept(key, self.reader.load(key, self._facts[key], lowered=lowered))
        if got.outcome is Outcome.HIT:
            self._entries.append((self.store, key))
        if got.first_tier:
            self._plan = self.policy.plan(key, loaded_tier=True)
        return got

    def _run(self) -> Any:
        t_start = time.perf_counter()
        self.fp_key = fp_key = None if self.unsound else self.keys.fingerprint_key()
        if fp_key is not None:
            got = self._load(fp_key)
            if got.outcome is Outcome.ABSENT:
                got = self._other_read_sets() or got
            if got.outcome is Outcome.HIT:
                return got.executable
            if got.outcome is Outcome.UNGUARDED:
                return self._guarded(fp_key, got, t_start)
            if got.outcome is Outcome.VERIFY_ONLY:
                self.unsound = _MANIFEST_UNSOUND
        if self.unsound is None:
            assert fp_key is not None  # internal invariant: the fingerprint was sound
            # single-flight before tracing: a process that waits for another's compile has
            # nothing to do but load its entry (tracing first cost each waiter seconds)
            other, lease = self._await_or_lease(fp_key)
            if other is not None and other.outcome is Outcome.HIT:
                return other.executable
            if other is not None and other.outcome is Outcome.UNGUARDED:
                return self._guarded(fp_key, other, t_start)
            if other is not None and other.outcome is Outcome.VERIFY_ONLY:
                self.unsound = _MANIFEST_UNSOUND
            else:
                with _holding(lease, self.cfg.lease_seconds):
                    return self._trace_and_compile(fp_key, t_start)
        self.explain("verify-path", f"taking the verify path: {self.unsound}" + (
            " (unless the trace reads none of it)"
            if self.keys.watched and self.unsound == self.keys.unsound else ""))
        return self._verify_path(t_start)

    def _trace_and_compile(self, fp_key: str, t_start: float) -> Any:
        """The cold path under a sound fingerprint (holding ``fp_key``'s lease, if any): trace,
        record the manifest, compile and store under ``fp_key`` (or, when the manifest cannot
        be recorded, write a verify-only marker there and take the verify path)."""
        program = self.program
        program.guard  # noqa: B018 - the inputs as the call missed, before its trace reads more
        program.trace()
        if program.extra_inputs:
            return self._jax_runs_it()
        if program.static_changed is not None:
            self.unsound = program.static_changed
            self.explain("verify-path", f"taking the verify path: {self.unsound}")
            return self._verify_path(t_start)
        rekeyed = self._rekey_by_reads()
        if rekeyed is not None:
            fp_key = rekeyed
            got = self._load(fp_key)  # (another process may have stored it by these fields)
            if got.outcome is Outcome.HIT:
                return got.executable
            if got.outcome is Outcome.UNGUARDED:
                return self._guarded(fp_key, got, t_start)
        elif self.keys.unsound is not None:
            self.unsound = self.keys.unsound  # a field the trace read has no value
            self.explain("verify-path", f"taking the verify path: {self.unsound}")
            return self._verify_path(t_start)
        same = self._same_program(fp_key)
        if same is not None:
            return same
        manifest, reason = self._manifest()
        if reason is not None:
            self.unsound = reason
            self.explain("verify-path", f"taking the verify path: {reason}")
            marker = {"kind": "verify-only", "function": self.request.function,
                      "signature": self.keys.signature, "reason": reason,
                      "created": time.time()}
            self.writer.put(fp_key, marker, {}, replace=Fact.REPLACE in self._facts[fp_key])
            return self._verify_path(t_start)
        return self._compile_and_store(fp_key, manifest, t_start, leased=True)

    def _manifest(self) -> tuple[list[list[str]], str | None]:
        """The traced program's manifest (:func:`manifest_for`: items, and why it cannot be
        recorded or None), made on first use: only what stores an entry under the
        fingerprint needs it."""
        if self._manifest_made is None:
            program = self.program
            t0 = time.perf_counter()
            self._manifest_made = manifest_for(program.calls, self.keys.fp, program.imported,
                                               program.reads, program.read_reason,
                                               primitives=program.primitives,
                                               library_codes=program.emitted)
            _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        return self._manifest_made

    def _same_program(self, fp_key: str) -> Any:
        """The executable this function and signature compiled last, when its fingerprint has
        changed but this process's lowering is the very module it was compiled from (a value
        the fingerprint walks changed that only Python code reads; numpyro's ``MCMC`` caches
        keyed by ``id()``): loaded, not compiled, as JAX's cache would. Stored under
        ``fp_key`` too, so the next process hits it without tracing, unless the fingerprint
        has changed that way ``_SAME_PROGRAM_COPIES`` times in a row (it differs in every
        process: each one traces and lowers, and the store does not grow). None: nothing
        stored for it, or another program (compile), or it would be stored and the manifest
        cannot be recorded (the caller takes the verify path, as without an alias).

        The manifest is made only to store the entry under ``fp_key``: a load that stores
        nothing is keyed by the lowered module alone, as the verify path is (it is what the
        entry was compiled from), so a fingerprint that differs in every process costs no
        manifest (numpyro's ``_fori_collect_loop``: ~0.01 s of each warm start)."""
        if not self.request.same_program_alias or self.policy.candidate:
            return None  # (tier-up's forms are keyed by their own modules)
        alias_key = self.keys.alias_key()
        alias = self._kept(alias_key, self.reader.alias(alias_key, self._facts[alias_key])).entry
        if alias is None:
            return None
        lowered = self.program.lowered_facts[0]
        entry_key = alias.header.get("entry")
        if alias.header.get("lowered") != lowered or not isinstance(entry_key, str):
            return None  # the program changed too
        copies = alias.header.get("copies")
        if not isinstance(copies, int):  # (never written so: store no copy)
            copies = _SAME_PROGRAM_COPIES
        # stored: while fewer than _SAME_PROGRAM_COPIES new fingerprints were in a row; when
        # this fingerprint came before (it is stable after all: the count starts again); when
        # its own entry was there but bad or stale (a replacement, not one more entry)
        again = alias.header.get("unstored") == fp_key
        replacing = Fact.REPLACE in self._facts[fp_key]
        store = copies < _SAME_PROGRAM_COPIES or again or replacing
        manifest: list[list[str]] = []
        if store:
            manifest, reason = self._manifest()
            if reason is not None:
                return None
        with self.explain.quietly():
            got = self._load(entry_key, lowered=lowered)
        if got.outcome is not Outcome.HIT or got.entry is None:
            return None
        written = (self.writer.put_same_program(fp_key, manifest, got.entry, replace=replacing)
                   if store else None)
        self._entries += written or []
        stored, known = written is not None, self._facts[alias_key]
        if stored:
            self.writer.put_alias(fp_key, known, copies=0 if again else copies + 1)
        else:
            self.writer.put_alias(entry_key, known, copies=copies, unstored=fp_key)
        self.explain(
            "same-program",
            f"fingerprint changed, lowered module did not: loaded entry {short_key(entry_key)} "
            "without compiling" + (
                " and stored it under this fingerprint too" if stored else
                f"; not stored under this fingerprint ({copies} new fingerprints in a row had "
                "the same program: if something the function reads differs in every process, "
                "each process traces and lowers it; a fingerprint that comes again is stored)"))
        return got.executable

    # -- the guard (kiln._keys._guard) ----------------------------------------------------
    def _guarded(self, key: str, got: Loaded, t_start: float) -> Any:
        """The entry under ``key`` matches the call's key and manifest, and its guard does not
        hold here (``got.why``: an input of this process differs from its writer's). A guard
        verified for it before that holds here: its entry, loaded with no trace. Else verify
        once: trace and lower; where the module is the entry's own and so is what the trace
        gives besides it, load it (no compile); where it is not, compile and store it under
        this guard's own key; then record this guard as verified, so a later process with the
        same inputs traces nothing (never where a file read here changed before kiln could
        digest it: :attr:`kiln._keys.Guard.lost`)."""
        entry = got.entry
        assert entry is not None  # internal invariant: an UNGUARDED read carries its entry
        program = self.program
        guard = program.guard
        lowered = entry.header.get("lowered")
        guards_key = self.keys.guards_key(key, guard.digest)
        verified = None
        if guard.lost is None:
            verified = self.reader.verified(guards_key)
        if verified is not None and check_guard(verified.get("items")) is None:
            target = verified["entry"]
            with self.explain.quietly():
                if target == key and verified.get("lowered") == lowered:
                    loaded = self._kept(key, self.reader.use(key, entry, self._facts[key]))
                else:
                    loaded = self._load(target)
            if loaded.outcome is Outcome.HIT:
                if target == key:
                    self._entries.append((self.store, key))
                return loaded.executable
        _stats.bump(verifies=1)
        program.trace()
        if program.extra_inputs:
            return self._jax_runs_it()
        record = program.guard.lost is None
        inlined = entry.header.get("tier") == "inlined"
        digest = (program.inlined_facts if inlined else program.lowered_facts)[0]
        if digest == lowered and program.static_changed is None:
            loaded = self._kept(key, self.reader.use(key, entry, self._facts[key]))
            if loaded.outcome is Outcome.HIT:
                self._entries.append((self.store, key))
                where = key
                if inlined:  # (tier-up's form: remembered only where it holds no outputs
                    # but arrays, which its module says all of; else verified every time)
                    record = record and "static_out" not in entry.sections and (
                        program.static_out() is None)
                elif record and not self.writer.same_outputs(entry):
                    # the same module, another output tree or non-array outputs: an entry
                    # with this trace's, under this guard's own key
                    where = self.keys.guarded_key(key, program.guard.digest)
                    manifest, reason = self._manifest()
                    written = (None if reason is not None else self.writer.put_same_program(
                        where, manifest, entry, replace=False))
                    record = bool(written)
                if record:
                    self.writer.put_guard(guards_key, where)
                self.explain("verified", f"verified {self.request.name}: {got.why}; module "
                             "unchanged, loaded" + ("" if record else " (not remembered: "
                                                    f"{program.guard.lost or 'not stored'})"))
                return loaded.executable
        self.explain("verified", f"verified {self.request.name}: {got.why}; module changed, "
                     "compiling")
        manifest, reason = self._manifest()
        if not record or reason is not None or program.static_changed is not None:
            self.unsound = reason or program.static_changed or program.guard.lost
            return self._verify_path(t_start)
        where = self.fp_key = self.keys.guarded_key(key, program.guard.digest)
        result = self._compile_and_store(where, manifest, t_start)
        if any(k == where for _, k in self._entries):
            self.writer.put_guard(guards_key, where)
        return result

    def _verify_path(self, t_start: float) -> Any:
        """Load or compile under keys of the lowered module (the fingerprint is not sound);
        or, where the fingerprint was unsound only for a field of a static object that the
        trace did not read, under the fingerprint keyed by the fields it read."""
        self.program.trace()
        if self.program.extra_inputs:
            return self._jax_runs_it()
        if (self.unsound == self.keys.unsound and self.program.static_changed is None
                and self._rekey_by_reads() is not None):
            self.unsound = None
            assert self.fp_key is not None  # internal invariant: set by the rekey
            got = self._load(self.fp_key)
            if got.outcome is Outcome.HIT:
                return got.executable
            return self._trace_and_compile(self.fp_key, t_start)
        if self.cfg.tier_up and self.policy.candidate:
            # its inlined form (compiled directly or by a tier-up) is stored under its own key
            self.inlined_key = self.keys.verify_key(self.program.inlined_facts[0], inlined=True)
            got = self._load(self.inlined_key)
            if got.outcome is Outcome.HIT:
                return got.executable
            if self.policy.plan(self.inlined_key).inline_now:
                return self._compile_and_store(self.inlined_key, None, t_start)
        vkey = self.keys.verify_key(self.program.lowered_facts[0])
        got = self._load(vkey)
        if got.outcome is Outcome.HIT:
            return got.executable
        return self._compile_and_store(vkey, None, t_start)

    def _jax_runs_it(self) -> Any:
        """The flat jax.jit itself, for a trace that closed over values jax.jit passes as
        inputs (a tracer leaked from another trace, whose call raises jax's
        UnexpectedTracerError; a hijax ref): kiln's executables take the array leaves only, so
        jax.jit runs this signature, as it would without kiln (its trace cache holds the trace
        just made), and nothing is stored."""
        self.explain("to-jax", f"run by jax.jit ({self.keys.signature}): the trace closed "
                     f"over {self.program.extra_inputs} value(s) jax.jit passes as inputs (a "
                     "tracer from another trace, a ref); nothing is stored")
        return self.program.jitted

    # -- single-flight ----------------------------------------------------------------------
    def _await_or_lease(self, key: str) -> tuple[Loaded | None, Lease | None]:
        """Single-flight before compiling ``key``: one process compiles, the others wait for
        its entry. Returns (what another process stored: a HIT, or a verify-only marker; None)
        or (None, the lease this process now holds, or None where the store leases nothing or
        failed).

        A waiter polls the store; it takes the key over when the holder's lease runs out (the
        holder died: a local file lock is freed by the OS at once, a remote lease after
        ``lease_seconds``), and gives up waiting after ``lease_wait`` seconds.
        """
        if not isinstance(self.store, Leasable) or Fact.NO_FLIGHT in self._facts[key]:
            return None, None
        cfg = self.cfg
        try:
            lease = self.store.lease(key, cfg.lease_seconds)
        except (OSError, StoreError) as e:
            # (a read-only store: no lease, and its put will say why it cannot store)
            logger.debug("kiln: no lease on %s in %r (%s)", short_key(key), self.store.url, e)
            return None, None

        def look() -> tuple[bool, Loaded | None]:
            with self.explain.quietly():  # (polling: no miss explanations, no second warning)
                got = self._load(key)
            if got.outcome in (Outcome.HIT, Outcome.VERIFY_ONLY, Outcome.NOT_STORABLE,
                               Outcome.UNGUARDED):
                return True, got
            return got.outcome not in (Outcome.ABSENT, Outcome.STALE), None

        def waiting() -> contextlib.AbstractContextManager[None]:
            self.explain("single-flight", f"another process is compiling {short_key(key)} "
                         f"({self.keys.signature}); waiting for its entry")
            return compiling(f"{self.request.name} ({self.keys.signature})", cfg.progress,
                             doing="waiting for another process compiling")

        try:
            flight = await_or_lease(lease, look, seconds=cfg.lease_seconds,
                                    wait=cfg.lease_wait, waiting=waiting)
        except (OSError, StoreError) as e:
            if cfg.strict and Fact.BAD in self._facts[key]:
                raise  # KILN_STRICT=1: the entry that went bad while this process waited
            logger.debug("kiln: no lease on %s in %r (%s)", short_key(key), self.store.url, e)
            return None, None
        if flight.waited and flight.found is None:
            self.explain("single-flight", f"{short_key(key)}: no entry from the other process "
                         f"({'its lease ended' if flight.held else 'stopped waiting'}); "
                         "compiling it here")
        return flight.found, lease if flight.held else None

    # -- compiling ----------------------------------------------------------------------------
    def _compile_and_store(
        self, key: str, manifest: list[list[str]] | None, t_start: float, *, leased: bool = False
    ) -> Any:
        """Compile and store under ``key``, single-flight (``leased``: the caller already
        holds, or tried for, the key's lease), in the form the tier-up plan says."""
        got, lease = (None, None) if leased else self._await_or_lease(key)
        if got is not None and got.outcome is Outcome.HIT:
            return got.executable
        with _holding(lease, self.cfg.lease_seconds):
            self.explain.memory_miss()
            self.program.trace()
            plan = self._plan = self.policy.plan(key)
            if plan.inline_now:
                with self.writer.compiling():  # inlined at once: no lowered program is made
                    result, inlined = self._target(plan).write(structs(self.program.leaves),
                                                               t_start)
                self._entries += inlined
                _stats.bump(misses=1)
                return result
            result, written = self.writer.compile_and_write(
                key, manifest, t_start, replace=Fact.REPLACE in self._facts[key],
                alias=self._facts[self.keys.alias_key()],
                tier_up_candidate=self.policy.candidate)
        if written is None:  # a not-storable marker there: what is written next replaces it
            self._facts[key] |= Fact.REPLACE
        self._entries += written or []
        return result

    def _target(self, plan: _tier_up.Plan) -> _tier_up.Plan:
        """``plan``, saying where its inlined form is written: under the fingerprint key it
        was made for, or on the verify path under the inlined module's key (None: nowhere)."""
        fingerprinted = plan.key == self.fp_key
        key = plan.key if fingerprinted else self.inlined_key
        return dataclasses.replace(plan, ctx=self.ctx, store_key=key, fingerprinted=fingerprinted,
                                   replace=key is not None and Fact.REPLACE in self._facts[key])
