"""Why kiln missed, and a summary of hits and misses.

Every miss gets a one-line reason, logged on the ``kiln`` logger at DEBUG, or at WARNING when
``KILN_EXPLAIN=1`` (``kiln.configure(explain=True)``). Reasons name:

- a function never seen before, with a hint when ``kiln.jit`` keeps being applied to fresh
  function objects with the same code (re-created on every call);
- which argument changed and how: its pytree path, old and new shape / dtype / weak type or
  static digest, compared with the closest signature already compiled in this process;
- for a persistent miss, which key part differs from the closest stored entry of the same
  function (a helper's code, a library version, a jax config value, ``XLA_FLAGS`` ...).

Counters (``kiln.stats()``) are in ``kiln._base._stats``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from .._base import StoreError, _stats, is_key, short_key
from ..stores import Store

__all__ = ["Explainer", "explain", "describe_persistent_miss", "describe_signature_change",
           "diff_parts"]

logger = logging.getLogger("kiln")


def explain(kind: str, message: str, *, explain_on: bool) -> None:
    """Log one miss reason (WARNING when explaining, else DEBUG) and count its kind."""
    _stats.count_reason(kind)
    logger.log(logging.WARNING if explain_on else logging.DEBUG, "kiln: %s", message)


class Explainer:
    """The reasons one miss gives, each naming its function ``name``.

    ``memory_reason``: why the call missed the process's table, said once (and only when the
    store will not hit either: :meth:`memory_miss`). ``quiet``: polling the store for another
    process's entry (single-flight), which says nothing.
    """

    def __init__(self, name: str, explain_on: bool) -> None:
        self.name = name
        self.explain_on = explain_on
        self.quiet = False
        self.memory_reason: tuple[str, str] | None = None

    def __call__(self, kind: str, message: str) -> None:
        if not self.quiet:
            explain(kind, f"{self.name}: {message}", explain_on=self.explain_on)

    @property
    def wanted(self) -> bool:
        """Whether reasons are shown (``KILN_EXPLAIN=1``, or the ``kiln`` logger at DEBUG): a
        reason that costs work to find is only looked for then."""
        return self.explain_on or logger.isEnabledFor(logging.DEBUG)

    def memory_miss(self) -> None:
        """Say why this call missed in process, once."""
        if self.memory_reason is not None:
            explain(*self.memory_reason, explain_on=self.explain_on)
            self.memory_reason = None

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False


def _fmt_leaf(sig: Any) -> str:
    if isinstance(sig, type):
        return f"python {sig.__name__}"
    if hasattr(sig, "shape") and hasattr(sig, "dtype"):
        weak = " (weak type)" if getattr(sig, "weak_type", False) else ""
        return f"{sig.dtype}{list(sig.shape)}{weak}"
    return str(sig)


def describe_signature_change(
    name: str,
    new: tuple[Any, list[str], tuple[Any, ...], tuple[Any, ...]],
    seen: list[tuple[Any, list[str], tuple[Any, ...], tuple[Any, ...]]],
) -> str:
    """Explain a new signature against the closest one already compiled.

    Each signature is ``(treedef, leaf paths, leaf signatures, static items)``.
    """
    treedef, paths, leaves, statics = new
    if not seen:
        return f"{name}: first call in this process"
    best = max(seen, key=lambda old: (old[0] == treedef) * 1000
               + sum(a == b for a, b in zip(old[2], leaves, strict=False))
               + sum(a == b for a, b in zip(old[3], statics, strict=False)))
    changes = []
    if best[0] != treedef:
        changes.append(f"pytree structure changed: {best[0]} -> {treedef}")
    else:
        for path, a, b in zip(paths, best[2], leaves, strict=False):
            if a != b:
                changes.append(f"argument {path}: {_fmt_leaf(a)} -> {_fmt_leaf(b)}")
    for (sname, a), (_, b) in zip(best[3], statics, strict=False):
        if a != b:
            changes.append(f"static argument {sname}: digest {short_key(a)} -> {short_key(b)}")
    if not changes:
        changes.append("jax config that changes tracing differs")
    return f"{name}: recompiling because " + "; ".join(changes)


def describe_persistent_miss(
    store: Store, function: str, parts: Sequence[tuple[str, str]],
    fp_parts: Sequence[tuple[str, str]], signature: str,
) -> str:
    """Why ``function`` (``module.qualname``) missed the store: the key parts in which the
    closest stored entry of the same function differs (``parts``: the call's key parts,
    ``fp_parts``: its fingerprint's, ``signature``: its argument types as text)."""
    best: list[str] | None = None
    try:
        for other in store.iter():
            header = store.header(other)
            if (not header or header.get("function") != function
                    or header.get("kind") != "executable"):  # a verify-only marker: no key parts
                continue
            diff = diff_parts(
                [p for p in parts if p[0] != "signature"] + list(fp_parts),
                [p for p in header.get("key_parts", []) if p[0] != "signature"]
                + header.get("fp_parts", []),
            )
            # the argument avals (static values are key parts of their own, diffed above)
            old_avals = str(header.get("signature")).split("; static ")[0]
            avals = signature.split("; static ")[0]
            if old_avals != avals:
                diff.insert(0, f"argument types: {old_avals} -> {avals}")
            if best is None or len(diff) < len(best):
                best = diff
    except (OSError, StoreError):
        best = None
    if best is None:
        return f"no stored entry for {function} ({signature})"
    if not best:
        return ("closest stored entry differs in no part kiln names (the digest of a static "
                "value as a whole)")
    return "closest stored entry differs in: " + "; ".join(best[:8])


# fingerprint parts that repeat a key part (static arguments) or only mark a position; a
# static object's fields (``value:static:self.lr``) are its key, and are named
def _noise(name: str) -> bool:
    return name.startswith("extra:") or (name.startswith(("value:static:", "container:static:"))
                                         and "." not in name.partition("static:")[2])


def _short(v: str | None) -> str | None:
    """Hex digests shortened to 12 characters."""
    return short_key(v) if is_key(v, digest=True) else v


def diff_parts(
    new: list[tuple[str, str]], old: list[list[str]] | list[tuple[str, str]]
) -> list[str]:
    """Names (with old -> new values when short) of key parts that differ."""
    old_d = {n: v for n, v in old if not _noise(n)}
    new_d = {n: v for n, v in new if not _noise(n)}
    out = []
    for n in list(new_d) + [n for n in old_d if n not in new_d]:
        a, b = old_d.get(n), new_d.get(n)
        if a == b:
            continue
        a, b = _short(a), _short(b)
        if a is None:
            out.append(f"{n} added")
        elif b is None:
            out.append(f"{n} removed")
        elif len(a) <= 120 and len(b) <= 120:
            out.append(f"{n}: {a} -> {b}")
        else:
            out.append(f"{n} changed")
    return out
