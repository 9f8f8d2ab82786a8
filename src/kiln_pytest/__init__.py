"""kiln's pytest plugin: ``pytest --kiln`` runs a test suite with JAX's own persistent
compilation cache routed into kiln's store (:func:`kiln.enable_jax_cache`) and every
``jax.jit`` a ``kiln.jit`` (below), so the second run of a JAX project's tests loads the
executables the first one compiled.

Registered through the ``pytest11`` entry point ``kiln`` (``-p no:kiln`` disables it). Without
``--kiln`` (or ``KILN_PYTEST=1``) it does nothing and imports nothing: this module lives outside
the ``kiln`` package so that loading the plugin does not import jax into every pytest run.

What it covers is what JAX's cache covers: every ``jax.jit`` program and eager operation the
tests compile, in the pytest process and in any worker (pytest-xdist) that loads the plugin. On
jax 0.10, programs with host callbacks (``jax.debug.print``, ``io_callback``) are compiled again;
jax 0.11 and later cache those too.

``--kiln`` also makes every ``jax.jit`` made outside JAX itself a ``kiln.jit``
(:func:`kiln.replace_jax_jit`, from before the test modules are imported; the default since
issue 43, as ``kiln run``), so the second run skips tracing and lowering too; the summary then
gives kiln.jit's hits, misses and traces. ``--kiln-no-jit`` (or ``KILN_PYTEST_JIT=0``, or
``KILN_REPLACE_JIT=0``) leaves ``jax.jit`` alone: JAX's cache routed into the store only.
``--kiln-jit`` (``KILN_PYTEST_JIT=1``) says the default explicitly and implies ``--kiln``.
Trace-time side effects (a test counting how often its function is traced) differ on a warm
run: leave such a function to jax.jit with ``kiln.keep_jax_jit`` or ``KILN_JIT_EXCLUDE``, or
run the suite with ``--kiln-no-jit``.

Under ``--kiln`` the record of the process's inputs (kiln's guard) starts before the first
conftest is imported, so what a conftest reads to set up state (a data file, a variable) is an
input of every entry the suite stores.

The summary's JAX cache line also gives the programs JAX lowered itself and the seconds that
took (``kiln.stats().jax_lowerings`` / ``jax_lower_seconds``): what a warm run still pays,
before JAX's cache can look a key up, for eager operations and for the jits kiln.jit does not
cover (JAX's own, such as ``jax.numpy``'s functions called outside any jit).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_load_initial_conftests",
           "pytest_terminal_summary"]

# (whether the route is on, kiln.stats() when the session began, whether jax.jit is swapped)
_STATE = pytest.StashKey[tuple[bool, Any, bool]]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kiln", "kiln: compile once across test runs")
    group.addoption(
        "--kiln", action="store_true", default=False,
        help="route JAX's persistent compilation cache into kiln's store (KILN_CACHE_DIR / "
        "KILN_STORE), so a second run skips the first run's compiles; also KILN_PYTEST=1",
    )
    group.addoption(
        "--kiln-jit", action="store_true", default=False,
        help="every jax.jit outside JAX itself a kiln.jit (kiln.replace_jax_jit), so a second "
        "run skips tracing and lowering too: the default of --kiln; implies --kiln; also "
        "KILN_PYTEST_JIT=1",
    )
    group.addoption(
        "--kiln-no-jit", action="store_true", default=False,
        help="leave jax.jit alone under --kiln: JAX's cache routed into kiln's store only (a "
        "second run still traces and lowers); also KILN_PYTEST_JIT=0 or KILN_REPLACE_JIT=0",
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _env_flag(name: str) -> bool | None:
    """``name`` as a flag; None where it is unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise pytest.UsageError(
            f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {raw!r}")
    return None if not raw else raw in _TRUE


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any, parser: Any, args: list[str]) -> None:
    """Under ``--kiln`` (``--kiln-jit``, ``KILN_PYTEST=1``, ``KILN_PYTEST_JIT=1``): the record of
    the process's inputs (kiln's guard, ``kiln_early._inputs``: standard library only) from
    before the first conftest is imported, as ``kiln run`` starts it before the program."""
    try:
        wanted = any(a in ("--kiln", "--kiln-jit") for a in args) or any(
            _env_flag(n) for n in ("KILN_PYTEST", "KILN_PYTEST_JIT"))
    except pytest.UsageError:
        return  # (said again, as an error, by pytest_configure)
    if wanted:
        from kiln_early import _inputs

        _inputs.start()


def _wanted(config: Any) -> tuple[bool, bool]:
    """(the route, the jax.jit swap): the swap comes with the route unless ``--kiln-no-jit``,
    ``KILN_PYTEST_JIT=0`` or ``KILN_REPLACE_JIT=0`` (without ``--kiln-jit``) says not."""
    asked = bool(config.getoption("kiln_jit")) or bool(_env_flag("KILN_PYTEST_JIT"))
    if config.getoption("kiln_no_jit") and asked:
        raise pytest.UsageError("--kiln-jit and --kiln-no-jit (or KILN_PYTEST_JIT=1) together: "
                                "give one")
    route = bool(config.getoption("kiln")) or bool(_env_flag("KILN_PYTEST")) or asked
    off = (config.getoption("kiln_no_jit") or _env_flag("KILN_PYTEST_JIT") is False
           or (_env_flag("KILN_REPLACE_JIT") is False and not asked))
    return route, route and not off


def pytest_configure(config: Any) -> None:
    route, swap = _wanted(config)
    if not route:
        return
    import kiln_early

    kiln_early.skip()  # kiln is imported first here: no early start to remember
    import kiln
    from kiln._travel import _jax_cache

    try:
        kiln.get_config()  # a bad KILN_* setting: one clear error now, not one per compile
    except kiln.ConfigError as e:
        raise pytest.UsageError(f"kiln: {e}") from None
    on = _jax_cache.enable_jax_cache()
    if swap:
        kiln.replace_jax_jit()  # before the test modules (and what they import) are imported
    config.stash[_STATE] = (on, kiln.stats(), swap)
    if not on:
        config.issue_config_time_warning(
            kiln.KilnWarning(
                "kiln: --kiln given but JAX's cache was not routed into kiln's store "
                "(jax_compilation_cache_dir is already set, or etils is missing)"
            ),
            stacklevel=2,
        )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    got = config.stash.get(_STATE, None)
    if got is None or not (got[0] or got[2]):
        return
    import kiln

    before, after = got[1], kiln.stats()
    if got[2]:
        terminalreporter.write_line(
            f"kiln: kiln.jit hits {after.hits - before.hits}, misses "
            f"{after.misses - before.misses}, traces {after.traces - before.traces} "
            "(jax.jit as kiln.jit); eager work loaded "
            f"{after.eager_hits - before.eager_hits}, compiled "
            f"{after.eager_misses - before.eager_misses}, left to JAX "
            f"{after.eager_left - before.eager_left}"
        )
    if not got[0]:
        return
    try:
        cfg = kiln.get_config()
        where = cfg.store or str(cfg.cache_dir)
    except kiln.ConfigError as e:  # changed by a test since the session began
        where = f"unknown: {e}"
    terminalreporter.write_line(
        f"kiln: JAX cache hits {after.jax_cache_hits - before.jax_cache_hits}, "
        f"misses {after.jax_cache_misses - before.jax_cache_misses}, "
        f"written {after.jax_cache_writes - before.jax_cache_writes}; JAX lowered "
        f"{after.jax_lowerings - before.jax_lowerings} programs itself in "
        f"{after.jax_lower_seconds - before.jax_lower_seconds:.2f} s (store {where})"
    )
