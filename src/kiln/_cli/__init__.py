"""The ``kiln`` command line: run a script with kiln, inspect and maintain the store, demo.

Verbs::

    kiln run [--explain] [--verify] [--store URL] SCRIPT [ARGS...]
    kiln ls [--json]                      one row per entry (headers only, no payload read)
    kiln stats [--json]                   entry count, bytes, per-function counts
    kiln verify [--json] [--delete-bad]   decode every entry and check its digest / signature
    kiln prune --max-size SIZE [--dry-run]
    kiln clear --yes | --dry-run
    kiln export [--function NAME ...] [--json] FILE   selected entries into one bundle file
    kiln import [--json] FILE             load a bundle's entries that fit this machine
    kiln demo [--runs N] [--script PATH] [--json]

Every verb works on the store of kiln's configuration (``KILN_STORE``, ``KILN_CACHE_DIR``, ...);
``--cache-dir DIR`` and ``--store URL`` (before or after the verb) override it. Data goes to
stdout, diagnostics to stderr as ``error: <what>``. Exit status: 0 ok, 1 failure, 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._base import _config, _stats
from .._base._errors import KilnError, KilnWarning, UnverifiableEntry
from .._travel import _jax_cache
from ..stores._entry import short_key

__all__ = ["main"]

#: Wall clock for ages in ``kiln ls`` (tests replace it).
_clock: Callable[[], float] = time.time

_STATS_FIELDS = ("hits", "misses", "traces", "compiles", "compile_seconds", "saved_seconds")


class _Failure(Exception):
    """A verb failed: print ``error: <message>`` and exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with kiln's error format (``error: <what>`` after the usage line)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


# -- formatting ----------------------------------------------------------------------------------
def _human_size(n: int) -> str:
    """Bytes as ``512 B``, ``28.4 KiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{int(seconds)} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"


def _columns(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Plain aligned columns (two spaces apart, no trailing blanks): stable for pipes and tests."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return out


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _show_warning(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: kiln's own warnings as ``kiln: warning:
    <text>`` on stderr (not Python's ``<file>:<line>: StoreWarning: kiln: ...``); any other
    (a script's under ``kiln run``) as Python shows it."""

    def showwarning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: Any = None, line: str | None = None) -> None:
        if not issubclass(category, KilnWarning):
            show(message, category, filename, lineno, file, line)
            return
        text = str(message)
        _note("kiln: warning: " + (text[len("kiln: "):] if text.startswith("kiln: ") else text))

    return showwarning


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


def _say(line: str = "") -> None:
    print(line, file=sys.stdout, flush=True)


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- configuration -------------------------------------------------------------------------------
def _configured(**settings: Any) -> contextlib.AbstractContextManager[None]:
    """Process-wide settings for the duration of a verb, restored afterwards (so calling
    :func:`main` twice in one process does not leak ``--cache-dir`` into the next call)."""
    return _config.process_settings(**settings)


def _open_store() -> Any:
    """The configured store; a local one that kiln would refuse (not a directory, writable by
    others) is an error here (exit 1), as it is a warning in programs. A remote store URL
    (``redis://``, ``s3://``, ...) is the remote store itself, not layered behind the local
    one: ``kiln ls --store redis://...`` lists what the fleet shares."""
    from ..stores import open_store

    store = open_store(_config.get_config(), layered=False)
    check = getattr(store, "check", None)
    if check is not None:
        check()
    return store


def _strays(store: Any) -> list[Any]:
    """Paths in the store that are not entries (local stores; none elsewhere)."""
    return list(getattr(store, "strays", lambda: [])())


def _temps(store: Any) -> tuple[int, int]:
    """(count, bytes) of writers' temp files (in progress or left by killed writers)."""
    n = size = 0
    for p in getattr(store, "temp_files", lambda: [])():
        with contextlib.suppress(OSError):
            size += p.stat().st_size
            n += 1
    return n, size


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


