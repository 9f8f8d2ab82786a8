"""Keys: what a call is keyed by.

``_args`` (the call's arguments: avals, static values, pytree structure), ``_hashing`` (static
values hashed by value: arrays by shape, dtype and bytes), ``_fingerprint`` (the code and data a
trace used: the static walk of ``_walker`` over code digested by ``_code``, libraries counted
by version as ``_libraries`` tells them from user code), ``_recorder`` and ``_manifest`` (what
ran while tracing, as a manifest checked on a warm start), ``_reads`` (files and directories a
trace read), ``_machine`` (the kind of machine an executable was compiled for) and ``_key`` (the
store key made from all of these).
"""
