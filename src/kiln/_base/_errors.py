"""Errors and warnings raised by kiln.

Hierarchy::

    KilnError                      root of every kiln exception
    ├── StaticArgumentError        (also TypeError) a static argument cannot be hashed by value
    ├── ConfigError                (also ValueError) a bad setting or environment variable
    ├── StoreError                 a store failed and ``KILN_STRICT=1`` made it an error
    │   └── EntryError             an entry is corrupt, truncated, foreign or tampered
    ├── BundleError                a bundle file is refused (corrupt, foreign, signed with
    │                              another key), or an export found no entry to write
    └── VerifyError                ``KILN_VERIFY=1``: a stored entry does not match a fresh lowering

    KilnWarning                    root of every kiln warning (a subclass of UserWarning)
    └── StoreWarning               a store entry was corrupt, foreign or unreadable; kiln recompiled
"""

from __future__ import annotations


class KilnError(Exception):
    """Root of every exception kiln raises."""


class StaticArgumentError(KilnError, TypeError):
    """A static argument cannot be hashed by value (for example an object array)."""


class ConfigError(KilnError, ValueError):
    """A configuration value (argument or ``KILN_*`` environment variable) is invalid."""


class StoreError(KilnError):
    """A store read or write failed while ``KILN_STRICT=1`` is set."""


class EntryError(StoreError):
    """An entry failed to decode: bad magic, other format version, truncated, or bad digest."""


class UnverifiableEntry(EntryError):
    """An entry is signed but this process has no signing key (``KILN_SIGNING_KEY``) to check
    it with: never decoded, and never replaced or deleted by this process (it is most likely
    good; this process is the one misconfigured)."""


class BundleError(KilnError):
    """A bundle (:func:`kiln.export_entries`, :func:`kiln.import_entries`) is refused as a whole
    (truncated, foreign, other format version, digest or signature mismatch, malformed), or an
    export found no entry to write."""


class VerifyError(KilnError):
    """``KILN_VERIFY=1`` found that a stored executable does not match a fresh lowering."""


class KilnWarning(UserWarning):
    """Root of every warning kiln emits."""


class StoreWarning(KilnWarning):
    """A store entry was corrupt, foreign or unreadable; kiln recompiled and replaced it."""
