"""Doctests in src/kiln run against a private store, never the user's cache directory."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _doctest_store(request, tmp_path):
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    import kiln

    kiln.configure(cache_dir=tmp_path / "kiln-cache", store=None)
    yield
    kiln.configure(cache_dir=None, max_size=None)
