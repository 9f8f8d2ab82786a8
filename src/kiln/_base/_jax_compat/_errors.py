"""The exceptions the JAX gate raises: a program that cannot be written as an entry, a stored
callback whose live object is gone.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

__all__ = ['Unserializable', 'LiveObjectMissing']


class Unserializable(Exception):
    """This compiled program cannot be written as an entry (and why).

    ``advice``: what the user can do about it (the warning says it), or ``""``."""

    def __init__(self, reason: str, advice: str = "") -> None:
        super().__init__(reason)
        self.advice = advice


class LiveObjectMissing(Exception):
    """A stored host callback refers to a live object this process's walk did not give (the
    callbacks are then rebuilt by tracing: :func:`unpickle_callbacks`)."""
