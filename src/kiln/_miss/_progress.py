"""A progress line on stderr while a compile runs longer than ~1.5 seconds."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["compiling"]

DELAY_SECONDS = 1.5


@contextmanager
def compiling(name: str, enabled: bool | None, *, doing: str = "compiling") -> Iterator[None]:
    """Show ``kiln: compiling NAME (N s)`` on stderr after ``DELAY_SECONDS`` until the block ends
    (``doing``: another verb, e.g. ``"waiting for another process compiling"``).

    ``enabled=None`` shows it only when stderr is a terminal.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield
        return
    from rich.console import Console

    done = threading.Event()
    start = time.perf_counter()

    def run() -> None:
        if done.wait(DELAY_SECONDS):
            return
        console = Console(stderr=True)
        with console.status(f"kiln: {doing} {name}") as status:
            while not done.wait(0.25):
                status.update(f"kiln: {doing} {name} ({time.perf_counter() - start:.1f} s)")
        console.print(f"kiln: {doing} {name}: done in {time.perf_counter() - start:.1f} s")

    thread = threading.Thread(target=run, name="kiln-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
