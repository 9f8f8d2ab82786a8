"""kiln's JAX plugin: the early start's hook in JAX's plugin discovery.

JAX calls :func:`initialize` of every module a ``jax_plugins`` entry point names when its first
backend starts, before its first compile (``jax._src.xla_bridge.discover_pjrt_plugins``).
kiln's entry point names this module: where ``kiln_early`` says this program made a kiln
function in its previous run (:func:`kiln_early.claim`), kiln is imported now, so the kiln://
route is on for every compile, as if the program imported kiln first. Apart from ``kiln_early``
so that kiln's packages import one another in one direction only (kiln imports ``kiln_early``;
this module imports both). Never raises: a cache must not stop JAX's backend start.
"""

from __future__ import annotations

import kiln_early

__all__ = ["initialize"]


def initialize() -> None:
    """JAX's call when its first backend starts: import kiln now for a program that used it
    last time."""
    try:
        if kiln_early.claim():
            import kiln  # noqa: F401 - the route (and what else import kiln turns on)
    except Exception:  # noqa: BLE001, S110 - never stop JAX's backend start over a cache
        pass
