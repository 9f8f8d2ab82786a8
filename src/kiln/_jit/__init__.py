"""The public constructors and the objects they return.

``_api`` (:func:`kiln.jit`, :func:`kiln.filter_jit`), ``_function`` (:class:`kiln.JitFunction`:
options, the dispatch of a call, the in-process table), ``_stages`` (``.lower()`` /
``.compile()``: :class:`kiln.Lowered`, :class:`kiln.Compiled`) and ``_noinline``
(:func:`kiln.noinline`).
"""
