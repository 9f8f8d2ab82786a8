"""Tier-up: a program that calls :func:`kiln.noinline` functions is swapped for its inlined form.

Under :func:`kiln.jit`, the first executable of a program that calls noinline functions keeps
those calls as host callbacks into their own executables: quick to compile, slower to run
(a host round trip per call site). Meanwhile a background thread lowers the same program with
every noinline call (of functions with ``tier_up=True``) inlined, as a nested ``jax.jit`` would
be, compiles it, swaps it into the function's table (and C++ dispatch cache) and stores it under
the same key, so later calls run at plain ``jax.jit`` speed and later processes load the inlined
executable directly (no trace, no compile). The tiered program is lowered from the very jaxpr
the first executable was lowered from: the two compute the same function.

The idea is a JIT's tiered compilation (a baseline tier first, an optimizing tier in the
background: V8, HotSpot, Julia's proposals for JAX in jax-ml/jax #4572).

Turn it off with ``kiln.noinline(..., tier_up=False)`` (per function), or
``kiln.configure(tier_up=False)`` / ``KILN_TIER_UP=0`` (every program). :func:`wait_for_tier_up`
blocks until the background compiles started so far are done; at exit kiln waits for them too,
so the inlined executable reaches the store.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._base import _jax_compat, _stats
from . import _noinline_p
from ._explain import Explainer
from ._program import Program, structs

__all__ = ["Plan", "Policy", "wait_for_tier_up", "start"]

logger = logging.getLogger("kiln")

# Above this many equations once inlined (a recursive noinline function grows exponentially),
# a program keeps calling its noinline functions instead of tiering up.
MAX_EQUATIONS = 50_000

# Compile the inlined program directly, with no host-callback tier first, when inlining makes
# the program at most this many times larger than compiling its pieces separately (a small
# vector field inside a big solver: the callbacks would only slow the first run down).
DIRECT_RATIO = 2.0


class Policy:
    """Which form of a program that calls kiln.noinline functions is compiled, and when: the
    lowered one first and the inlined one in the background (tier-up), the inlined one
    directly, or the lowered one only. Decided once per miss, after tracing.

    ``start``: after this miss, compile the inlined form in the background (:func:`start`),
    to replace the entry under ``key``.
    """

    def __init__(self, program: Program, tier_up: bool, may_tier_up: bool,
                 explain: Explainer) -> None:
        self.program = program
        self.tier_up = tier_up  # the tier_up setting (KILN_TIER_UP)
        self.may_tier_up = may_tier_up  # False for kiln.noinline's own executables
        self.explain = explain
        self.start = False
        self.key: str | None = None

    def compile_inlined_now(self, key: str) -> bool:
        """About to compile the entry under ``key``: whether to compile the inlined form at
        once (``inline_directly``); else ``start`` says whether a tier-up follows."""
        self.key = key
        self.start = self.candidate and self.tier_up
        if self.start and self.inline_directly:
            self.start = False
            return True
        return False

    def loaded_first_tier(self, key: str) -> None:
        """The entry under ``key`` was stored before its inlined form was ready: tier up in
        this process (where tier-up is on)."""
        if self.tier_up and self.may_tier_up:
            self.start, self.key = True, key

    @functools.cached_property
    def candidate(self) -> bool:
        """Whether this (traced) program calls kiln.noinline functions that tier-up would
        inline, and is small enough once inlined; whether tier-up is on is separate."""
        traced = self.program.traced
        assert traced is not None  # internal invariant: asked after tracing
        if not self.may_tier_up or not _noinline_p.calls_in(traced.jaxpr.jaxpr):
            return False
        size = self.program.inlined_size
        if size > MAX_EQUATIONS:
            self.explain(
                "tier-up",
                f"no tier-up: inlined, the program would have {size} equations "
                f"(more than {MAX_EQUATIONS}); it keeps calling its noinline functions",
            )
            return False
        return True

    @functools.cached_property
    def inline_directly(self) -> bool:
        """Whether to skip the host-callback tier: inlining the noinline calls makes the program
        at most ``DIRECT_RATIO`` times larger than its separately compiled pieces."""
        traced = self.program.traced
        assert traced is not None  # internal invariant: asked after tracing
        separate = _noinline_p.separate_size(traced.jaxpr.jaxpr)
        size = self.program.inlined_size
        if size > DIRECT_RATIO * separate:
            return False
        self.explain(
            "tier-up",
            f"compiling the program inlined directly: inlined it has {size} "
            f"equations, its separately compiled pieces {separate}",
        )
        return True

_pending: set[threading.Thread] = set()
_pending_lock = threading.Lock()


def wait_for_tier_up(timeout: float | None = None) -> bool:
    """Block until every background tier-up compile started so far has finished.

    Args:
        timeout: at most this many seconds in all (``None``: no limit).

    Returns:
        True when none is still running.

    Example:
        >>> import kiln
        >>> kiln.wait_for_tier_up(timeout=60.0)
        True
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _pending_lock:
            threads = list(_pending)
        if not threads:
            return True
        for t in threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            t.join(left)
            if t.is_alive():
                return False


