"""The base layer: what every other layer may use.

``_errors`` (kiln's exceptions and warnings), ``_config`` (settings from ``KILN_*``, files and
:func:`kiln.configure`), ``_stats`` (the counters :func:`kiln.stats` reads), ``_gc``,
``_version``, and ``_jax_compat``: the only module of kiln that reaches into ``jax._src``.
"""
