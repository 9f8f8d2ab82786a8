"""``kiln ls`` and ``kiln stats``: what the store holds, from entry headers and stats only (no
payload read, nothing marked used)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from .._base import is_key, recorded_parts, short_key
from ..stores import Counting, Store
from ..stores import _inventory as inventory
from ._common import open_store
from ._render import ago, columns, human_size, note, show

__all__ = ["register"]

#: Wall clock for ages in ``kiln ls`` (tests replace it).
_clock: Callable[[], float] = time.time

# the kinds of entry with no executable behind them, only a marker: "this fingerprint needs
# the verify path", or "this function's executable cannot be stored" (with the reason); an
# alias ("this function and signature last compiled the entry under that key") is not listed,
# nor a guard record ("with these inputs the entry was verified": counted by kiln stats)
_MARKERS = ("verify-only", "unstorable", "not-storable")
_GUARD = "guard"


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``ls`` and ``stats`` to the ``kiln`` parser's ``verbs``."""
    ls = verbs.add_parser("ls", parents=common, help="list the entries of the store",
                          description="One row per entry; reads headers only.")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("-v", "--verbose", action="store_true",
                    help="whole signatures (by default cut to fit the terminal)")
    ls.add_argument("--machine", metavar="KIND",
                    help="only entries compiled for machine kinds containing KIND (as 'kiln "
                         "stats' lists them: 'x86_64 avx512 3f9c2a1b', or a part: 'avx2')")
    ls.set_defaults(func=_cmd_ls)

    stats = verbs.add_parser("stats", parents=common, help="summarize the store")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=_cmd_stats)


# -- the rows ------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Row:
    key: str
    kind: str
    function: str
    signature: str
    size: int
    created: float | None
    last_used: float | None
    compile_seconds: float | None
    # kiln.noinline: the functions this program calls, the programs calling this function,
    # and for a caller whether its stored executable is the inlined form (tier-up) or not
    calls: list[str] = dataclasses.field(default_factory=list)
    used_by: list[str] = dataclasses.field(default_factory=list)
    tier: str | None = None
    # the machine kind it was compiled for (its "machine" key part: kiln._keys._machine), or None
    machine: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rows(store: Store) -> list[_Row]:
    """One row per entry, from headers and stats only (no payload read, nothing marked used)."""
    rows = []
    for key in store.iter():
        try:
            st = store.stat(key)
            header = store.header(key)
        except ValueError:  # a file in the store that is not named like a key
            st, header = None, None
        if st is None and header is None and is_key(key):
            continue  # vanished since iter() (pruned concurrently); a non-key is unreadable
        size = st.size if st else 0
        created = st.created if st else None
        last_used = st.last_used if st else None
        if header is None:
            rows.append(
                _Row(key, "unreadable", "<unreadable>", "-", size, created, last_used, None)
            )
            continue
        kind = str(header.get("kind", "executable"))
        seconds = header.get("compile_seconds")
        seconds = float(seconds) if isinstance(seconds, int | float) else None
        if kind == "alias":
            continue  # bookkeeping of the entry it names (kiln._miss._compile._same_program)
        if kind in (*_MARKERS, _GUARD):
            function = header.get("function")
            function = function if isinstance(function, str) and "." in function else "-"
            rows.append(_Row(key, kind, function, "-", size, created, last_used, None))
            continue
        calls = header.get("noinline")
        tier = header.get("tier")
        machine = recorded_parts(header).get("machine")
        rows.append(_Row(
            key, kind, str(header.get("function", "?")), str(header.get("signature", "?")),
            size, created, last_used, seconds,
            calls=[str(c) for c in calls] if isinstance(calls, list) else [],
            tier=str(tier) if tier is not None else None,
            machine=str(machine) if machine is not None else None,
        ))
    callers: dict[str, set[str]] = {}
    for r in rows:
        for c in r.calls:
            callers.setdefault(c, set()).add(r.function)
    for r in rows:
        r.used_by = sorted(callers.get(r.function, ()))
    rows.sort(key=lambda r: (r.function, r.created or 0.0, r.key))
    return rows


