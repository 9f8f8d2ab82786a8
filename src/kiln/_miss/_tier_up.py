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
from ..stores import Store
from . import _noinline_p
from ._context import MissContext
from ._explain import Explainer
from ._program import Program, structs
from ._writer import EntryWriter

__all__ = ["Plan", "Policy", "start", "wait_for_tier_up"]

logger = logging.getLogger("kiln")

# Above this many equations once inlined (a recursive noinline function grows exponentially),
# a program keeps calling its noinline functions instead of tiering up.
MAX_EQUATIONS = 50_000

# Compile the inlined program directly, with no host-callback tier first, when inlining makes
# the program at most this many times larger than compiling its pieces separately (a small
# vector field inside a big solver: the callbacks would only slow the first run down).
DIRECT_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which form of a program that calls kiln.noinline functions is compiled, and when: the
    lowered one first and the inlined one in the background (tier-up), the inlined one
    directly, or the lowered one only (:meth:`plan`). What it finds out about the traced
    program (:attr:`candidate`, whether to inline directly) it finds, and says, once."""

    program: Program
    tier_up: bool  # the tier_up setting (KILN_TIER_UP)
    may_tier_up: bool  # False for kiln.noinline's own executables
    explain: Explainer

    def plan(self, key: str, loaded_tier: bool = False) -> Plan:
        """The plan for the entry under ``key``, about to be compiled; or (``loaded_tier``)
        found in the store as tier-up's first tier, stored before its inlined form was ready:
        tier up in this process (where tier-up is on)."""
        if loaded_tier:
            return Plan(self, key, start=self.tier_up and self.may_tier_up)
        inlined = self.candidate and self.tier_up
        now = inlined and self._inline_directly
        return Plan(self, key, start=inlined and not now, inline_now=now)

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
    def _inline_directly(self) -> bool:
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a miss does about tier-up for the entry under ``key`` (:meth:`Policy.plan`):
    compile the inlined form instead (``inline_now``), or after the miss in the background
    (``start``), or neither; and (``_Miss._target``) with ``ctx``'s writer, under ``store_key``
    (None: not at all), ``fingerprinted`` (with its manifest) or not, with ``replace`` or not."""

    policy: Policy
    key: str
    start: bool = False
    inline_now: bool = False
    ctx: MissContext | None = None
    store_key: str | None = None
    fingerprinted: bool = False
    replace: bool = False

    def write(self, args: list[Any], t0: float) -> tuple[Any, list[tuple[Store, str]]]:
        """Compile the program with its noinline calls inlined (``args``: its abstract
        arguments) and store it as planned: (the callable executable, entries written)."""
        assert self.ctx is not None  # internal invariant: the miss said where (_Miss._target)
        return EntryWriter(self.ctx).compile_inlined_and_write(
            self.store_key, args, t0, fingerprinted=self.fingerprinted, replace=self.replace)


# puts a tier-up's executable in the function's table, and the entries it wrote with its others
SwapIn = Callable[[Any, list[tuple[Store, str]]], None]

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
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False


def start(plan: Plan, swap_in: SwapIn) -> None:
    """Compile ``plan``'s program inlined in a background thread, store it, and hand the
    executable and entries written to ``swap_in`` (the table puts it in place of the first one).

    Called right after the lowered program's executable was put in the table, before it first
    runs (the argument leaves are still alive, even if donated).
    """
    thread = threading.Thread(
        target=_run,
        args=(plan, swap_in, structs(plan.policy.program.leaves), _jax_compat.local_config()),
        name=f"kiln tier-up {plan.policy.program.name}", daemon=True,
    )
    with _pending_lock:
        _pending.add(thread)
    thread.start()


def _run(plan: Plan, swap_in: SwapIn, structs: list[Any], config: list[Any]) -> None:
    try:
        # the caller's thread-local jax config (a `with jax.enable_x64(True):` block, ...)
        with _jax_compat.apply_local_config(config):
            _compile_inlined(plan, swap_in, structs)
    except Exception as e:  # noqa: BLE001 - tier-up is an optimization: never break the program
        logger.warning(
            "kiln: tier-up of %s failed (%s: %s); it keeps calling its noinline functions",
            plan.policy.program.name, type(e).__name__, e,
        )
    finally:
        with _pending_lock:
            _pending.discard(threading.current_thread())


def _compile_inlined(plan: Plan, swap_in: SwapIn, structs: list[Any]) -> None:
    t0 = time.perf_counter()
    if plan.policy.program.traced is None:  # loaded without tracing: trace now (in this thread)
        plan.policy.program.trace()
        if not plan.policy.candidate:
            return
    swap_in(*plan.write(structs, t0))
    _stats.bump(tier_ups=1)
    plan.policy.explain("tier-up", f"inlined program swapped in (compiled in the background "
                                   f"in {time.perf_counter() - t0:.2f} s)")


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
