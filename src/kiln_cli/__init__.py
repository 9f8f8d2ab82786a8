"""The ``kiln`` script's entry point: kiln's command line (:mod:`kiln._cli`), started without
importing jax.

``import kiln`` turns on the kiln:// route, which imports jax (~1.2 s of CPU), and Python runs
``kiln/__init__`` before any module under ``kiln``, ``kiln._cli`` included. This module lives
outside the ``kiln`` package (as ``kiln_pytest`` does) to say, while it imports ``kiln._cli``,
that the command line is importing kiln: ``kiln/__init__`` then leaves the names whose modules
import jax to their first use, so ``ls``, ``stats``, ``verify``, ``prune``, ``clear``,
``--help`` and ``--version`` never import jax, and the verbs that run JAX (``run``, ``export``,
``import``) turn on what ``import kiln`` turns on before they start. ``python -m kiln`` does the
same (``kiln/__init__`` tells it from ``sys.argv``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["main"]

#: True while :func:`main` imports ``kiln._cli`` (read by ``kiln/__init__``).
importing = False


def main() -> int:
    """Run the ``kiln`` command line on ``sys.argv[1:]``; return its exit status.

    ``kiln run --server`` (``KILN_SERVER=1``) first offers the run to the program's warm
    process (:mod:`kiln_server`, standard library only: nothing of kiln or jax is imported
    for it); where none takes it, the run is a plain one, which at its end records the
    program's imports and starts that process for the next run."""
    import kiln_server

    return kiln_server.command_line(_load)


def _load() -> Callable[[list[str] | None], int]:
    """kiln's command line (``kiln._cli.main``), imported as the command line imports kiln."""
    global importing
    importing = True
    try:
        from kiln._cli import main as cli
    finally:
        importing = False
    return cli
