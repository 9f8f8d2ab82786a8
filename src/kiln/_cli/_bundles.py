"""``kiln export`` and ``kiln import``: entries of the store into one bundle file, and back into
a store on another machine (:mod:`kiln._travel._bundle`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._base import short_key
from ._common import open_store, start_jax
from ._render import count_entries, human_size, note, show

if TYPE_CHECKING:
    from .._travel import Exported, ImportReport

__all__ = ["register"]


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``export`` and ``import`` to the ``kiln`` parser's ``verbs``."""
    export = verbs.add_parser(
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

    import_ = verbs.add_parser(
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


# -- kiln export ---------------------------------------------------------------------------------
def _cmd_export(args: argparse.Namespace) -> int:
    open_store()  # a store kiln would refuse is an error here
    start_jax()
    from .._travel import write_bundle

    done = write_bundle(args.file, args.function)
    for key, why in done.skipped:
        note(f"entry {short_key(key)} not exported: {why}")
    show(_Written(done), as_json=args.json)
    return 0


@dataclasses.dataclass(frozen=True)
class _Written:
    """``kiln export``: the bundle written."""

    bundle: Exported

    def as_json(self) -> dict[str, Any]:
        done = self.bundle
        return {
            "bundle": done.path, "store": done.store, "entries": done.entries,
            "bytes": done.size, "signed": done.signed,
            "skipped": [{"key": k, "reason": why} for k, why in done.skipped],
        }

    def as_text(self) -> Iterator[str]:
        done = self.bundle
        functions = len({r["function"] for r in done.entries})
        digest = "signed with KILN_SIGNING_KEY" if done.signed else "SHA-256, not signed"
        yield (f"exported {count_entries(len(done.entries))} of {functions} function(s) "
               f"({human_size(done.size)}, {digest}) from {done.store} to {done.path}")


# -- kiln import ---------------------------------------------------------------------------------
def _cmd_import(args: argparse.Namespace) -> int:
    open_store()
    start_jax()
    from .._travel import import_entries

    report = import_entries(args.file)
    show(_Imported(report), as_json=args.json)
    if report.skipped and not args.json:
        note("skipped entries were not loaded (reasons above); kiln compiles their functions "
             "on first call here")
    return 0


@dataclasses.dataclass(frozen=True)
class _Imported:
    """``kiln import``: what was done with each entry of the bundle."""

    report: ImportReport

    def as_json(self) -> dict[str, Any]:
        report = self.report
        return {
            "bundle": report.bundle, "store": report.store,
            "entries": [dataclasses.asdict(e) for e in report.entries],
            "loaded": len(report.loaded), "present": len(report.present),
            "skipped": len(report.skipped),
        }

    def as_text(self) -> Iterator[str]:
        report = self.report
        for e in report.entries:
            reason = f": {e.reason}" if e.reason else ""
            yield f"{e.status:<7} {short_key(e.key)} {e.function}{reason}"
        yield (f"{count_entries(len(report.entries))} in {report.bundle}: "
               f"{len(report.loaded)} loaded, {len(report.present)} already in the store, "
               f"{len(report.skipped)} skipped; store: {report.store}")
