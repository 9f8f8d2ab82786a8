"""kiln's early start: the kiln:// route on before a program's own imports compile anything.

A program that imports kiln after a library that compiles while it is imported (``import
jax_md`` runs 131 eager compiles; most programs import their own tools last) would compile
those again in every warm run: JAX's cache was not routed into kiln's store yet. JAX calls
``initialize()`` of every module a ``jax_plugins`` entry point names when its first backend
starts, before its first compile (``jax._src.xla_bridge.discover_pjrt_plugins``, the
mechanism of PJRT plugins). kiln names ``kiln_jax_plugin`` there. For a program that created a
:func:`kiln.jit` function in its previous run (:func:`claim` says so), its ``initialize``
imports kiln at that moment, so its route is on for every compile, as if the program imported
kiln first. Any other process pays one ``os.stat`` (this module imports only the standard
library, and never kiln: kiln imports it to :func:`remember`, so it stands below kiln).

The program is told apart by a marker file (an empty file named by a digest of the script's
path, ``sys.argv[0]``, and the working directory) under ``<KILN_CACHE_DIR>/early/``:

- written by a process in which kiln is imported without this module's help and makes a kiln
  function (:func:`remember`); not by ``kiln run`` or ``pytest --kiln``, which import kiln
  first anyway;
- removed at the exit of a process this module imported kiln into that made no kiln function
  (the program no longer uses kiln), so the next run leaves JAX alone again;
- ``KILN_EARLY=0`` turns the early start off; ``KILN_JAX_CACHE=0`` or a
  ``JAX_COMPILATION_CACHE_DIR`` of the user's own leave JAX alone as ``import kiln`` does.

Never raises, never warns: JAX logs an exception from a plugin's ``initialize`` and goes on,
and a cache must not stop a program. Importing kiln starts no backend (a test checks it), so
importing it here, inside JAX's plugin discovery, cannot wait on JAX's plugin lock.
"""

from __future__ import annotations

import hashlib
import os
import sys

__all__ = ["claim", "marker", "remember", "skip"]

_state = {"imported": False, "remembered": False, "skip": False}


def _cache_dir() -> str:
    where = os.environ.get("KILN_CACHE_DIR", "")
    if where:
        return os.path.expanduser(where)
    import platformdirs  # (kiln's own dependency; ~1 ms, only where no KILN_CACHE_DIR is set)

    return platformdirs.user_cache_dir("kiln", appauthor=False)


def marker() -> str | None:
    """The marker file of this process's program, or None for one without a script
    (``python -c``, an interactive interpreter)."""
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or script.startswith("-"):
        return None
    try:
        ident = f"{os.path.realpath(script)}\0{os.getcwd()}"
    except OSError:
        return None
    digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(_cache_dir(), "early", digest)


def _off() -> bool:
    return (os.environ.get("KILN_EARLY", "1").strip().lower() in ("0", "false", "no", "off")
            or os.environ.get("KILN_JAX_CACHE", "1").strip().lower() in ("0", "false", "no",
                                                                          "off"))


def claim() -> bool:
    """Whether JAX's backend start should import kiln now: kiln is not imported yet and this
    program made a kiln function last time (its marker exists; see the module docstring).
    True marks kiln as imported early, and removes the marker at exit if this run makes no
    kiln function. Never raises."""
    try:
        if "kiln" in sys.modules or _off():
            return False
        path = marker()
        if path is None or not os.path.exists(path):
            return False
        _state["imported"] = True
        import atexit

        atexit.register(_forget_if_unused, path)
        return True
    except Exception:  # noqa: BLE001 - never stop JAX's backend start over a cache
        return False


def skip() -> None:
    """This process imports kiln first itself (``kiln run``, ``pytest --kiln``): it leaves
    no marker."""
    _state["skip"] = True


def remember() -> None:
    """A kiln function was made in this process: its program imports kiln early from its next
    run on. Once per process; never raises."""
    if _state["remembered"]:
        return
    _state["remembered"] = True
    if _state["skip"] or _state["imported"] or _off():
        return
    try:
        path = marker()
        if path is None or os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError:
        pass


def _forget_if_unused(path: str) -> None:
    if not _state["remembered"]:
        try:
            os.unlink(path)
        except OSError:
            pass
