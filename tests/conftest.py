"""Shared fixtures: every test gets its own store directory and zeroed counters."""

from __future__ import annotations

import os

import pytest

import kiln

# Audit share of the suite: KILN_TEST_VERIFY=1 (set by .ci/run for one pass over tests/test_jit.py)
# runs every warm hit in KILN_VERIFY mode.
_VERIFY = os.environ.get("KILN_TEST_VERIFY") == "1"


@pytest.fixture(autouse=True)
def kiln_store(tmp_path, monkeypatch):
    """A private local store under tmp_path; process-wide settings restored afterwards."""
    for var in [v for v in os.environ if v.startswith("KILN_")]:
        monkeypatch.delenv(var)
    cache = tmp_path / "kiln-cache"
    kiln.configure(cache_dir=cache, store=None, verify=_VERIFY)
    kiln.reset_stats()
    yield cache
    kiln.configure(cache_dir=None, store=None, verify=None, explain=None, strict=None,
                   signing_key=None, max_size=None, progress=None)