def _rows(store: Any) -> list[_Row]:
    """One row per entry, from headers and stats only (no payload read, nothing marked used)."""
    rows = []
    for key in store.iter():
        try:
            st = store.stat(key)
            header = store.header(key)
        except ValueError:  # a file in the store that is not named like a key
            st, header = None, None
        if st is None and header is None:
            # Vanished since iter() (pruned concurrently), or not an entry at all.
            if not _looks_like_key(key):
                rows.append(_Row(key, "unreadable", "<unreadable>", "-", 0, None, None, None))
            continue
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
        if kind in ("verify-only", "unstorable", "not-storable"):
            # A marker: "this fingerprint needs the verify path", or "this function's
            # executable cannot be stored" (with the reason); no executable behind it.
            function = header.get("function")
            function = function if isinstance(function, str) and "." in function else "-"
            rows.append(_Row(key, kind, function, "-", size, created, last_used, None))
            continue
        calls = header.get("noinline")
        tier = header.get("tier")
        rows.append(_Row(
            key, kind, str(header.get("function", "?")), str(header.get("signature", "?")),
            size, created, last_used, seconds,
            calls=[str(c) for c in calls] if isinstance(calls, list) else [],
            tier=str(tier) if tier is not None else None,
            machine=_machine_of(header),
        ))
    callers: dict[str, set[str]] = {}
    for r in rows:
        for c in r.calls:
            callers.setdefault(c, set()).add(r.function)
    for r in rows:
        r.used_by = sorted(callers.get(r.function, ()))
    rows.sort(key=lambda r: (r.function, r.created or 0.0, r.key))
    return rows


def _machine_of(header: dict[str, Any]) -> str | None:
    """The machine kind an entry was compiled for: its ``machine`` key part (a kiln
    executable) or header field (a JAX-cache value); None for entries older than issue 26."""
    for part in header.get("key_parts") or ():
        if isinstance(part, list | tuple) and len(part) == 2 and part[0] == "machine":
            return str(part[1])
    machine = header.get("machine")
    return machine if isinstance(machine, str) else None


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


def _looks_like_key(key: str) -> bool:
    return len(key) >= 8 and all(c in "0123456789abcdef" for c in key)


# -- verbs ---------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    store = _open_store()
    rows = _rows(store)
    if args.machine:
        want = args.machine.lower()
        rows = [r for r in rows if r.machine is not None and want in r.machine.lower()]
    strays = _strays(store)
    if strays:
        _note(f"{len(strays)} stray file(s) in {store.url} that are not entries (not listed; "
              "'kiln verify' names them, 'kiln verify --delete-bad' removes them)")
    if args.json:
        _say(json.dumps([r.as_json() for r in rows], indent=2))
        return 0
    if not rows:
        _note(f"no entries in {store.url}"
              + (f" for machine kind {args.machine!r}" if args.machine else ""))
        return 0
    now = _clock()
    header = ["FUNCTION", "SIGNATURE", "SIZE", "CREATED", "LAST USED", "COMPILE S", "KEY"]
    # the machine kind column only where the store serves more than one kind (a mixed fleet)
    machines = len({r.machine for r in rows if r.machine}) > 1
    if machines:
        header.append("MACHINE")
    noinline = any(r.calls or r.used_by for r in rows)
    table = [tuple(header + ["NOINLINE"] if noinline else header)]
    for r in rows:
        table.append((
            r.function,
            r.signature,
            _human_size(r.size),
            "-" if r.created is None else _ago(now - r.created),
            "-" if r.last_used is None else _ago(now - r.last_used),
            "-" if r.compile_seconds is None else f"{r.compile_seconds:.2f}",
            short_key(r.key),
            *((r.machine or "-",) if machines else ()),
            *((_noinline_text(r),) if noinline else ()),
        ))
    if not args.verbose:
        # the SIGNATURE column fits the terminal (a training step's ~80 leaves are thousands
        # of characters): what the other columns leave (NOINLINE, last, may run over), >= 40
        others = sum(max(len(t[i]) for t in table) + 2  # (header: without NOINLINE)
                     for i in range(len(header)) if i != 1)
        room = max(40, shutil.get_terminal_size((160, 24)).columns - others)
        table = [table[0]] + [(t[0], _fit_signature(t[1], room), *t[2:]) for t in table[1:]]
    right = ((False, False, True, True, True, True, False) + ((False,) if machines else ())
             + ((False,) if noinline else ()))
    for line in _columns(table, right=right):
        _say(line)
    return 0


def _marker_reason(store: Any, key: str) -> str:
    header = store.header(key) or {}
    return str(header.get("reason", "?"))


