"""What ``import kiln`` turns on, once per process and in this order: the kiln:// route (JAX's
own cache in kiln's store: :func:`kiln._travel.enable_at_import`), then with
``KILN_REPLACE_JIT=1`` every ``jax.jit`` a kiln.jit (:func:`._swap.replace_at_import`).

``kiln/__init__`` calls it at import. Where the ``kiln`` command line imported kiln without
jax (``kiln_cli``, ``python -m kiln``), the verbs that run JAX call it before they start, and
so does the first use of a name of kiln's whose module imports jax (``kiln.jit``).
"""

from __future__ import annotations

from .._travel import enable_at_import
from ._swap import replace_at_import

__all__ = ["at_import"]

_done = False


def at_import() -> None:
    """Turn on what ``import kiln`` turns on; a no-op from the second call on. Never raises."""
    global _done
    if _done:
        return
    _done = True
    enable_at_import()
    replace_at_import()
