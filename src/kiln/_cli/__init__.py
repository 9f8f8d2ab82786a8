"""The ``kiln`` command line: run a script with kiln, inspect and maintain the store, demo.

Verbs::

    kiln run [--explain] [--verify] [--no-jit] [--store URL] SCRIPT [ARGS...]
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

The verbs live one command group per module (``_run``, ``_inspect``, ``_maintain``,
``_bundles``, ``_demo``); ``_main`` holds the parser and :func:`main`, ``_render`` shows what a
verb found as text or ``--json``.

Only the verbs that run JAX import it, when they run (``run``; ``export`` and ``import``, which
read this machine's backend), after :func:`._common.start_jax`; every module here imports only
what does not import jax, so ``ls``, ``stats``, ``verify``, ``prune``, ``clear``, ``--help``
and ``--version`` answer without it. That holds from the ``kiln`` script (``kiln_cli``) and
``python -m kiln``, whose ``import kiln`` leaves jax unimported (``kiln/__init__``).
"""

from ._main import main as main

__all__ = ["main"]
