"""Which distribution a library module counts by (``kiln._keys._libraries``).

The distribution of a top-level package whose name differs from its distribution's (``haiku``
of ``dm-haiku``, ``sklearn`` of ``scikit-learn``) is found from the ``.dist-info`` folders
beside it, not by ``importlib.metadata.packages_distributions()``, which parses every
installed distribution's ``RECORD`` on a process's first call (0.2-0.65 s measured).
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from kiln._keys import _libraries


def test_providers_agree_with_packages_distributions_for_every_installed_top() -> None:
    expected = importlib.metadata.packages_distributions()
    tops = sorted(t for t in expected if t.isidentifier() and t not in sys.modules)
    assert len(tops) > 20  # the test environment installs jax, flax, equinox, moto, ...
    wrong = {t: (_libraries._providers(t), sorted(expected[t])) for t in tops
             if sorted(_libraries._providers(t)) != sorted(set(expected[t]))}
    assert wrong == {}


@pytest.mark.parametrize("top", ["sklearn", "absl", "yaml"])
def test_imported_package_counts_by_its_distribution_without_a_full_scan(
        top: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(top)
    expected = sorted(importlib.metadata.packages_distributions()[top])[0]

    def scan() -> None:
        raise AssertionError("packages_distributions() scanned every distribution")

    monkeypatch.setattr(importlib.metadata, "packages_distributions", scan)
    _libraries._top_level_version.cache_clear()
    try:
        version = _libraries.library_version(f"{top}.sub")
    finally:
        _libraries._top_level_version.cache_clear()
    name, _, rest = version.partition("==")
    assert name == expected
    assert rest.startswith(importlib.metadata.version(expected) + " record:")
