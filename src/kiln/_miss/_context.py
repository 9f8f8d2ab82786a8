"""What the reader and the writer of one miss read (:class:`MissContext`): the request, the
settings, the store, the program, its keys and its explanations. Values only: what a read finds
out about a key it returns, and the miss keeps (``_compile._Miss``)."""

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
    read them (a tier-up's too: :class:`~._tier_up.Plan`); ``cfg``: the settings in force when
    the miss began, ``explain``: its explanations (``KILN_EXPLAIN``)."""

    request: Request
    cfg: Config
    store: Store
    program: Program
    keys: CallKeys
    explain: Explainer
