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
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.extend.core as jex

from . import _jax_compat, _noinline, _stats
from ._fingerprint import manifest_for

if TYPE_CHECKING:
    from ._jit import _Miss

__all__ = ["wait_for_tier_up", "MAX_EQUATIONS", "DIRECT_RATIO"]

logger = logging.getLogger("kiln")

# Above this many equations once inlined (a recursive noinline function grows exponentially),
# a program keeps calling its noinline functions instead of tiering up.
MAX_EQUATIONS = 50_000

# Compile the inlined program directly, with no host-callback tier first, when inlining makes
# the program at most this many times larger than compiling its pieces separately (a small
# vector field inside a big solver: the callbacks would only slow the first run down).
DIRECT_RATIO = 2.0

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


def structs(leaves: list[Any]) -> list[jax.ShapeDtypeStruct]:
    """Abstract arguments of a program (sharded ones keep their sharding)."""
    multi = jax.device_count() > 1
    return [
        jax.ShapeDtypeStruct(
            x.shape, x.dtype, weak_type=jax.typeof(x).weak_type,
            sharding=x.sharding if multi and isinstance(x, jax.Array) else None,
        )
        for x in leaves
    ]


def start(miss: _Miss, table_key: Any) -> None:
    """Compile ``miss``'s program inlined in a background thread, then swap it in and store it.

    Called right after the not-inlined executable was put in the table, before it first runs
    (the argument leaves are still alive, even if donated).
    """
    thread = threading.Thread(
        target=_run, args=(miss, table_key, structs(miss.leaves), _jax_compat.local_config()),
        name=f"kiln tier-up {miss.jf._name}", daemon=True,
    )
    with _pending_lock:
        _pending.add(thread)
    thread.start()


def lower_inlined(miss: _Miss, args: list[Any]) -> jax.stages.Lowered:
    """``miss``'s traced jaxpr lowered with its noinline calls inlined (same calling convention
    and donation as the first executable)."""
    assert miss.traced is not None  # internal invariant
    run = jex.jaxpr_as_fun(miss.traced.jaxpr)

    def inlined(*leaves: Any) -> Any:
        return run(*leaves)

    # a fresh function, so jax's trace and lowering caches cannot hand back the first lowering
    inlined.__name__ = inlined.__qualname__ = miss.jf._name
    args_info = jax.tree_util.tree_leaves(miss.traced.args_info)
    donate = tuple(i for i, a in enumerate(args_info) if a.donated)
    with _noinline.inlining():
        return jax.jit(inlined, donate_argnums=donate).trace(*args).lower()


def _run(miss: _Miss, table_key: Any, structs: list[Any], config: list[Any]) -> None:
    try:
        # the caller's thread-local jax config (a `with jax.enable_x64(True):` block, ...)
        with _jax_compat.apply_local_config(config):
            _tier_up(miss, table_key, structs)
    except Exception as e:  # noqa: BLE001 - tier-up is an optimization: never break the program
        logger.warning(
            "kiln: tier-up of %s failed (%s: %s); it keeps calling its noinline functions",
            miss.jf._name, type(e).__name__, e,
        )
    finally:
        with _pending_lock:
            _pending.discard(threading.current_thread())


def _tier_up(miss: _Miss, table_key: Any, structs: list[Any]) -> None:
    jf = miss.jf
    t0 = time.perf_counter()
    if miss.traced is None:  # loaded without tracing: trace now (in this thread)
        miss._trace()
        if not miss._tier_up_candidate():
            return
    result = compile_and_store_inlined(miss, structs, t0)
    with jf._lock:
        if table_key in jf._table:  # not cleared meanwhile
            jf._table[table_key] = result
            if jf._dispatch is not None:
                jf._dispatch._clear_cache()  # type: ignore[attr-defined]
    _stats.bump(tier_ups=1)
    miss._explain("tier-up", f"inlined program swapped in (compiled in the background in "
                             f"{time.perf_counter() - t0:.2f} s)")


def compile_and_store_inlined(miss: _Miss, args: list[Any], t0: float) -> Any:
    """Compile ``miss``'s program with its noinline calls inlined, store it (header ``tier:
    inlined``) under its fingerprint key, or on the verify path under the inlined module's key,
    and return the callable executable."""
    assert miss.traced is not None  # internal invariant
    lowered = miss._inlined_lowering(args)
    want, got = _arg_avals(miss.traced), _arg_avals(lowered)
    if want != got:  # never swap in or store an executable of another signature
        raise RuntimeError(f"inlined program takes {got}, the program {want}")
    compiled = _jax_compat.with_out_tree(lowered.compile(), miss.traced.out_tree)
    seconds = time.perf_counter() - t0
    _stats.bump(compiles=1, compile_seconds=seconds)
    result, sections, mode = miss._serialize(compiled)
    if sections is None:
        return result
    if miss.key is not None and miss.key == miss.fp_key:
        # the inlined executable also depends on the noinline functions' own code
        codes = set(miss.calls)
        for _, sub_jaxpr in _noinline.calls_in(miss.traced.jaxpr.jaxpr):
            codes |= _jax_compat.codes_in_jaxpr(sub_jaxpr)
        manifest, reason = manifest_for(codes, miss.fp, miss.imported)
        if reason is not None:
            miss._explain("tier-up", f"inlined program not stored: {reason}")
            return result
        key = miss.key
    elif miss.inlined_key is not None:
        # the verify path: keyed by this very inlined module, which holds all of the code
        key, manifest = miss.inlined_key, None
    else:
        return result
    header = miss._header(mode, manifest, seconds, seconds)
    # the digest of what was compiled: a warm process checks it (audit mode, callbacks
    # rebuilt by tracing) against its own inlined lowering
    header["lowered"], header["lapack"] = miss.inlined_digest, miss.inlined_lapack
    header["tier"] = "inlined"
    miss._put(key, header, sections)
    return result


def _arg_avals(stage: jax.stages.Traced | jax.stages.Lowered) -> list[str]:
    return [str(a._aval) for a in jax.tree_util.tree_leaves(stage.args_info)]


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
