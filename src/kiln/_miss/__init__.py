"""The miss path: what happens when a call's key is not in the process's table.

``_compile`` (look the key up in the store, or trace, lower, compile and write it), ``_tier_up``
(a quick compile first, the optimised one in the background), ``_noinline_p`` (the primitive a
:func:`kiln.noinline` call binds), ``_explain`` (``KILN_EXPLAIN``: why a call missed) and
``_progress`` (the line shown while a compile runs or a lease is awaited).
"""