@dataclasses.dataclass(frozen=True)
class Plan:
    """A tier-up a miss asks for (its result's ``tier_up``): the program of the function
    ``name`` to compile inlined, the ``policy`` that decided it, and ``compile_inlined(args,
    t0)``, which compiles and stores that form and gives its executable."""

    name: str
    program: Program
    policy: Policy
    explain: Explainer
    compile_inlined: Callable[[list[Any], float], Any]


def start(plan: Plan, swap_in: Callable[[Any], None]) -> None:
    """Compile ``plan``'s program inlined in a background thread, store it, and hand the
    executable to ``swap_in`` (the function's table puts it in place of the first one).

    Called right after the lowered program's executable was put in the table, before it first
    runs (the argument leaves are still alive, even if donated).
    """
    thread = threading.Thread(
        target=_run,
        args=(plan, swap_in, structs(plan.program.leaves), _jax_compat.local_config()),
        name=f"kiln tier-up {plan.name}", daemon=True,
    )
    with _pending_lock:
        _pending.add(thread)
    thread.start()


def _run(plan: Plan, swap_in: Callable[[Any], None], structs: list[Any],
         config: list[Any]) -> None:
    try:
        # the caller's thread-local jax config (a `with jax.enable_x64(True):` block, ...)
        with _jax_compat.apply_local_config(config):
            _compile_inlined(plan, swap_in, structs)
    except Exception as e:  # noqa: BLE001 - tier-up is an optimization: never break the program
        logger.warning(
            "kiln: tier-up of %s failed (%s: %s); it keeps calling its noinline functions",
            plan.name, type(e).__name__, e,
        )
    finally:
        with _pending_lock:
            _pending.discard(threading.current_thread())


def _compile_inlined(plan: Plan, swap_in: Callable[[Any], None], structs: list[Any]) -> None:
    t0 = time.perf_counter()
    if plan.program.traced is None:  # loaded without tracing: trace now (in this thread)
        plan.program.trace()
        if not plan.policy.candidate:
            return
    result = plan.compile_inlined(structs, t0)
    swap_in(result)
    _stats.bump(tier_ups=1)
    plan.explain("tier-up", f"inlined program swapped in (compiled in the background in "
                            f"{time.perf_counter() - t0:.2f} s)")


@atexit.register
def _wait_at_exit() -> None:
    with _pending_lock:
        names = sorted(t.name for t in _pending)
    if not names:
        return
    logger.info("kiln: waiting for %s to store the inlined program", ", ".join(names))
    try:
        wait_for_tier_up()
    except KeyboardInterrupt:
        # the tier-up thread is inside XLA: letting the interpreter finalize around it aborts
        # the process (SIGABRT), so leave now; the stored first program tiers up next time
        sys.stderr.write(
            "kiln: interrupted while compiling the inlined program in the background; "
            "it was not stored\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
