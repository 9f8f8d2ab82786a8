"""Reading a store entry for one call: load it, check it (digest, manifest, and where the
program is traced in this process, the lowered module), deserialize it; or say why not, and
handle a bad entry (warn once, replace it later; ``KILN_STRICT=1``: raise). The reader keeps
nothing: a read returns what it found out about the key (:class:`Fact`), for the miss to keep."""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import warnings
from typing import Any

from kiln_early import _inputs

from .._base import (
    Entry,
    EntryError,
    StoreError,
    StoreWarning,
    UnverifiableEntry,
    VerifyError,
    _jax_compat,
    _stats,
    decode,
    short_key,
)
from .._keys import check_guard, check_manifest
from ..stores import store_fault, user_stacklevel
from ._context import MissContext
from ._explain import describe_persistent_miss
from ._outputs import wrap_static_outputs

__all__ = ["EntryReader", "Fact", "Loaded", "Outcome", "read_records"]

logger = logging.getLogger("kiln")


class Outcome(enum.Enum):
    """What a store lookup found (:meth:`EntryReader.load`)."""

    HIT = "hit"  # a usable entry, loaded
    ABSENT = "absent"  # no entry under the key
    STALE = "stale"  # an entry built from something that has changed since
    UNUSABLE = "unusable"  # a corrupt, foreign or tampered entry, or a store that failed
    VERIFY_ONLY = "verify-only"  # a marker: this function takes the verify path
    # the key and the manifest hold, the guard does not (the process's inputs differ from the
    # writer's): trace, lower and compare once (``_Miss._guarded``)
    UNGUARDED = "unguarded"
    # a short-lived marker: the process that compiled it could not store it; compile here now
    # (waiters do not take the key over one after another)
    NOT_STORABLE = "not-storable"


class Fact(enum.Flag):
    """What a read found out about a key besides its outcome; the miss keeps it, per key."""

    NONE = 0
    REPLACE = enum.auto()  # stale, unusable, a marker, an alias: written with the store's replace
    KEEP = enum.auto()  # signed, no key here to check it: never replaced (nor an alias written)
    NO_FLIGHT = enum.auto()  # under a fresh not-storable marker: compiled with no single-flight
    BAD = enum.auto()  # a bad entry, reported (once per key)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a read found (:meth:`EntryReader.load`, :meth:`EntryReader.alias`)."""

    outcome: Outcome
    executable: Any = None  # the callable executable, on a HIT
    entry: Entry | None = None  # the entry it was loaded from (or the alias), on a HIT
    # the entry found is tier-up's first tier: stored before its inlined form was ready
    # (whether it was then used or not)
    first_tier: bool = False
    facts: Fact = Fact.NONE  # what this read found out about the key
    error: StoreError | None = None  # KILN_STRICT=1: a bad entry's, raised by the miss
    why: str | None = None  # UNGUARDED: the first input that differs ("coeffs.txt changed")


_ABSENT, _STALE, _UNUSABLE = Loaded(Outcome.ABSENT), Loaded(Outcome.STALE), Loaded(Outcome.UNUSABLE)


def read_records(store: Any, cfg: Any, key: str, kind: str, field: str,
                 ) -> list[dict[str, Any]] | None:
    """The list ``field`` of the record of ``kind`` under ``key`` (the dicts in it, most
    recent first: a static-reads record's read sets, a guards record's verified guards);
    None: none, or unreadable; []: a bad one (a record is a hint: any of its dicts is checked
    before use, and the next record written replaces a bad one)."""
    try:
        blob = store.get(key)
    except (OSError, StoreError):
        return None  # (the entry's own read meets the fault too, and warns)
    if blob is None:
        return None
    try:
        entry = decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old, key=key)
    except EntryError as e:
        logger.debug("kiln: %s record %s not used (%s)", kind, short_key(key), e)
        return []
    got = entry.header.get(field)
    if entry.header.get("kind") != kind or not isinstance(got, list):
        return []
    return [r for r in got if isinstance(r, dict)]