def _cmd_stats(args: argparse.Namespace) -> int:
    store = _open_store()
    rows = _rows(store)
    functions = Counter(r.function for r in rows
                        if r.kind not in ("verify-only", "unreadable", "unstorable",
                                          "not-storable"))
    summary = {
        "store": store.url,
        "entries": len(rows),
        "bytes": sum(r.size for r in rows),
        "compile_seconds": round(sum(r.compile_seconds or 0.0 for r in rows), 6),
        "functions": dict(sorted(functions.items())),
        # the machine kinds the store serves (kiln._keys._machine): entries per kind
        "machines": dict(sorted(Counter(r.machine for r in rows if r.machine).items())),
        "verify_only_markers": sum(r.kind == "verify-only" for r in rows),
        # functions whose executable could not be stored, with the reason (kiln warned once)
        "not_stored": {r.function: _marker_reason(store, r.key) for r in rows
                       if r.kind == "unstorable"},
        "unreadable": sum(r.kind == "unreadable" for r in rows),
        "stray_files": len(_strays(store)),
        "temp_files": _temps(store)[0],
        "temp_bytes": _temps(store)[1],
    }
    read_counts = getattr(store, "counts", None)
    counters = read_counts() if read_counts is not None else {}
    if counters:
        # what processes that used this store as (or behind) a shared store recorded at exit
        summary["counters"] = dict(sorted(counters.items()))
    if args.json:
        _say(json.dumps(summary, indent=2))
        return 0
    _say(f"store: {summary['store']}")
    _say(f"entries: {summary['entries']}")
    _say(f"size: {_human_size(summary['bytes'])} ({summary['bytes']} bytes)")
    _say(f"compile seconds stored: {summary['compile_seconds']:.2f}")
    if summary["verify_only_markers"]:
        _say(f"verify-only markers: {summary['verify_only_markers']}")
    if summary["unreadable"]:
        _say(f"unreadable: {summary['unreadable']}")
    if summary["not_stored"]:
        _say("not stored (every process compiles them; kiln warned with what to do):")
        for function, reason in sorted(summary["not_stored"].items()):
            _say(f"  {function}: {reason}")
    if summary["stray_files"]:
        _say(f"stray files (not entries): {summary['stray_files']}")
    if summary["temp_files"]:
        _say(f"temp files: {summary['temp_files']} ({_human_size(summary['temp_bytes'])}; "
             "writes in progress, or left by killed writers: 'kiln prune' removes those)")
    if summary["machines"]:
        _say("machine kinds (entries each):")
        for line in _columns([(str(n), m) for m, n in summary["machines"].items()],
                             (True, False)):
            _say("  " + line)
    if functions:
        _say("functions:")
        for line in _columns([(str(n), f) for f, n in sorted(functions.items())], (True, False)):
            _say("  " + line)
    if summary.get("counters"):
        _say("recorded by processes with a shared store (at exit):")
        counters = summary["counters"].items()
        _say("  " + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in counters))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..stores._entry import decode

    cfg = _config.get_config()
    store = _open_store()
    read = getattr(store, "peek", None) or store.get  # peek: do not disturb the LRU order
    results = []
    for key in sorted(store.iter()):
        reason: str | None = None
        unverified = False  # signed, and no KILN_SIGNING_KEY here: never deleted
        function = "-"
        try:
            blob = read(key)
        except ValueError:
            blob, reason = None, "not named like an entry key"
        except OSError as e:
            blob, reason = None, f"cannot read: {e}"
        if blob is None and reason is None:
            continue  # removed since iter()
        if blob is not None:
            try:
                entry = decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old,
                               key=key)
                function = str(entry.header.get("function", "?"))
                if entry.header.get("kind") == "verify-only" and "." not in function:
                    function = "-"  # an old marker: its "function" held the format version
            except UnverifiableEntry as e:
                reason, unverified = str(e), True
            except KilnError as e:
                reason = str(e)
        deleted = False
        if reason is not None and args.delete_bad and not unverified:
            try:
                deleted = bool(store.delete(key))
            except OSError as e:
                _note(f"error: cannot delete {key}: {e}")
        results.append({"key": key, "ok": reason is None, "function": function,
                        "reason": reason, "deleted": deleted, "unverified": unverified})
    for path in _strays(store):
        deleted = False
        kind = "a directory" if path.is_dir() else "not named like an entry key"
        if args.delete_bad:
            try:
                store.remove_stray(path)
                deleted = True
            except OSError as e:
                _note(f"error: cannot remove {path}: {e}")
        results.append({"key": str(path), "ok": False, "function": "-",
                        "reason": f"stray: {kind}", "deleted": deleted, "unverified": False})
    bad = [r for r in results if not r["ok"] and not r["unverified"]]
    unchecked = [r for r in results if r["unverified"]]
    if args.json:
        _say(json.dumps({
            "store": store.url,
            "entries": results,
            "ok": len(results) - len(bad) - len(unchecked),
            "bad": len(bad),
            "unverified": len(unchecked),
            "deleted": sum(r["deleted"] for r in results),
        }, indent=2))
    else:
        for r in results:
            if r["ok"]:
                _say(f"ok {short_key(r['key'])} {r['function']}")
            elif r["unverified"]:
                _say(f"UNVERIFIED {short_key(r['key'])} {r['reason']}")
            else:
                key = r["key"] if r["reason"].startswith("stray") else short_key(r["key"])
                _say(f"BAD {key} {r['reason']}" + (" (deleted)" if r["deleted"] else ""))
        ok = len(results) - len(bad) - len(unchecked)
        summary = f"{_entries(len(results))}: {ok} ok, {len(bad)} bad"
        if unchecked:
            summary += f", {len(unchecked)} signed and not verified (set KILN_SIGNING_KEY)"
        if args.delete_bad:
            summary += f", {sum(r['deleted'] for r in results)} deleted"
        _say(summary)
    return 1 if bad or unchecked else 0