# -- kiln ls -------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store()
    rows = [r for r in _rows(store) if r.kind != _GUARD]
    if args.machine:
        want = args.machine.lower()
        rows = [r for r in rows if r.machine is not None and want in r.machine.lower()]
    strays = inventory.strays(store)
    if strays:
        note(f"{len(strays)} stray file(s) in {store.url} that are not entries (not listed; "
             "'kiln verify' names them, 'kiln verify --delete-bad' removes them)")
    if not rows and not args.json:
        note(f"no entries in {store.url}"
             + (f" for machine kind {args.machine!r}" if args.machine else ""))
        return 0
    show(_Listing(rows, verbose=args.verbose), as_json=args.json)
    return 0


@dataclasses.dataclass(frozen=True)
class _Listing:
    """``kiln ls``: one row per entry; ``verbose``: whole signatures."""

    rows: list[_Row]
    verbose: bool

    def as_json(self) -> list[dict[str, Any]]:
        return [r.as_json() for r in self.rows]

    def as_text(self) -> Iterator[str]:
        now = _clock()
        header = ["FUNCTION", "SIGNATURE", "SIZE", "CREATED", "LAST USED", "COMPILE S", "KEY"]
        # the machine kind column only where the store serves more than one kind (a mixed fleet)
        machines = len({r.machine for r in self.rows if r.machine}) > 1
        if machines:
            header.append("MACHINE")
        noinline = any(r.calls or r.used_by for r in self.rows)
        table = [tuple(header + ["NOINLINE"] if noinline else header)]
        for r in self.rows:
            table.append((
                r.function,
                r.signature,
                human_size(r.size),
                "-" if r.created is None else ago(now - r.created),
                "-" if r.last_used is None else ago(now - r.last_used),
                "-" if r.compile_seconds is None else f"{r.compile_seconds:.2f}",
                short_key(r.key),
                *((r.machine or "-",) if machines else ()),
                *((_noinline_text(r),) if noinline else ()),
            ))
        if not self.verbose:
            # the SIGNATURE column fits the terminal (a training step's ~80 leaves are thousands
            # of characters): what the other columns leave (NOINLINE, last, may run over), >= 40
            others = sum(max(len(t[i]) for t in table) + 2  # (header: without NOINLINE)
                         for i in range(len(header)) if i != 1)
            room = max(40, shutil.get_terminal_size((160, 24)).columns - others)
            table = [table[0]] + [(t[0], _fit_signature(t[1], room), *t[2:]) for t in table[1:]]
        right = ((False, False, True, True, True, True, False) + ((False,) if machines else ())
                 + ((False,) if noinline else ()))
        yield from columns(table, right=right)


def _short(function: str) -> str:
    """``pkg.mod.outer`` -> ``outer``; ``pkg.mod.vf[noinline jvp]`` -> ``vf[noinline jvp]``."""
    head, bracket, rest = function.partition("[")
    return head.rpartition(".")[2] + bracket + rest


def _noinline_text(r: _Row) -> str:
    if r.calls:
        tier = {"inlined": " (inlined)", "noinline": " (not inlined yet)"}.get(r.tier or "", "")
        return "calls " + ", ".join(_short(c) for c in r.calls) + tier
    if r.used_by:
        return "used by " + ", ".join(_short(c) for c in r.used_by)
    return ""


def _fit_signature(signature: str, width: int) -> str:
    """A signature cut to ``width`` characters at a leaf boundary, with the number of leaves:
    ``f32[64,64], f32[64], ... (80 leaves)``; whole when it fits (``kiln ls -v`` and
    ``--json`` always give it whole)."""
    if len(signature) <= width:
        return signature
    leaves = _split_leaves(signature)
    tail = f", ... ({len(leaves)} leaves)"
    shown: list[str] = []
    for leaf in leaves:
        if len(", ".join([*shown, leaf])) + len(tail) > width and shown:
            break
        shown.append(leaf)
    text = ", ".join(shown)
    if len(text) + len(tail) > width:  # one leaf alone is wider than the column
        text = text[: max(1, width - len(tail) - 3)] + "..."
    return text + tail


