"""``kiln verify``, ``kiln prune`` and ``kiln clear``: check the store's entries, evict the least
recently used, empty it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from typing import Any

from .._base import KilnError, _config, short_key
from ..stores import _inventory as inventory
from ._common import Failure, open_store
from ._render import count_entries, human_size, note, say, show

__all__ = ["register"]


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``verify``, ``prune`` and ``clear`` to the ``kiln`` parser's ``verbs``."""
    verify = verbs.add_parser(
        "verify", parents=common, help="check every entry's digest / signature",
        description="Read every entry and check its format and digest (its HMAC signature when "
        "KILN_SIGNING_KEY is set). Exits 1 if any entry is bad (also with --delete-bad).",
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument("--delete-bad", action="store_true", help="delete the bad entries")
    verify.set_defaults(func=_cmd_verify)

    prune = verbs.add_parser(
        "prune", parents=common, help="evict least recently used entries down to a size",
        description="Evict least recently used entries of the local store until it holds at "
        "most SIZE bytes.",
    )
    prune.add_argument("--max-size", required=True, metavar="SIZE",
                       help="size such as 2GiB, 500MB or 1048576 (bytes)")
    prune.add_argument("--dry-run", action="store_true", help="only report what would go")
    prune.set_defaults(func=_cmd_prune)

    clear = verbs.add_parser("clear", parents=common, help="delete every entry")
    clear.add_argument("--yes", action="store_true", help="confirm deleting every entry")
    clear.add_argument("--dry-run", action="store_true", help="only count what would go")
    clear.set_defaults(func=_cmd_clear)


# -- kiln verify ---------------------------------------------------------------------------------
def _cmd_verify(args: argparse.Namespace) -> int:
    cfg = _config.get_config()
    store = open_store()
    verdicts = []
    for verdict in inventory.verify(store, signing_key=cfg.signing_key,
                                    old_keys=cfg.signing_keys_old, delete=args.delete_bad):
        if verdict.error is not None:
            note(f"error: {verdict.error}")
        verdicts.append(verdict)
    report = _Verified(store.url, verdicts, deleting=args.delete_bad)
    show(report, as_json=args.json)
    return 1 if report.count("bad") or report.count("unverified") else 0


@dataclasses.dataclass(frozen=True)
class _Verified:
    """``kiln verify``: a verdict per entry and stray; ``deleting``: ``--delete-bad``."""

    store: str
    verdicts: list[inventory.Verdict]
    deleting: bool

    def count(self, what: str) -> int:
        """How many verdicts are ``what`` (``ok``, ``bad``, ``unverified``, ``deleted``)."""
        return sum(getattr(v, what) for v in self.verdicts)

    def as_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "entries": [{"key": v.key, "ok": v.ok, "function": v.function, "reason": v.reason,
                         "deleted": v.deleted, "unverified": v.unverified}
                        for v in self.verdicts],
            **{what: self.count(what) for what in ("ok", "bad", "unverified", "deleted")},
        }

    def as_text(self) -> Iterator[str]:
        for v in self.verdicts:
            if v.ok:
                yield f"ok {short_key(v.key)} {v.function}"
            elif v.unverified:
                yield f"UNVERIFIED {short_key(v.key)} {v.reason}"
            else:
                key = v.key if v.stray else short_key(v.key)
                yield f"BAD {key} {v.reason}" + (" (deleted)" if v.deleted else "")
        summary = (f"{count_entries(len(self.verdicts))}: {self.count('ok')} ok, "
                   f"{self.count('bad')} bad")
        if self.count("unverified"):
            summary += (f", {self.count('unverified')} signed and not verified "
                        "(set KILN_SIGNING_KEY)")
        if self.deleting:
            summary += f", {self.count('deleted')} deleted"
        yield summary


# -- kiln prune ----------------------------------------------------------------------------------
def _cmd_prune(args: argparse.Namespace) -> int:
    try:
        max_size = _config.parse_size(args.max_size, name="--max-size")
    except KilnError as e:
        raise Failure(str(e), code=2) from None
    store = open_store()
    pruned = inventory.prune(store, max_size, dry_run=args.dry_run)
    if pruned.temp_files_removed > 0:
        say(f"removed {pruned.temp_files_removed} temp file(s) left by writers that are gone")
    say(
        f"{'would remove' if args.dry_run else 'removed'} {count_entries(len(pruned.evicted))} "
        f"({human_size(pruned.freed)}); {count_entries(pruned.kept)} "
        f"({human_size(pruned.kept_bytes)}) {'would remain' if args.dry_run else 'remain'} "
        f"in {store.url}"
    )
    return 0


# -- kiln clear ----------------------------------------------------------------------------------
def _cmd_clear(args: argparse.Namespace) -> int:
    store = open_store()
    if not (args.yes or args.dry_run):
        raise Failure(f"clear deletes every entry in {store.url}; pass --yes to confirm", code=2)
    keys = list(store.iter())
    size = sum(inventory.entry_sizes(store, keys).values())
    if args.dry_run:
        say(f"would remove {count_entries(len(keys))} ({human_size(size)}) from {store.url}")
        return 0
    cleared = inventory.clear(store, keys)
    for error in cleared.errors:
        note(f"error: {error}")
    say(f"removed {count_entries(cleared.entries)} ({human_size(size)}) from {store.url}"
        + (f" and {cleared.strays} stray file(s)" if cleared.strays else ""))
    return 1 if cleared.errors else 0
