"""The global random generators a trace draws from: keyed by what the trace did, not by being
reachable.

NumPy's legacy functions (``np.random.normal``, ``np.random.rand``, ...) are bound methods of
one module-level ``RandomState`` (``numpy.random.mtrand._rand``), and Python's ``random.random``
and friends of one module-level ``random.Random`` (``random._inst``). Their state differs in
every process that does not seed them, and in every process that seeds them from its pid or the
clock. A function that reads ``np.pi`` beside ``jax.random.normal`` *reaches* numpy's generator
by name (``numpy.random.normal``), but its trace never draws from it: keying the generator's
state there made such a function miss on every run (issue 42). So the static walk keys a global
generator by what it is only (:func:`kiln._keys._walk._objects.walk_rng`), and a
:class:`RngWatch` around the trace compares each global generator's state before and after:
one whose state moved was drawn from (a draw always advances the state), and its state before
the trace becomes a manifest item, ``[name, "<rng>", digest]``, re-checked on a warm lookup
(:func:`check_rng`). A trace that draws from the generator through library code the walk never
reaches (a library helper calling ``np.random.permutation``) is keyed the same way.

A generator the user holds (``rng = np.random.default_rng(0)`` at module level, ``self.rng``)
is keyed by its state by the walk, as any value: code that names it reads it.

Not seen: a draw from a global generator by a thread other than the tracing one moves its state
too, so it is keyed as if the trace had drawn (a miss, never a stale result).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

__all__ = ["RNG", "RngWatch", "check_rng", "global_generator_name"]

RNG = "<rng>"

# name -> how to find the generator now (``np.random.seed`` reseeds the same object; a module
# that replaces it, as ``numpy.random.mtrand._rand = ...`` would, is found again by name)
_GLOBALS: dict[str, Callable[[], Any]] = {
    "numpy.random.mtrand._rand": lambda: np.random.mtrand._rand,
    "random._inst": lambda: random._inst,  # type: ignore[attr-defined]
}


def global_generator_name(v: Any) -> str | None:
    """The name of ``v`` if it is one of the process's global generators, else None."""
    return next((name for name, find in _GLOBALS.items() if find() is v), None)


def _state_digest(v: Any) -> str:
    """xxh3-128 of a generator's whole state (its bit generator's, for numpy)."""
    h = xxhash.xxh3_128()
    if isinstance(v, random.Random):
        version, internal, gauss = v.getstate()
        h.update(f"{version}:{gauss!r}:".encode())
        h.update(np.asarray(internal, dtype=np.uint64).tobytes())
    else:
        _feed(h, v.get_state(legacy=False) if isinstance(v, np.random.RandomState)
              else v.bit_generator.state)
    return h.hexdigest()


def _feed(h: Any, v: Any) -> None:
    if isinstance(v, dict):
        for k, item in v.items():
            h.update(f"{k}=".encode())
            _feed(h, item)
    elif isinstance(v, np.ndarray):
        h.update(f"{v.dtype.str}{v.shape}".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    else:
        h.update(f"{type(v).__name__}:{v!r};".encode())


class RngWatch:
    """Around a trace: which global generators it drew from, as ``items`` after the block (see
    the module docstring)."""

    def __init__(self) -> None:
        self.items: list[list[str]] = []
        self._before: dict[str, str] = {}

    def __enter__(self) -> RngWatch:
        self._before = {name: _state_digest(find()) for name, find in _GLOBALS.items()}
        return self

    def __exit__(self, *exc: Any) -> None:
        self.items = [[name, RNG, before] for name, before in self._before.items()
                      if _state_digest(_GLOBALS[name]()) != before]


def check_rng(name: str, digest: str) -> str | None:
    """None if global generator ``name`` is in the state the cold trace drew from, else what
    changed."""
    find = _GLOBALS.get(name)
    if find is None:
        return f"random generator {name} is unknown to this kiln"
    return None if _state_digest(find()) == digest else (
        f"the trace drew from {name} (numpy's or Python's global random generator), whose "
        "state is not the one it drew from")
