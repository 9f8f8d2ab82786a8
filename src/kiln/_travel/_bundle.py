"""Bundles: selected entries of a store in one file, to load into a store on another machine.

A bundle is one file, little-endian::

    offset   size  field
    0        8     magic b"KILNBDL\\x00"
    8        4     bundle format version (u32)     -- FORMAT_VERSION
    12       4     manifest length M (u32)
    16       8     entries length E (u64)
    24       1     digest kind: 0 = SHA-256, 1 = HMAC-SHA256 under the configured signing key
    25       7     zero padding
    32       M     manifest: UTF-8 JSON object: the exporting process's "kiln", "jax",
                   "jaxlib", "platform", "device_kind" and "machine" (its machine kind, see
                   kiln._keys._machine), "created" (POSIX seconds), and
                   "entries": per entry, in file order, its "key", "kind", "function",
                   "signature", "size" (bytes) and "sha256" (hex digest of its bytes)
    32+M     E     the entries, each a whole kiln entry (see kiln._base._entry), back to back
    32+M+E   32    digest over bytes [0, 32+M+E)

:func:`import_entries` checks the magic, version, lengths and the digest **before** any byte of
the manifest is parsed, and refuses the whole bundle when one of them does not hold. Each entry
inside is then decoded like any entry read from a store (its own digest or signature under the
importing process's ``signing_key``, and the key it was written for) and compared with this
process's kiln, jax and jaxlib versions, platform, devices and machine kind (its key parts,
which are part of its key: an entry built for another environment could never be used here);
one that does not verify or does not fit is reported and not loaded.

What is trusted: importing a bundle is copying entries into the store, and an entry holds native
code and pickles. Without ``KILN_SIGNING_KEY`` the digests only detect damage, not tampering:
import only bundles you made or got from someone you trust, or set the same
``KILN_SIGNING_KEY`` where the bundle is exported and where it is imported.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import stat
import struct
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .._base import (
    BundleError,
    EntryError,
    StoreWarning,
    decode,
    digest,
    get_config,
    is_key,
    read_header,
    recorded_parts,
    short_key,
)
from .._keys import environment_parts
from ..stores import Store, open_store, write_atomic
from ..stores import _inventory as inventory

__all__ = [
    "FORMAT_VERSION", "MAGIC", "Exported", "ImportReport", "ImportedEntry", "decode_bundle",
    "encode_bundle", "export_entries", "import_entries", "write_bundle",
]

logger = logging.getLogger("kiln")

MAGIC = b"KILNBDL\x00"
#: Bump on any change of the byte layout or the manifest schema.
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQB7x")
_DIGEST_SIZE = 32
# The key parts an entry must share with this process to be loaded, with their names in reports.
_CHECKED = {"format": "entry format", "kiln": "kiln", "jax": "jax", "jaxlib": "jaxlib",
            "backend": "platform", "device": "devices", "processes": "job topology",
            "machine": "machine kind"}


# -- the file format -----------------------------------------------------------------------------
def encode_bundle(
    manifest: dict[str, Any], blobs: list[bytes], *, signing_key: str | None
) -> bytes:
    """Serialize a bundle: ``manifest`` (plain JSON data whose "entries" describe ``blobs``, in
    order) and the entry blobs."""
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(manifest_bytes), sum(map(len, blobs)),
                          1 if signing_key else 0)
    body = b"".join([prefix, manifest_bytes, *blobs])
    return body + digest(body, signing_key)


def decode_bundle(
    data: bytes, *, signing_key: str | None
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], bytes]]]:
    """Verify and decode a bundle for import: its manifest and ``(manifest row, entry blob)``
    per entry. The entries themselves are not decoded.

    Raises:
        BundleError: truncated, foreign, other format version, unsigned when a key is
            configured (or signed when none is), a digest mismatch, or a malformed manifest.
    """
    view = memoryview(data)
    if len(view) < _PREFIX.size + _DIGEST_SIZE:
        raise _refused(f"the file is truncated ({len(view)} bytes) or not a kiln bundle",
                       "give a file written by 'kiln export'")
    magic, version, mlen, elen, kind = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise _refused("the file is not a kiln bundle (bad magic bytes)",
                       "give a file written by 'kiln export'")
    if version != FORMAT_VERSION:
        raise _refused(f"the bundle has format version {version}, this kiln reads "
                       f"{FORMAT_VERSION}", "export it again with this kiln version")
    end = _PREFIX.size + mlen + elen
    if len(view) != end + _DIGEST_SIZE:
        raise _refused(f"the bundle is truncated or padded ({len(view)} bytes, expected "
                       f"{end + _DIGEST_SIZE})", "copy it again")
    if kind and not signing_key:
        raise _refused("the bundle is signed but KILN_SIGNING_KEY is not set",
                       "set it to the key the bundle was exported with")
    if signing_key and not kind:
        raise _refused("the bundle is not signed but KILN_SIGNING_KEY is set",
                       "export it again with the same KILN_SIGNING_KEY set")
    if not hmac.compare_digest(digest(view[:end], signing_key), bytes(view[end:])):
        if signing_key:
            raise _refused("bundle digest does not match (changed or signed with another "
                           "KILN_SIGNING_KEY)", "import it with the KILN_SIGNING_KEY it was "
                           "exported with, or copy or export it again")
        raise _refused("bundle digest does not match (changed or damaged)",
                       "copy or export it again")
    try:
        manifest = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + mlen]))
        rows = manifest["entries"]
        if not isinstance(rows, list):
            raise TypeError("'entries' is not a list")
        items = []
        offset = _PREFIX.size + mlen
        for row in rows:
            key, size, sha = row["key"], row["size"], row["sha256"]
            if not is_key(key):
                raise ValueError(f"entry key {str(key)[:70]!r} is not 64 hex characters")
            if not (isinstance(size, int) and 0 <= size <= end - offset):
                raise ValueError(f"entry {short_key(key)} has size {size!r}, past the entries")
            blob = bytes(view[offset : offset + size])
            if hashlib.sha256(blob).hexdigest() != sha:
                raise ValueError(f"entry {short_key(key)} does not match its sha256")
            items.append((row, blob))
            offset += size
        if offset != end:
            raise ValueError(f"{end - offset} bytes after the last entry")
    # (digest verified: a writer's bug, or a crafted manifest nested past Python's recursion)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise _refused(f"the bundle manifest is malformed ({e})", "export it again") from None
    return manifest, items


def _refused(what: str, todo: str) -> BundleError:
    return BundleError(f"{what}; nothing was imported; {todo}")


# -- export --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exported:
    """What :func:`write_bundle` wrote: the manifest rows, the file's size in bytes, and
    ``(key, why)`` of each matching entry left out because it does not verify."""

    path: str
    store: str
    entries: list[dict[str, Any]]
    size: int
    signed: bool
    skipped: list[tuple[str, str]]


def _names(functions: Iterable[str] | str | None) -> list[str] | None:
    if functions is None:
        return None
    return [functions] if isinstance(functions, str) else list(functions)


def _matches(function: Any, names: list[str]) -> bool:
    """``function`` (module.qualname) is one of ``names``, whole or by its last component."""
    if not isinstance(function, str):
        return False
    head, bracket, rest = function.partition("[")  # "m.vf[noinline jvp]": last is "vf[...]"
    return function in names or head.rpartition(".")[2] + bracket + rest in names


def _environment() -> dict[str, str]:
    """This process's key parts in :data:`_CHECKED` (versions, backend, devices)."""
    parts = dict(environment_parts())
    return {name: parts[name] for name in _CHECKED}


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same folder (0600: a bundle holds native code), then ``os.replace``.
    An existing path that is not a regular file (a link, a device such as /dev/null, a folder)
    is refused, never replaced."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EEXIST, "it exists and is not a regular file (a link, a device "
                          "or a folder); give the path of a new or regular file")
    write_atomic(path, data, prefix=f".{path.name}.", entry=False)