class EntryReader:
    """The store reads of one miss (``ctx``): :meth:`load` and :meth:`alias` say what they
    found, given what the miss knows of the key from its earlier reads (``known``)."""

    def __init__(self, ctx: MissContext) -> None:
        self.cfg, self.store, self.request = ctx.cfg, ctx.store, ctx.request
        self.program, self.keys, self.explain = ctx.program, ctx.keys, ctx.explain

    def load(self, key: str, known: Fact = Fact.NONE, *, lowered: str | None = None) -> Loaded:
        """Look ``key`` up in the store: a hit (deserialized, ready to run), or why not.

        ``lowered``: the digest of this process's lowering of the program, for an entry stored
        under another fingerprint (:meth:`alias`): a hit only when that entry was compiled from
        this very module (its manifest is not checked: the module is what it describes), and
        never a stale or replaced entry when it was not."""
        t0 = time.perf_counter()
        try:
            blob = self.store.get(key)
        except (OSError, StoreError) as e:
            store_fault(self.store, "read", e, strict=self.cfg.strict)
            return _UNUSABLE
        finally:
            _stats.bump(read_seconds=time.perf_counter() - t0)
        if blob is None:
            if not self.explain.quiet and lowered is None:
                self.explain.memory_miss()
                if self.explain.wanted:
                    self.explain("persistent-miss", describe_persistent_miss(
                        self.store, self.request.function, self.keys.parts.parts,
                        self.keys.fp.parts, self.keys.signature))
            return _ABSENT
        got = self._use(key, blob, known, lowered)
        if (got.outcome in (Outcome.STALE, Outcome.UNUSABLE) and lowered is None
                and Fact.KEEP not in known | got.facts):
            return dataclasses.replace(got, facts=got.facts | Fact.REPLACE)
        return got

    def alias(self, key: str, known: Fact = Fact.NONE) -> Loaded:
        """The alias entry under ``key`` (``CallKeys.alias_key``: which entry holds the
        executable this function and signature last compiled, under which fingerprint, from
        which lowered module): a HIT whose ``entry`` it is, or why not (none, or a bad one:
        warned about, replaced by the next alias written)."""
        try:
            blob = self.store.get(key)
        except (OSError, StoreError) as e:
            store_fault(self.store, "read", e, strict=self.cfg.strict)
            return _UNUSABLE
        if blob is None:
            return _ABSENT
        got = self._decode(key, blob, known)
        if isinstance(got, Entry):
            got = (Loaded(Outcome.HIT, entry=got) if got.header.get("kind") == "alias"
                   else _UNUSABLE)
        if Fact.KEEP in known | got.facts:
            return got  # one this process cannot check (signed, no key here): left as it is
        # the next alias written replaces it (a remote store's put keeps what it holds)
        return dataclasses.replace(got, facts=got.facts | Fact.REPLACE)

    def _use(self, key: str, blob: bytes, known: Fact, lowered: str | None = None) -> Loaded:
        """Verify and deserialize the entry ``blob`` found under ``key``, or say why not
        (``lowered``: see :meth:`load`)."""
        # an alias's entry is another fingerprint's: replaced when that one next misses
        then = ("compiling here" if lowered is not None else "recompiling and replacing it")
        entry = self._decode(key, blob, known, then)
        if isinstance(entry, Loaded):
            return entry
        header = entry.header
        if lowered is not None:
            # an entry of the same program: an executable compiled from this very module
            # (tier-up's entries, of another form, are left to their own key)
            if (header.get("kind") != "executable" or header.get("lowered") != lowered
                    or header.get("tier") is not None):
                return _ABSENT
            return self._deserialized(key, entry, known)
        marker = self._marker(key, header)
        if marker is not None:
            return marker
        got = (self._stale(header) or self._unguarded(entry)
               or self._deserialized(key, entry, known))
        if header.get("tier") == "noinline":
            got = dataclasses.replace(got, first_tier=True)
        return got

    def _stale(self, header: dict[str, Any]) -> Loaded | None:
        """STALE when something the entry's manifest names has changed since, else None."""
        t0 = time.perf_counter()
        fun_globals = getattr(self.request.fun, "__globals__", None)
        changed = check_manifest(
            header.get("manifest") or [],
            (self.request.module, fun_globals) if isinstance(fun_globals, dict) else None,
        )
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        if changed is not None:
            self.explain("manifest", f"stored entry is stale: {changed}")
            return _STALE
        return None

    def _unguarded(self, entry: Entry) -> Loaded | None:
        """UNGUARDED (with the entry) when the entry's guard does not hold in this process,
        else None. An entry on the verify path (keyed by its lowered module, never used without
        a trace) has none."""
        header = entry.header
        if "guard" not in header and not header.get("fp_parts"):
            return None
        t0 = time.perf_counter()
        why = check_guard(header.get("guard"))
        _stats.bump(guard_seconds=time.perf_counter() - t0)
        return None if why is None else Loaded(Outcome.UNGUARDED, entry=entry, why=why)

    def use(self, key: str, entry: Entry, known: Fact) -> Loaded:
        """A HIT of ``entry`` (read under ``key``) without its guard's check: a guard verified
        for it holds, or this process's lowering is the module it was compiled from."""
        return self._deserialized(key, entry, known)

    def verified(self, key: str) -> dict[str, Any] | None:
        """The header of the ``guard`` record under ``key`` (``CallKeys.guards_key``: a guard
        verified for an entry), or None: none, unreadable, or not one (a record is a hint: what
        it names is checked before use)."""
        try:
            blob = self.store.get(key)
        except (OSError, StoreError):
            return None  # (the entry's own read meets the fault too, and warns)
        if blob is None:
            return None
        try:
            header = decode(blob, signing_key=self.cfg.signing_key,
                            old_keys=self.cfg.signing_keys_old, key=key).header
        except EntryError as e:
            logger.debug("kiln: guard record %s not used (%s)", short_key(key), e)
            return None
        if header.get("kind") != "guard" or not isinstance(header.get("entry"), str):
            return None
        return header

    def _deserialized(self, key: str, entry: Entry, known: Fact) -> Loaded:
        """A HIT of ``entry`` (checked against this process's trace, where there is one, and
        deserialized), or why not."""
        header = entry.header
        t0 = time.perf_counter()
        traced = self._from_trace(key, entry)
        if traced is None:
            return _STALE
        callbacks, out_tree, static_out = traced
        try:
            compiled = _jax_compat.load_compiled(
                entry.sections, callbacks, out_tree, lapack=bool(header.get("lapack", True)),
                inputs=self.program.input_objects())
            if "static_out" in entry.sections:
                if static_out is None:
                    static_out = _jax_compat.unpickle_tree(entry.sections["static_out"],
                                                           self.program.input_objects())
                compiled = wrap_static_outputs(compiled, *static_out)
        except Exception as e:  # noqa: BLE001 - a bad entry must never crash the program
            return self._bad_entry(key, known, f"could not be loaded ({type(e).__name__}: {e})")
        load_s = time.perf_counter() - t0
        if self.program.lowered is None and self.program.inlined_lowered is None:
            for message in header.get("warnings", ()):
                # JAX warns while lowering ("Some donated buffers were not usable"), which a
                # load skips: the same warning, as jax.jit gives it once per process and
                # signature (a load that lowered in this process, the verify path, gave it)
                warnings.warn(str(message), UserWarning, stacklevel=user_stacklevel())
        _stats.bump(hits=1, load_seconds=load_s,
                    saved_seconds=max(0.0, float(header.get("compile_seconds", 0.0)) - load_s))
        # what the trace read is read in this process as if it had traced (state a later
        # trace reads may have been set up from it: that one's guard holds it too)
        _inputs.merge(header.get("manifest") or [])
        logger.debug("kiln: hit %s %s (loaded in %.3f s)", self.request.name, short_key(key),
                     load_s)
        return Loaded(Outcome.HIT, compiled, entry)

    def _decode(self, key: str, blob: bytes, known: Fact,
                then: str = "recompiling and replacing it") -> Entry | Loaded:
        """The entry, verified; or for a bad one, UNUSABLE (warned about, saying ``then``)."""
        try:
            return decode(blob, signing_key=self.cfg.signing_key,
                          old_keys=self.cfg.signing_keys_old, key=key)
        except UnverifiableEntry as e:
            # most likely a good entry of a signed fleet store, and this process the one
            # without the key: compile here, and leave the entry alone (never replaced)
            return self._bad_entry(key, known, f"in {self.store.url!r} is not loaded ({e})",
                                   then="compiling here, leaving the entry as it is",
                                   facts=Fact.KEEP)
        except EntryError as e:
            return self._bad_entry(key, known, f"in {self.store.url!r} is unusable ({e})", then)

    def _marker(self, key: str, header: dict[str, Any]) -> Loaded | None:
        """What a marker entry says (verify-only, not-storable), or None for an executable."""
        if header.get("kind") == "verify-only":
            return Loaded(Outcome.VERIFY_ONLY)
        if header.get("kind") == "not-storable":
            # (a real entry, if one can be made later, replaces it)
            if time.time() < float(header.get("expires", 0.0)):
                self.explain("single-flight", f"{short_key(key)}: the process that compiled it "
                             f"could not store it ({header.get('reason', '?')}); compiling "
                             "here without waiting")
                return Loaded(Outcome.NOT_STORABLE, facts=Fact.REPLACE | Fact.NO_FLIGHT)
            return Loaded(Outcome.ABSENT, facts=Fact.REPLACE)
        return None
    def _from_trace(self, key: str, entry: Entry) -> tuple[Any, Any, Any] | None:
        """(host callbacks, output tree, non-array outputs) from this process's trace of the
        program where there is one (each None where the entry holds it), or None when the
        entry differs from that trace (stale)."""
        header = entry.header
        program = self.program
        callbacks = None
        # the form the entry was compiled from (its "lowered" digest is of that form): an
        # inlined entry (tier-up) has other host callbacks than the lowered program
        inlined = header.get("tier") == "inlined"
        rebuild = header.get("callbacks") == "trace" or self.cfg.verify
        if (not rebuild and program.traced is None and header.get("callbacks") == "stored"
                and "callbacks" in entry.sections):
            # stored callbacks, bound to this process's live objects (the function's walk)
            try:
                callbacks = _jax_compat.unpickle_callbacks(entry.sections["callbacks"],
                                                           self.keys.fp.objects)
            except Exception as e:  # noqa: BLE001 - rebuilt by tracing instead
                self.explain("callbacks", f"host callbacks rebuilt by tracing ({e})")
                rebuild = True
        if rebuild:
            source = program.lower_form(inlined)
            digest = (program.inlined_facts if inlined else program.lowered_facts)[0]
            if digest != header.get("lowered"):
                if self.cfg.verify:
                    raise VerifyError(
                        f"KILN_VERIFY: stored entry {short_key(key)} of {self.request.name} does "
                        f"not match a fresh lowering (stored module "
                        f"{short_key(header.get('lowered'))}, now {short_key(digest)}); kiln's key "
                        "missed a change. "
                        "Please report this with KILN_EXPLAIN=1 output."
                    )
                self.explain("lowered", "stored module differs from the fresh lowering")
                return None
            callbacks = _jax_compat.host_callbacks(source)
        if program.traced is None:
            return callbacks, None, None
        # Traced in this process (verify path, audit, unpicklable callbacks): what the lowered
        # module does not hold (host callables, non-array outputs, the output tree) comes from
        # this trace, never from the entry.
        if callbacks is None:
            callbacks = _jax_compat.host_callbacks(program.lower_form(inlined))
        static_out = program.static_out()
        if ("static_out" in entry.sections) != (static_out is not None):
            self.explain("lowered", "stored entry's outputs differ from the fresh trace")
            return None
        return callbacks, program.traced.out_tree, static_out

    def _bad_entry(self, key: str, known: Fact, what: str,
                   then: str = "recompiling and replacing it", facts: Fact = Fact.NONE) -> Loaded:
        """UNUSABLE (with ``facts``) for a bad entry (``what`` is wrong), counted and warned about
        (``then``: what kiln does next) once per key (BAD: not again when single-flight looks at
        it once more; one that goes bad while this process polls for it is reported too); with
        ``KILN_STRICT=1`` carrying a :class:`StoreError`."""
        got = Loaded(Outcome.UNUSABLE, facts=facts | Fact.BAD)
        if Fact.BAD in known:
            return got
        message = f"kiln: entry {short_key(key)} of {self.request.name} {what}"
        _stats.bump(bad_entries=1)
        self.explain("bad-entry", f"{message.removeprefix('kiln: ')}; {then}")
        if self.cfg.strict:
            return dataclasses.replace(got, error=StoreError(
                f"{message} (KILN_STRICT=1 makes this an error; unset it to warn and recompile)"))
        warnings.warn(f"{message}; {then}", StoreWarning, stacklevel=user_stacklevel())
        return got
