"""The miss path: what happens when a call's key is not in the process's table.

``_call`` (what ``kiln._jit`` hands it: the :class:`Call` record, and for a miss one
:class:`Request` of what the miss reads), ``_compile`` (one miss: load the key's entry, or
single-flight trace, lower, compile and write it, returning one result), made of ``_call_keys``
(the call's store keys), ``_program`` (the trace and its lowerings), ``_context`` (what the
reader and the writer read), ``_reader`` (load and check an entry, a bad entry),
``_writer`` (compile, serialize, write) and ``_tier_up``
(which form of a program calling noinline functions compiles when; the optimised one in the
background); ``_outputs`` (kiln.filter_jit's non-array outputs), ``_noinline_p`` (the primitive
a :func:`kiln.noinline` call binds), ``_explain`` (``KILN_EXPLAIN``: why a call missed) and
``_progress`` (the line shown while a compile runs or a lease is awaited).
"""

from ._call import Call as Call
from ._call import Once as Once
from ._call import Request as Request
from ._call import Statics as Statics
from ._compile import _Miss as Miss
from ._noinline_p import DERIVE as DERIVE
from ._noinline_p import _Sub as Sub
from ._noinline_p import avals_of as avals_of
from ._noinline_p import derived_name as derived_name
from ._noinline_p import noinline_p as noinline_p
from ._noinline_p import split_linear as split_linear
from ._outputs import Box as Box
from ._outputs import abstract_sig as abstract_sig
from ._outputs import is_static_output as is_static_output
from ._outputs import with_static_outputs as with_static_outputs
from ._tier_up import wait_for_tier_up as wait_for_tier_up

__all__ = ["abstract_sig", "avals_of", "Box", "Call", "DERIVE", "derived_name", "is_static_output",
           "Miss", "noinline_p", "Once", "Request", "split_linear", "Statics", "Sub",
           "wait_for_tier_up", "with_static_outputs"]