def write_bundle(
    path: str | os.PathLike[str], functions: Iterable[str] | str | None = None
) -> Exported:
    """:func:`export_entries`, returning the details (for the CLI)."""
    cfg = get_config()
    store = open_store(cfg)
    names = _names(functions)
    rows: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    skipped: list[tuple[str, str]] = []
    for key in sorted(store.iter()):
        try:
            blob = inventory.peek(store, key)
        except ValueError:  # a file in the store that is not named like a key
            continue
        except OSError as e:
            skipped.append((key, f"cannot be read: {e}"))
            continue
        if blob is None:
            continue  # removed since iter()
        if names is not None and not _matches((read_header(blob) or {}).get("function"), names):
            continue
        try:
            header = decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old,
                            key=key).header
        except EntryError as e:
            skipped.append((key, str(e)))
            continue
        rows.append({
            "key": key,
            "kind": str(header.get("kind", "executable")),
            "function": str(header.get("function", "?")),
            "signature": str(header.get("signature", "-")),
            "size": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        })
        blobs.append(blob)
    if not rows:
        which = "" if names is None else " of function " + ", ".join(map(repr, names))
        if skipped:
            first_key, why = skipped[0]
            raise BundleError(
                f"none of the {len(skipped)} entries{which} in {store.url} can be exported "
                f"(entry {short_key(first_key)}: {why}); nothing was written; 'kiln verify' lists "
                "the bad entries"
            )
        raise BundleError(
            f"no entries{which} in {store.url}; nothing was written "
            + ("('kiln ls' lists the functions in the store)" if names is not None else
               "(run the program with kiln first, or name the store with --store / "
               "KILN_STORE)")
        )
    env = _environment()
    manifest = {
        "kiln": env["kiln"],
        "jax": env["jax"],
        "jaxlib": env["jaxlib"],
        "platform": env["backend"].partition(" ")[0],
        "device_kind": env["device"].rpartition(" x")[0] or env["device"],
        "machine": env["machine"],
        "created": time.time(),
        "entries": rows,
    }
    data = encode_bundle(manifest, blobs, signing_key=cfg.signing_key)
    try:
        _write_atomic(Path(path), data)
    except OSError as e:
        raise OSError(e.errno, f"cannot write bundle {os.fspath(path)}: {e.strerror}") from None
    logger.debug("kiln: exported %d entries (%d bytes) to %s", len(rows), len(data), path)
    return Exported(os.fspath(path), store.url, rows, len(data), bool(cfg.signing_key), skipped)


