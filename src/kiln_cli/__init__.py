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

__all__ = ["main"]

#: True while :func:`main` imports ``kiln._cli`` (read by ``kiln/__init__``).
importing = False


def main() -> int:
    """Run the ``kiln`` command line on ``sys.argv[1:]``; return its exit status."""
    global importing
    importing = True
    try:
        from kiln._cli import main as cli
    finally:
        importing = False
    return cli()
