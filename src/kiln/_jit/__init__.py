"""The public constructors and the objects they return.

``_api`` (:func:`kiln.jit`, :func:`kiln.filter_jit`), ``_function`` (:class:`kiln.JitFunction`:
the dispatch of a call, the in-process table, nested calls, AOT), ``_options`` (its
:class:`JitOptions`, made once), ``_prepare`` (keying a call in the process), ``_dispatch`` (the
C++ dispatcher), ``_wrappers`` (the ``jax.jit`` functions made of the user's function),
``_stages`` (``.lower()`` / ``.compile()``: :class:`kiln.Lowered`, :class:`kiln.Compiled`) and
``_noinline`` (:func:`kiln.noinline`).
"""
