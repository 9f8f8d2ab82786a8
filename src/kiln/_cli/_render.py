"""How the command line shows things: data on stdout, diagnostics on stderr, and one renderer
(:func:`show`) for what a verb found, as text or as JSON (``--json``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Report", "ago", "columns", "count_entries", "human_size", "note", "say", "show"]


class Report(Protocol):
    """What a verb found, ready to show either way."""

    def as_json(self) -> Any:
        """Plain data for ``--json`` (printed indented by two)."""
        ...

    def as_text(self) -> Iterable[str | Table]:
        """Lines for people; a rich table is printed as rich prints it."""
        ...


def show(report: Report, *, as_json: bool) -> None:
    """Print ``report`` on stdout: its JSON (``as_json``) or its text."""
    if as_json:
        say(json.dumps(report.as_json(), indent=2))
        return
    for item in report.as_text():
        if isinstance(item, str):
            say(item)
        else:
            _print_table(item)


def _print_table(table: Table) -> None:
    from rich.console import Console

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        console = Console(file=sys.stdout, highlight=False, width=160)
    console.print(table)


def say(line: str = "") -> None:
    """One line of data on stdout."""
    print(line, file=sys.stdout, flush=True)


def note(line: str) -> None:
    """One line of diagnostics on stderr."""
    print(line, file=sys.stderr, flush=True)


def human_size(n: int) -> str:
    """Bytes as ``512 B``, ``28.4 KiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def ago(seconds: float) -> str:
    """An age in seconds as ``12 s ago``, ``5 min ago``, ``3 h ago``, ``2 d ago``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{int(seconds)} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"


def columns(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Plain aligned columns (two spaces apart, no trailing blanks): stable for pipes and tests."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if r else c.ljust(w)
                      for c, w, r in zip(row, widths, right, strict=True)).rstrip()
            for row in rows]


def count_entries(n: int) -> str:
    """``1 entry``, ``3 entries``."""
    return f"{n} entry" if n == 1 else f"{n} entries"
