"""Small helpers shared by test modules, loaded by ``tests/conftest.py`` as the module
``kiln_test_helpers`` (test modules cannot import each other under ``--import-mode=importlib``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def error_of(call: Callable[[], Any]) -> Exception:
    """The exception ``call()`` raises (fails the test when it raises none)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the error under test
        return e
    raise AssertionError("no error")
