"""kiln's pytest plugin: ``pytest --kiln`` runs a test suite with JAX's own persistent
compilation cache routed into kiln's store (:func:`kiln.enable_jax_cache`), so the second run
of a JAX project's tests loads the executables the first one compiled.

Registered through the ``pytest11`` entry point ``kiln`` (``-p no:kiln`` disables it). Without
``--kiln`` (or ``KILN_PYTEST=1``) it does nothing and imports nothing: this module lives outside
the ``kiln`` package so that loading the plugin does not import jax into every pytest run.

What it covers is what JAX's cache covers: every ``jax.jit`` program and eager operation the
tests compile, in the pytest process and in any worker (pytest-xdist) that loads the plugin. On
jax 0.10, programs with host callbacks (``jax.debug.print``, ``io_callback``) are compiled again;
jax 0.11 and later cache those too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_terminal_summary"]

# (whether the route is on, kiln.stats() when the session began)
_STATE = pytest.StashKey[tuple[bool, Any]]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kiln", "kiln: compile once across test runs")
    group.addoption(
        "--kiln", action="store_true", default=False,
        help="route JAX's persistent compilation cache into kiln's store (KILN_CACHE_DIR / "
        "KILN_STORE), so a second run skips the first run's compiles; also KILN_PYTEST=1",
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _wanted(config: Any) -> bool:
    raw = os.environ.get("KILN_PYTEST", "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise pytest.UsageError(
            f"KILN_PYTEST must be 1 or 0 (or true/false, yes/no, on/off), got {raw!r}")
    return bool(config.getoption("kiln")) or raw in _TRUE


def pytest_configure(config: Any) -> None:
    if not _wanted(config):
        return
    import kiln
    from kiln._travel import _jax_cache

    try:
        kiln.get_config()  # a bad KILN_* setting: one clear error now, not one per compile
    except kiln.ConfigError as e:
        raise pytest.UsageError(f"kiln: {e}") from None
    on = _jax_cache.enable_jax_cache()
    config.stash[_STATE] = (on, kiln.stats())
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
    if got is None or not got[0]:
        return
    import kiln

    before, after = got[1], kiln.stats()
    try:
        cfg = kiln.get_config()
        where = cfg.store or str(cfg.cache_dir)
    except kiln.ConfigError as e:  # changed by a test since the session began
        where = f"unknown: {e}"
    terminalreporter.write_line(
        f"kiln: JAX cache hits {after.jax_cache_hits - before.jax_cache_hits}, "
        f"misses {after.jax_cache_misses - before.jax_cache_misses}, "
        f"written {after.jax_cache_writes - before.jax_cache_writes} (store {where})"
    )
