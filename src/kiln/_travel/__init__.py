"""Executables that travel between processes other than through a store lookup.

``_pickling`` (pickled kiln functions carry their entries), ``_bundle`` (``kiln export`` /
``kiln import`` files) and ``_jax_cache`` (the ``kiln://`` route: JAX's own persistent cache
kept in kiln's store, for code that calls ``jax.jit`` itself).
"""
