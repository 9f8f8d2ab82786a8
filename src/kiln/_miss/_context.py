"""What the reader and the writer of one miss share (:class:`MissContext`): the request, the
settings, the store, the program, its keys and its explanations, and the two collections both
add to (the entries loaded or written, the keys to write with the store's ``replace``), owned
here and nowhere else."""

from __future__ import annotations

import dataclasses

from .._base import Config
from ..stores import Store
from ._call import Request
from ._call_keys import CallKeys
from ._explain import Explainer
from ._program import Program

__all__ = ["MissContext"]


@dataclasses.dataclass(frozen=True)
class MissContext:
    """One miss's inputs, as :class:`~._reader.EntryReader` and :class:`~._writer.EntryWriter`
    read them.

    Attributes:
        request: what the miss reads of the function and the call.
        cfg: the settings in force when the miss began.
        store: the store it reads and writes.
        program: the call's program (trace and lowerings).
        keys: the call's keys.
        explain: its explanations (``KILN_EXPLAIN``).
        entries: (store, key) of the executable entries loaded or written (tier-up's too):
            what a kiln function pickled by value carries with it.
        replace_keys: keys whose stored entry was found stale or unusable, or that hold a
            marker or an alias to overwrite: written with the store's ``replace`` (a remote
            store's put is create-only).
        keep_keys: signed entries this process cannot check, left as they are.
    """

    request: Request
    cfg: Config
    store: Store
    program: Program
    keys: CallKeys
    explain: Explainer
    entries: list[tuple[Store, str]] = dataclasses.field(default_factory=list)
    replace_keys: set[str] = dataclasses.field(default_factory=set)
    # signed entries this process cannot check (no signing key here): left alone, never
    # replaced or overwritten (an executable is compiled here; an alias is not written)
    keep_keys: set[str] = dataclasses.field(default_factory=set)