def _cmd_prune(args: argparse.Namespace) -> int:
    try:
        max_size = _config.parse_size(args.max_size, name="--max-size")
    except KilnError as e:
        raise _Failure(str(e), code=2) from None
    store = _open_store()
    if not callable(getattr(store, "prune", None)):
        raise _Failure(f"store {store.url!r} cannot be pruned (it keeps no last-use order)")
    sizes = {}
    for key in store.iter():
        with contextlib.suppress(ValueError):
            st = store.stat(key)
            if st is not None:
                sizes[key] = st.size
    temps_before = _temps(store)[0]
    evicted = store.prune(max_size, dry_run=args.dry_run)
    swept = temps_before - _temps(store)[0]
    if swept > 0:
        _say(f"removed {swept} temp file(s) left by writers that are gone")
    freed = sum(sizes.get(k, 0) for k in evicted)
    left = sum(sizes.values()) - freed
    verb = "would remove" if args.dry_run else "removed"
    _say(
        f"{verb} {_entries(len(evicted))} ({_human_size(freed)}); "
        f"{_entries(len(sizes) - len(evicted))} ({_human_size(left)}) "
        f"{'would remain' if args.dry_run else 'remain'} in {store.url}"
    )
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    store = _open_store()
    if not (args.yes or args.dry_run):
        raise _Failure(f"clear deletes every entry in {store.url}; pass --yes to confirm", code=2)
    keys = list(store.iter())
    size = 0
    for key in keys:
        with contextlib.suppress(ValueError):
            st = store.stat(key)
            size += st.size if st is not None else 0
    if args.dry_run:
        _say(f"would remove {_entries(len(keys))} ({_human_size(size)}) from {store.url}")
        return 0
    removed = failed = 0
    for key in keys:
        try:
            removed += bool(store.delete(key))
        except OSError as e:
            failed += 1
            _note(f"error: cannot delete {key}: {e}")
    gone = 0
    for path in _strays(store):
        try:
            store.remove_stray(path)
            gone += 1
        except OSError as e:
            failed += 1
            _note(f"error: cannot remove {path}: {e}")
    _say(f"removed {_entries(removed)} ({_human_size(size)}) from {store.url}"
         + (f" and {gone} stray file(s)" if gone else ""))
    return 1 if failed else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .._travel._bundle import write_bundle

    _open_store()  # a store kiln would refuse is an error here
    done = write_bundle(args.file, args.function)
    for key, why in done.skipped:
        _note(f"entry {short_key(key)} not exported: {why}")
    if args.json:
        _say(json.dumps({
            "bundle": done.path, "store": done.store, "entries": done.entries,
            "bytes": done.size, "signed": done.signed,
            "skipped": [{"key": k, "reason": why} for k, why in done.skipped],
        }, indent=2))
        return 0
    functions = len({r["function"] for r in done.entries})
    digest = "signed with KILN_SIGNING_KEY" if done.signed else "SHA-256, not signed"
    _say(f"exported {_entries(len(done.entries))} of {functions} function(s) "
         f"({_human_size(done.size)}, {digest}) from {done.store} to {done.path}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from .._travel._bundle import import_entries

    _open_store()
    report = import_entries(args.file)
    counts = {"loaded": len(report.loaded), "present": len(report.present),
              "skipped": len(report.skipped)}
    if args.json:
        _say(json.dumps({
            "bundle": report.bundle, "store": report.store,
            "entries": [dataclasses.asdict(e) for e in report.entries], **counts,
        }, indent=2))
        return 0
    for e in report.entries:
        reason = f": {e.reason}" if e.reason else ""
        _say(f"{e.status:<7} {short_key(e.key)} {e.function}{reason}")
    _say(f"{_entries(len(report.entries))} in {report.bundle}: {counts['loaded']} loaded, "
         f"{counts['present']} already in the store, {counts['skipped']} skipped; "
         f"store: {report.store}")
    if report.skipped:
        _note("skipped entries were not loaded (reasons above); kiln compiles their functions "
              "on first call here")
    return 0


# -- kiln run ------------------------------------------------------------------------------------
def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    return {f: getattr(after, f) - getattr(before, f)
            for f in (*_STATS_FIELDS, "bad_entries", "jax_cache_hits", "jax_cache_misses",
                      "jax_cache_writes", "remote_hits", "remote_misses", "remote_timeouts",
                      "remote_errors", "lease_waits", "lease_takeovers")}


def _format_summary(delta: dict[str, float]) -> str:
    parts = [
        f"hits: {int(delta['hits'])}",
        f"misses: {int(delta['misses'])}",
        f"traces: {int(delta['traces'])}",
        f"compiles: {int(delta['compiles'])}",
        f"compile_seconds: {delta['compile_seconds']:.2f}",
        f"saved_seconds: {delta['saved_seconds']:.2f}",
    ]
    if delta["bad_entries"]:
        parts.append(f"bad_entries: {int(delta['bad_entries'])}")
    if delta["jax_cache_hits"] or delta["jax_cache_misses"]:
        # plain jax.jit programs through JAX's cache routed into the store (kiln://)
        parts.append(f"jax cache hits: {int(delta['jax_cache_hits'])}, "
                     f"misses: {int(delta['jax_cache_misses'])}, "
                     f"written: {int(delta['jax_cache_writes'])}")
    remote = ("remote_hits", "remote_misses", "remote_timeouts", "remote_errors", "lease_waits",
              "lease_takeovers")
    if any(delta[f] for f in remote):
        # a fleet store: what the remote store answered, and single-flight waits
        parts.append(", ".join(f"{f.replace('_', ' ')}: {int(delta[f])}" for f in remote))
    return "kiln: " + ", ".join(parts)


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The script's traceback without the frames of kiln and runpy above it."""
    tb = exc.__traceback__
    target = os.path.realpath(script)
    probe = tb
    while probe is not None:
        if os.path.realpath(probe.tb_frame.f_code.co_filename) == target:
            tb = probe
            break
        probe = probe.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _exit_code(e: SystemExit) -> int:
    """The status Python would exit with for ``sys.exit(e.code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _cmd_run(args: argparse.Namespace) -> int:
    script = args.script
    if not os.path.isfile(script):
        raise _Failure(f"cannot run {script!r}: no such file", code=2)
    settings: dict[str, Any] = {}
    if args.explain:
        settings["explain"] = True
    if args.verify:
        settings["verify"] = True
    if sys.stderr.isatty() and _config.get_config().progress is None:
        settings["progress"] = True
    handler: logging.Handler | None = None
    kiln_logger = logging.getLogger("kiln")
    if args.explain:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(message)s"))
        kiln_logger.addHandler(handler)
    if _config.get_config().jax_cache:
        # unchanged jax.jit code too: JAX's own cache reads and writes the store (kiln://)
        _jax_cache.enable_jax_cache()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    before = _stats.stats()
    code = 0
    try:
        with _configured(**settings):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = _exit_code(e)
            except KeyboardInterrupt:
                _note("KeyboardInterrupt")
                code = 130
            except Exception as e:  # noqa: BLE001 - report the script's error like python does
                _print_script_traceback(e, script)
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if handler is not None:
            kiln_logger.removeHandler(handler)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        _note(_format_summary(_stats_delta(before, _stats.stats())))
    return code


# -- kiln demo -----------------------------------------------------------------------------------
#: What the demo program imports beyond kiln's own dependencies (the ``examples`` extra).
_DEMO_NEEDS = ("equinox", "diffrax", "optimistix")


def _default_demo_script() -> Path:
    """The demo program shipped with kiln, ``kiln_demo/lotka_volterra.py``: located, never
    imported here (``kiln demo`` runs it as a script in fresh processes)."""
    import importlib.util

    spec = importlib.util.find_spec("kiln_demo")
    if spec is None or not spec.submodule_search_locations:
        raise _Failure("the demo program is not installed (package kiln_demo, part of kiln); "
                       "reinstall kiln, or pass --script PATH")
    missing = [m for m in _DEMO_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise _Failure(f"the demo needs {', '.join(missing)}, not installed; install kiln's "
                       "examples extra: pip install 'jax-kiln[examples]'")
    return Path(next(iter(spec.submodule_search_locations))) / "lotka_volterra.py"


def _run_example(script: Path, jit: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script --jit JIT`` in a fresh process; its last stdout line is one JSON object."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--jit", jit],
        env=env, capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result: Any = None
    if proc.returncode == 0 and lines:
        with contextlib.suppress(ValueError):
            result = json.loads(lines[-1])
    if not isinstance(result, dict) or "time_to_first_result_s" not in result:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        what = f"exited with status {proc.returncode}" if proc.returncode else (
            "did not print a JSON line with time_to_first_result_s last")
        raise _Failure(f"{script} --jit {jit} {what}" + (f":\n{tail}" if tail else ""))
    result["process_wall_s"] = wall
    return result


def _demo_env(**set_vars: str) -> dict[str, str]:
    env = dict(os.environ)
    # Each row controls its own caches: no inherited kiln store, no inherited JAX cache.
    for var in ("KILN_STORE", "KILN_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(var, None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.update(set_vars)
    return env


def _params_text(params: Any) -> str:
    if not isinstance(params, dict):
        return str(params)
    return " / ".join(f"{params[k]:.6g}" if isinstance(params[k], float) else str(params[k])
                      for k in sorted(params))


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise _Failure(f"--runs must be >= 1, got {args.runs}", code=2)
    script = Path(args.script) if args.script else _default_demo_script()
    if not script.is_file():
        raise _Failure(
            f"demo script not found: {script}; "
            + ("pass the path of an existing script" if args.script
               else "the kiln_demo package is incomplete: reinstall kiln, or pass --script PATH")
        )

    # (label, jit mode, environment key, repeat?)
    plan = [
        ("kiln, cold (empty store)", "kiln", "kiln", False),
        ("kiln, warm", "kiln", "kiln", True),
        ("jax.jit", "jax", "plain", False),
        ("jax.jit + JAX persistent cache, cold", "jax", "jaxcache", False),
        ("jax.jit + JAX persistent cache, warm", "jax", "jaxcache", True),
    ]
    rows: list[dict[str, Any]] = []
    all_params: list[tuple[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kiln-demo-store-", ignore_cleanup_errors=True) as d1,
        tempfile.TemporaryDirectory(prefix="kiln-demo-jaxcache-", ignore_cleanup_errors=True) as d2,
    ):
        envs = {
            "kiln": _demo_env(KILN_CACHE_DIR=d1),
            "plain": _demo_env(),
            "jaxcache": _demo_env(
                JAX_ENABLE_COMPILATION_CACHE="true",
                JAX_COMPILATION_CACHE_DIR=d2,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
            ),
        }
        for i, (label, jit, env_name, repeat) in enumerate(plan, 1):
            n = args.runs if repeat else 1
            results = []
            for j in range(n):
                run_no = f" (run {j + 1}/{n})" if n > 1 else ""
                print(f"kiln demo: [{i}/{len(plan)}] running {label}{run_no} ...",
                      end="", file=sys.stderr, flush=True)
                res = _run_example(script, jit, envs[env_name])
                print(f" {res['time_to_first_result_s']:.2f} s to first result", file=sys.stderr,
                      flush=True)
                results.append(res)
                all_params.append((label, res.get("params")))
            rows.append({
                "mode": label,
                "jit": jit,
                "runs": n,
                "time_to_first_result_s": statistics.median(
                    float(r["time_to_first_result_s"]) for r in results),
                "process_wall_s": statistics.median(r["process_wall_s"] for r in results),
                "params": results[0].get("params"),
                "loss": results[0].get("loss"),
            })
    base = next(r for r in rows if r["mode"] == "jax.jit")["time_to_first_result_s"]
    for r in rows:
        t = r["time_to_first_result_s"]
        r["speedup_vs_jax_jit"] = base / t if t > 0 else None
    reference = all_params[0][1]
    differing = sorted({label for label, p in all_params if p != reference})
    identical = not differing

    if args.json:
        _say(json.dumps({"script": str(script), "rows": rows, "identical_params": identical},
                        indent=2))
    else:
        _print_demo_table(rows, args.runs)
        if identical:
            _say(f"fitted parameters identical in every row: {_params_text(reference)}")
        else:
            _say(f"fitted parameters DIFFER from the first row in: {', '.join(differing)}")
    if not identical:
        raise _Failure("fitted parameters differ between rows: " + ", ".join(differing))
    return 0


def _print_demo_table(rows: list[dict[str, Any]], runs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        console = Console(file=sys.stdout, highlight=False, width=160)
    title = "Lotka-Volterra fit, each row a fresh process"
    if runs > 1:
        title += f" (warm rows: median of {runs})"
    table = Table(
        title=title, caption="vs jax.jit: jax.jit's time to first result / this row's"
    )
    table.add_column("mode", no_wrap=True)
    table.add_column("first result (s)", justify="right")
    table.add_column("process wall (s)", justify="right")
    table.add_column("vs jax.jit", justify="right")
    table.add_column("params a / b / c / d", no_wrap=True)
    table.add_column("loss", justify="right")
    for r in rows:
        speedup = r["speedup_vs_jax_jit"]
        table.add_row(
            r["mode"],
            f"{r['time_to_first_result_s']:.2f}",
            f"{r['process_wall_s']:.2f}",
            "-" if speedup is None else f"{speedup:.1f}x",
            _params_text(r["params"]),
            f"{r['loss']:.6g}" if isinstance(r["loss"], float) else str(r["loss"]),
        )
    console.print(table)


# -- parser --------------------------------------------------------------------------------------
def _common(suppress: bool) -> _Parser:
    """``--cache-dir`` / ``--store``, accepted before and after the verb."""
    p = _Parser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    p.add_argument("--cache-dir", metavar="DIR", default=default,
                   help="directory of the local store (default: KILN_CACHE_DIR or the user cache)")
    p.add_argument("--store", metavar="URL", default=default,
                   help="store URL: a directory, 'local', 'memory' or 'null' (default: KILN_STORE)")
    return p


def _parser() -> argparse.ArgumentParser:
    from .._base._version import __version__

    parser = _Parser(
        prog="kiln",
        description="kiln: make XLA compilation a one-time cost for JAX programs.",
        parents=[_common(suppress=False)],
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    common = [_common(suppress=True)]

    run = sub.add_parser(
        "run", parents=common, help="run a Python script with kiln; print hits/misses at exit",
        description="Run SCRIPT as __main__ with kiln configured; print a summary of hits, "
        "misses, traces, compiles and compile seconds spent / saved to stderr at exit. "
        "JAX's own persistent cache is routed into kiln's store (kiln://), so code that calls "
        "jax.jit itself, unchanged, skips its compiles on a second run (KILN_JAX_CACHE=0 "
        "turns that off; a jax_compilation_cache_dir you set is left alone). "
        "Exits with the script's status.",
    )
    run.add_argument("--explain", action="store_true",
                     help="log why each miss happened (kiln.configure(explain=True)) to stderr")
    run.add_argument("--verify", action="store_true",
                     help="audit mode: re-trace every warm hit and compare with the stored module")
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER,
                     help="arguments passed to the script")
    run.set_defaults(func=_cmd_run)

    ls = sub.add_parser("ls", parents=common, help="list the entries of the store",
                        description="One row per entry; reads headers only.")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("-v", "--verbose", action="store_true",
                    help="whole signatures (by default cut to fit the terminal)")
    ls.add_argument("--machine", metavar="KIND",
                    help="only entries compiled for machine kinds containing KIND (as 'kiln "
                         "stats' lists them: 'x86_64 avx512 3f9c2a1b', or a part: 'avx2')")
    ls.set_defaults(func=_cmd_ls)

    stats = sub.add_parser("stats", parents=common, help="summarize the store")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=_cmd_stats)

    verify = sub.add_parser(
        "verify", parents=common, help="check every entry's digest / signature",
        description="Read every entry and check its format and digest (its HMAC signature when "
        "KILN_SIGNING_KEY is set). Exits 1 if any entry is bad (also with --delete-bad).",
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument("--delete-bad", action="store_true", help="delete the bad entries")
    verify.set_defaults(func=_cmd_verify)

    prune = sub.add_parser(
        "prune", parents=common, help="evict least recently used entries down to a size",
        description="Evict least recently used entries of the local store until it holds at "
        "most SIZE bytes.",
    )
    prune.add_argument("--max-size", required=True, metavar="SIZE",
                       help="size such as 2GiB, 500MB or 1048576 (bytes)")
    prune.add_argument("--dry-run", action="store_true", help="only report what would go")
    prune.set_defaults(func=_cmd_prune)

    clear = sub.add_parser("clear", parents=common, help="delete every entry")
    clear.add_argument("--yes", action="store_true", help="confirm deleting every entry")
    clear.add_argument("--dry-run", action="store_true", help="only count what would go")
    clear.set_defaults(func=_cmd_clear)

    export = sub.add_parser(
        "export", parents=common, help="write entries of the store into one bundle file",
        description="Write the store's entries (or those of the functions named by --function) "
        "into FILE, to load on another machine with 'kiln import'. Each entry is verified "
        "first; the bundle records kiln, jax and jaxlib versions, platform and device kind, and "
        "per entry its key, function, size and SHA-256; the whole file carries a SHA-256 "
        "digest, or an HMAC-SHA256 signature when KILN_SIGNING_KEY is set. Exits 1 when no "
        "entry matches (nothing is written).",
    )
    export.add_argument("file", metavar="FILE", help="the bundle file to write (replaced)")
    export.add_argument("--function", action="append", metavar="NAME",
                        help="only entries of this function: module.qualname as 'kiln ls' "
                        "shows it, or its last component; repeatable")
    export.add_argument("--json", action="store_true", help="machine-readable output")
    export.set_defaults(func=_cmd_export)

    import_ = sub.add_parser(
        "import", parents=common, help="load a bundle's entries into the store",
        description="Load the entries of a bundle written by 'kiln export' into the store. The "
        "whole bundle is refused (exit 1, nothing imported) when its digest or signature does "
        "not match: a changed byte, or another KILN_SIGNING_KEY. Entries that do not verify "
        "here, or were built for another kiln, jax or jaxlib version, platform or devices, "
        "are listed with the reason and not loaded; the import still exits 0.",
    )
    import_.add_argument("file", metavar="FILE", help="the bundle file to read")
    import_.add_argument("--json", action="store_true", help="machine-readable output")
    import_.set_defaults(func=_cmd_import)

    demo = sub.add_parser(
        "demo", parents=common,
        help="time the Lotka-Volterra fit: kiln cold / warm vs jax.jit, each a fresh process",
        description="Run the Lotka-Volterra fit shipped with kiln (kiln_demo/lotka_volterra.py; "
        "needs the examples extra) in fresh processes: kiln with an empty "
        "store, kiln warm, plain jax.jit, and jax.jit with JAX's persistent cache; print the "
        "time to first result of each and check that all fitted the same parameters.",
    )
    demo.add_argument("--runs", type=int, default=1, metavar="N",
                      help="repeat the warm rows N times and report the median (default 1)")
    demo.add_argument("--script", metavar="PATH",
                      help="the program to run (default: kiln_demo/lotka_volterra.py)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``kiln`` command line with ``argv`` (default ``sys.argv[1:]``); return the status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 2
    try:
        with _configured(cache_dir=args.cache_dir, store=args.store), \
                warnings.catch_warnings():
            warnings.showwarning = _show_warning(warnings.showwarning)
            return int(args.func(args))
    except _Failure as e:
        _note(f"error: {e}")
        return e.code
    except BrokenPipeError:
        # the reader went away (``kiln ls | head``): not an error; keep Python's exit-time
        # flush of stdout from complaining
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KilnError as e:
        _note(f"error: {e}")
        return 1
    except OSError as e:
        _note(f"error: {e}")
        return 1