def export_entries(
    path: str | os.PathLike[str], functions: Iterable[str] | str | None = None
) -> int:
    """Write entries of the configured store into one bundle file, to load elsewhere with
    :func:`import_entries` (``kiln export`` on the command line).

    Every entry is verified first (digest or ``KILN_SIGNING_KEY`` signature, and its key); one
    that does not verify is left out with a :class:`kiln.StoreWarning`. The bundle records the
    kiln, jax and jaxlib versions, platform, device kind and machine kind (on CPU the
    architecture and instruction-set features, :mod:`kiln._keys._machine`) of this process, and per
    entry its
    key, function, size (bytes) and SHA-256; the whole file carries a SHA-256 digest, or an
    HMAC-SHA256 under ``KILN_SIGNING_KEY`` when that is set. The file is written atomically,
    readable by its owner only (it holds native code).

    Args:
        path: the bundle file to write (replaced if it exists).
        functions: only entries of these functions: each name matches an entry's function
            (``module.qualname``, as ``kiln ls`` shows it) whole or by its last component
            (``"fit"`` matches ``"mypkg.train.fit"``). ``None``: every entry that has a key
            (also JAX-cache entries and verify-only markers).

    Returns:
        The number of entries written.

    Raises:
        BundleError: no entry matches (or none of those that match verifies); nothing is
            written.
        OSError: the store cannot be listed, or the file cannot be written.

    Example:
        >>> import kiln
        >>> n = kiln.export_entries("fit.kilnbundle", functions=["fit"])  # doctest: +SKIP
    """
    exported = write_bundle(path, functions)
    for key, why in exported.skipped:
        warnings.warn(f"kiln: entry {short_key(key)} in {exported.store!r} not exported ({why})",
                      StoreWarning, stacklevel=2)
    return len(exported.entries)


# -- import --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImportedEntry:
    """What :func:`import_entries` did with one entry of a bundle.

    Attributes:
        key: the entry's key (64 hex characters).
        function: the function it belongs to (``module.qualname``, as ``kiln ls`` shows it).
        status: ``"loaded"`` (written into the store), ``"present"`` (the store already had a
            valid entry under this key; left as it was) or ``"skipped"`` (not loaded).
        reason: why it was skipped (it does not verify here, or was built for another kiln,
            jax or jaxlib version, platform, devices or machine kind); ``None`` otherwise.
    """

    key: str
    function: str
    status: Literal["loaded", "present", "skipped"]
    reason: str | None = None


@dataclass(frozen=True)
class ImportReport:
    """The outcome of :func:`import_entries`, one :class:`ImportedEntry` per entry of the
    bundle, in bundle order.

    Attributes:
        bundle: the bundle file.
        store: the URL of the store written to.
        entries: per entry, what was done with it.
    """

    bundle: str
    store: str
    entries: tuple[ImportedEntry, ...]

    @property
    def loaded(self) -> tuple[ImportedEntry, ...]:
        """Entries written into the store."""
        return tuple(e for e in self.entries if e.status == "loaded")

    @property
    def present(self) -> tuple[ImportedEntry, ...]:
        """Entries the store already held."""
        return tuple(e for e in self.entries if e.status == "present")

    @property
    def skipped(self) -> tuple[ImportedEntry, ...]:
        """Entries not loaded, each with its reason."""
        return tuple(e for e in self.entries if e.status == "skipped")


