"""The miss path: what happens when a call's key is not in the process's table.

``_call`` (what ``kiln._jit`` hands it: the :class:`Call` record and the function), ``_compile``
(one miss: load the key's entry, or single-flight trace, lower, compile and write it), made of
``_call_keys`` (the call's store keys), ``_program`` (the trace and its lowerings), ``_reader``
(load and check an entry, a bad entry), ``_writer`` (compile, serialize, write) and ``_tier_up``
(which form of a program calling noinline functions compiles when; the optimised one in the
background); ``_outputs`` (kiln.filter_jit's non-array outputs), ``_noinline_p`` (the primitive
a :func:`kiln.noinline` call binds), ``_explain`` (``KILN_EXPLAIN``: why a call missed) and
``_progress`` (the line shown while a compile runs or a lease is awaited).
"""
