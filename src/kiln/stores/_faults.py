"""A failing store: counted, warned about once per store per process, then quiet."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable

from .._base import StoreError, StoreWarning, _stats, set_in_thread
from ._base import Store

__all__ = ["reporting", "store_fault", "user_stacklevel"]

logger = logging.getLogger("kiln")

# Stores (by URL) that already gave this process its one warning (see store_fault).
_faulted_stores: set[str] = set()
_faulted_lock = threading.Lock()
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_reporter = threading.local()


def reporting(report: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
    """Inside the block (this thread), store problems are handed to ``report`` instead of
    warned (code that runs inside JAX's cache, where a warning turned into an error by the
    user's filters would fail the call)."""
    return set_in_thread(_reporter, "report", report)


def reporter() -> Callable[[str], None] | None:
    """The ``report`` of the innermost :func:`reporting` block of this thread, if any."""
    return getattr(_reporter, "report", None)


def store_fault(
    store: Store, doing: str, e: BaseException, *, strict: bool,
    report: Callable[[str], None] | None = None,
    then: str = "compiling in memory",
) -> None:
    """The store itself failed (I/O, its index, a refused directory, a remote store down or
    slow): counted in ``kiln.stats().store_errors``; one :class:`kiln.StoreWarning` per store
    per process saying what kiln does next (``then``), or one call of ``report`` with that
    message where a warning could stop the program (inside JAX's cache, under
    ``filterwarnings = error``); then quiet (the program goes on compiling in memory).

    Raises:
        StoreError: ``strict`` (``KILN_STRICT=1``).
    """
    _stats.bump(store_errors=1)
    report = report or reporter()
    message = f"kiln: cannot {doing} store {store.url!r} ({e})"
    if strict:
        raise StoreError(f"{message} (KILN_STRICT=1 makes this an error; unset it to warn "
                         "once and go on without the store)") from None
    with _faulted_lock:
        if store.url in _faulted_stores:
            logger.debug("%s", message)
            return
        _faulted_stores.add(store.url)
    text = (f"{message}; {then} (further problems with this store are counted "
            "in kiln.stats().store_errors, not repeated)")
    if report is not None:
        report(text)
        return
    warnings.warn(text, StoreWarning, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """stacklevel for warnings.warn that points at the first frame outside kiln and jax."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        f = frame.f_code.co_filename
        if not (f.startswith(_KILN_DIR) or f"{os.sep}jax{os.sep}" in f or f"{os.sep}jaxlib" in f):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1