def _unfit(header: dict[str, Any], here: dict[str, str]) -> str | None:
    """Why an entry's environment is not this process's, or ``None``: its
    :func:`recorded_parts` that differ from ``here``."""
    recorded = recorded_parts(header)
    differ = [f"{label} {recorded[name]} (here {here[name]})" for name, label in _CHECKED.items()
              if name in recorded and recorded[name] != here[name]]
    return "built for " + ", ".join(differ) if differ else None


def import_entries(path: str | os.PathLike[str]) -> ImportReport:
    """Load the entries of a bundle written by :func:`export_entries` (``kiln export``) into
    the configured store (``kiln import`` on the command line).

    The whole file's digest (its HMAC-SHA256 signature under ``KILN_SIGNING_KEY``, when set)
    is checked before anything in it is parsed: a bundle with a changed byte, or signed with
    another key (or unsigned where a key is set), is refused as a whole and nothing is
    imported. Each entry is then decoded like an entry read from a store (its own digest or
    signature under this process's ``KILN_SIGNING_KEY``, and its key) and compared with this
    process: the kiln, jax and jaxlib versions, platform (and its version), device kind and
    count and machine kind (a CPU executable is only loaded on the architecture and
    instruction-set features it was compiled for) it was built for must be this process's, or
    it is reported and not loaded, with the difference as its reason (its key
    would never be looked up here). Entries built under other jax settings or ``XLA_FLAGS``
    load, and are used by processes with those settings. An entry the store already holds
    (valid, under the same key) is left as it is. Trust: see :mod:`kiln._travel._bundle`;
    importing is copying native code into the store.

    Args:
        path: the bundle file.

    Returns:
        An :class:`ImportReport`: per entry, loaded, already present, or skipped and why.

    Raises:
        BundleError: the bundle is refused (truncated, foreign, other format version, digest
            or signature mismatch); the message says why. Nothing was imported.
        OSError: the file cannot be read, or the store cannot be written (entries loaded
            before the failure stay).

    Example:
        >>> import kiln
        >>> report = kiln.import_entries("fit.kilnbundle")  # doctest: +SKIP
        >>> len(report.loaded), [(e.key[:12], e.reason) for e in report.skipped]  # doctest: +SKIP
    """
    cfg = get_config()
    data = Path(path).read_bytes()
    try:
        _, items = decode_bundle(data, signing_key=cfg.signing_key)
    except BundleError as e:
        raise BundleError(f"{os.fspath(path)}: {e}") from None
    store = open_store(cfg)
    if store.url == "null":
        raise BundleError("the configured store is 'null' (persistence off); nothing was "
                          "imported; name a store with --store / KILN_STORE")
    here = _environment()
    done: list[ImportedEntry] = []
    for row, blob in items:
        key, function = row["key"], str(row.get("function", "?"))
        try:
            header = decode(blob, signing_key=cfg.signing_key, old_keys=cfg.signing_keys_old,
                            key=key).header
        except EntryError as e:
            done.append(ImportedEntry(key, function, "skipped", f"does not verify here: {e}"))
            logger.debug("kiln: bundle entry %s skipped: %s", short_key(key), e)
            continue
        function = str(header.get("function", function))
        unfit = _unfit(header, here)
        if unfit is not None:
            done.append(ImportedEntry(key, function, "skipped", unfit))
            logger.debug("kiln: bundle entry %s skipped: %s", short_key(key), unfit)
            continue
        if _holds(store, key, blob, cfg.signing_key):
            done.append(ImportedEntry(key, function, "present"))
            continue
        store.put(key, blob)
        done.append(ImportedEntry(key, function, "loaded"))
        logger.debug("kiln: bundle entry %s loaded into %s", short_key(key), store.url)
    return ImportReport(os.fspath(path), store.url, tuple(done))


def _holds(store: Store, key: str, blob: bytes, signing_key: str | None) -> bool:
    """Whether the store already has a valid entry under ``key`` (a bad one is replaced)."""
    try:
        existing = inventory.peek(store, key)
        if existing is not None and existing != blob:
            decode(existing, signing_key=signing_key, key=key)
    except (OSError, EntryError):
        return False
    return existing is not None