def _split_leaves(signature: str) -> list[str]:
    """``"f32[3,4], {a: i32[]}"`` -> its top-level comma-separated parts (commas inside
    brackets and braces are not separators)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(signature):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(signature[start:i].strip())
            start = i + 1
    parts.append(signature[start:].strip())
    return [p for p in parts if p]


# -- kiln stats ----------------------------------------------------------------------------------
def _cmd_stats(args: argparse.Namespace) -> int:
    store = open_store()
    rows = _rows(store)
    functions = Counter(r.function for r in rows
                        if r.kind not in (*_MARKERS, _GUARD, "unreadable"))
    temp_files, temp_bytes = inventory.temp_usage(store)
    show(_Summary(
        store=store.url,
        entries=len(rows),
        bytes=sum(r.size for r in rows),
        compile_seconds=round(sum(r.compile_seconds or 0.0 for r in rows), 6),
        functions=dict(sorted(functions.items())),
        machines=dict(sorted(Counter(r.machine for r in rows if r.machine).items())),
        verify_only_markers=sum(r.kind == "verify-only" for r in rows),
        verified_guards=sum(r.kind == _GUARD for r in rows),
        not_stored={r.function: str((store.header(r.key) or {}).get("reason", "?"))
                    for r in rows if r.kind == "unstorable"},
        unreadable=sum(r.kind == "unreadable" for r in rows),
        stray_files=len(inventory.strays(store)),
        temp_files=temp_files,
        temp_bytes=temp_bytes,
        counters=dict(sorted(store.counts().items())) if isinstance(store, Counting) else {},
    ), as_json=args.json)
    return 0


@dataclasses.dataclass(frozen=True)
class _Summary:
    """``kiln stats``.

    Attributes:
        store: the store's URL.
        entries: entries, markers and unreadable files included.
        bytes: their size.
        compile_seconds: compile time the stored executables took.
        functions: executables per function.
        machines: the machine kinds the store serves (kiln._keys._machine): entries per kind.
        verify_only_markers: fingerprints that need the verify path.
        verified_guards: guards verified for an entry (``kiln._keys._guard``): a process whose
            inputs differed from the entry's writer's traced and compared once, and a later
            one with those inputs loads with no trace.
        not_stored: functions whose executable could not be stored, with the reason (kiln
            warned once).
        unreadable: entries whose header does not read.
        stray_files: things in the store that are not entries.
        temp_files: writers' temp files.
        temp_bytes: their size.
        counters: what processes that used this store as (or behind) a shared store recorded
            at exit; shown only when there are any.
    """

    store: str
    entries: int
    bytes: int
    compile_seconds: float
    functions: dict[str, int]
    machines: dict[str, int]
    verify_only_markers: int
    verified_guards: int
    not_stored: dict[str, str]
    unreadable: int
    stray_files: int
    temp_files: int
    temp_bytes: int
    counters: dict[str, int]

    def as_json(self) -> dict[str, Any]:
        summary = dataclasses.asdict(self)
        if not self.counters:
            del summary["counters"]
        return summary

    def as_text(self) -> Iterator[str]:
        yield f"store: {self.store}"
        yield f"entries: {self.entries}"
        yield f"size: {human_size(self.bytes)} ({self.bytes} bytes)"
        yield f"compile seconds stored: {self.compile_seconds:.2f}"
        if self.verify_only_markers:
            yield f"verify-only markers: {self.verify_only_markers}"
        if self.verified_guards:
            yield (f"verified guards: {self.verified_guards} (inputs with which an entry was "
                   "traced and compared once: loaded with no trace from then on)")
        if self.unreadable:
            yield f"unreadable: {self.unreadable}"
        if self.not_stored:
            yield "not stored (every process compiles them; kiln warned with what to do):"
            for function, reason in sorted(self.not_stored.items()):
                yield f"  {function}: {reason}"
        if self.stray_files:
            yield f"stray files (not entries): {self.stray_files}"
        if self.temp_files:
            yield (f"temp files: {self.temp_files} ({human_size(self.temp_bytes)}; writes in "
                   "progress, or left by killed writers: 'kiln prune' removes those)")
        if self.machines:
            yield "machine kinds (entries each):"
            for line in columns([(str(n), m) for m, n in self.machines.items()], (True, False)):
                yield "  " + line
        if self.functions:
            yield "functions:"
            for line in columns([(str(n), f) for f, n in self.functions.items()], (True, False)):
                yield "  " + line
        if self.counters:
            yield "recorded by processes with a shared store (at exit):"
            yield "  " + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in self.counters.items())
