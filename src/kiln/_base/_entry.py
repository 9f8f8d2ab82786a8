"""The on-disk (and in-store) format of one entry, and what its key looks like (:func:`is_key`).

An entry is one blob, little-endian::

    offset  size  field
    0       8     magic b"KILNENT\\x00"
    8       4     format version (u32)            -- FORMAT_VERSION
    12      4     header length H (u32)
    16      8     payload length P (u64)
    24      1     digest kind: 0 = SHA-256, 1 = HMAC-SHA256 under the configured signing key
    25      7     zero padding
    32      H     header: UTF-8 JSON object (plain data: key parts, versions, platform, compile
                  seconds, sizes, manifest, payload section table)
                  and the entry's own key (an entry found under another key is refused)
    32+H    P     payload: the sections named in header["sections"] as [offset, length] pairs
                  relative to the payload start (executable bytes, pickled call metadata,
                  pickled host callbacks)
    32+H+P  32    digest over bytes [0, 32+H+P)

:func:`decode` checks the magic, version, lengths and the digest **before** any byte of the
header or payload is parsed. What is trusted: an entry whose digest verifies is taken to have
been written by kiln; its payload contains native code (the XLA executable) and pickles
(decoded only after the digest verifies). Whoever can write to a store can therefore run code
in its readers: the local store is private to its user (0700); configure ``signing_key`` for
any store that others can write to.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

from ._errors import EntryError, UnverifiableEntry

__all__ = ["FORMAT_VERSION", "KEY_LENGTH", "MAGIC", "Entry", "encode", "decode", "digest",
           "is_key", "peek_header", "read_header", "recorded_parts", "short_key"]

MAGIC = b"KILNENT\x00"
#: Bump on any change of the byte layout, the header schema, key derivation or static hashing.
# 2: an inlined (tier-up) entry's "lowered" is its inlined module's; 3: static mappings are
# hashed in iteration order, devices / meshes / shardings by value (kiln._keys._hashing); 4: entries
# of format 3 may hold an executable JAX's cache loaded, which XLA serialized without its
# kernels (kiln._base._jax_compat.compile_to_store): never loaded again
FORMAT_VERSION = 4
_PREFIX = struct.Struct("<8sIIQB7x")
_DIGEST_SIZE = 32
#: Characters in a key: the hex digest of a sha256 (kiln._keys.make_key).
KEY_LENGTH = 64
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Entry:
    """A decoded entry: the JSON header and the named payload sections (bytes)."""

    header: dict[str, Any]
    sections: dict[str, bytes]


def digest(data: bytes | memoryview, signing_key: str | None) -> bytes:
    """SHA-256 of ``data``, or HMAC-SHA256 under ``signing_key`` when one is set (32 bytes);
    entries and bundles (:mod:`kiln._travel._bundle`) end with it."""
    if signing_key:
        return hmac.new(signing_key.encode(), data, hashlib.sha256).digest()
    return hashlib.sha256(data).digest()


def is_key(text: object, *, digest: bool = False) -> bool:
    """Whether ``text`` is a kiln key: a ``str`` of :data:`KEY_LENGTH` (64) lowercase hex
    characters, the sha256 hex digest :func:`kiln._keys.make_key` returns. Stores name entries
    by it (a store refuses any other key, and lists a file or object named otherwise as a
    stray, never as an entry); a bundle's manifest must name each entry by one.

    ``digest``: any lowercase hex digest of 32 characters or more instead (a fingerprint or a
    static digest, 32 characters; a key): the values messages shorten with :func:`short_key`.

    Example:
        >>> is_key("ab" * 32), is_key("AB" * 32), is_key("ab" * 16), is_key("ab" * 16, digest=True)
        (True, False, False, True)
    """
    if not isinstance(text, str):
        return False
    if len(text) < 32 if digest else len(text) != KEY_LENGTH:
        return False
    return _HEX.issuperset(text)


def short_key(key: object) -> str:
    """The first 12 characters of a key or digest (64 hex characters): how kiln names an entry
    in messages, ``kiln ls`` and ``kiln verify`` (unique in practice; ``kiln ls --json`` and
    ``kiln ls -v`` give the whole key)."""
    return str(key)[:12]


def encode(header: dict[str, Any], sections: dict[str, bytes], *, signing_key: str | None) -> bytes:
    """Serialize an entry. ``header`` must be JSON-serializable plain data."""
    table = {}
    offset = 0
    for name, data in sections.items():
        table[name] = [offset, len(data)]
        offset += len(data)
    header_bytes = json.dumps({**header, "sections": table}, sort_keys=True).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes), offset, 1 if signing_key else 0)
    body = b"".join([prefix, header_bytes, *sections.values()])
    return body + digest(body, signing_key)


def _check_prefix(blob: bytes | memoryview) -> tuple[int, int, int]:
    if len(blob) < _PREFIX.size:
        raise EntryError(f"entry is truncated ({len(blob)} bytes, shorter than its prefix)")
    magic, version, hlen, plen, kind = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise EntryError("entry has a foreign format (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise EntryError(f"entry has format version {version}; this kiln reads {FORMAT_VERSION}")
    return hlen, plen, kind


def decode(blob: bytes, *, signing_key: str | None, old_keys: tuple[str, ...] = (),
           key: str | None = None) -> Entry:
    """Verify and decode an entry.

    ``old_keys``: earlier signing keys also accepted for a signed entry (a key rotation:
    ``KILN_SIGNING_KEYS_OLD``); none of them is tried when ``signing_key`` is unset. ``key``:
    the store key the blob was found under; the entry must have been written for it (a valid
    entry under another key is a swapped or copied file, never loaded).

    Raises:
        EntryError: truncated, foreign, other format version, unsigned when a key is configured,
            a digest mismatch (corrupt or tampered), or written for another key than ``key``.
        UnverifiableEntry: signed, and no key is configured.
    """
    view = memoryview(blob)
    hlen, plen, kind = _check_prefix(view)
    end = _PREFIX.size + hlen + plen
    if len(view) != end + _DIGEST_SIZE:
        raise EntryError(f"entry is truncated or padded ({len(view)} bytes, expected {end + 32})")
    if kind and not signing_key:
        raise UnverifiableEntry("entry is signed but no signing_key is configured "
                                "(set KILN_SIGNING_KEY to the key it was signed with)")
    if not kind and signing_key:
        raise EntryError("entry is not signed but a signing_key is configured")
    body, want = view[:end], bytes(view[end:])
    keys = (signing_key, *old_keys) if signing_key else (None,)
    if not any(hmac.compare_digest(digest(body, k), want) for k in keys):
        raise EntryError(
            "entry digest mismatch (corrupt or tampered"
            + (", or signed with another key)" if signing_key else ")")
        )
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]))
        payload = view[_PREFIX.size + hlen : end]
        sections = {n: bytes(payload[o : o + n_]) for n, (o, n_) in header["sections"].items()}
    except (ValueError, KeyError, TypeError) as e:  # pragma: no cover - digest verified
        raise EntryError(f"entry header is malformed: {e}") from None
    if key is not None and header.get("key") != key:
        if "key" not in header:
            raise EntryError("entry header names no key")
        raise EntryError(f"entry was written for key {short_key(header['key'])}")
    return Entry(header, sections)


def peek_header(blob: bytes) -> dict[str, Any]:
    """Read only the JSON header (no digest check): for listing, never for loading."""
    hlen, _, _ = _check_prefix(blob)
    try:
        header = json.loads(bytes(blob[_PREFIX.size : _PREFIX.size + hlen]))
    except ValueError as e:
        raise EntryError(f"entry header is malformed: {e}") from None
    if not isinstance(header, dict):
        raise EntryError("entry header is not a JSON object")
    return header


def read_header(blob: bytes | None) -> dict[str, Any] | None:
    """Header of a blob, or ``None`` when the blob is missing or unreadable."""
    if blob is None:
        return None
    try:
        return peek_header(blob)
    except EntryError:
        return None


def recorded_parts(header: dict[str, Any]) -> dict[str, Any]:
    """The key parts an entry was built under, by name: its ``key_parts`` (a kiln executable),
    and the ``kiln``, ``jax``, ``jaxlib`` and ``machine`` its header records itself where the
    key parts do not name them (a JAX-cache value). An entry written before machine kinds were
    keyed names no ``machine``."""
    recorded: dict[str, Any] = {
        p[0]: p[1] for p in header.get("key_parts") or []
        if isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str)
    }
    for name in ("kiln", "jax", "jaxlib", "machine"):
        if name not in recorded and isinstance(header.get(name), str):
            recorded[name] = header[name]
    return recorded
