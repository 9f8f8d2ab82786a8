"""Executables that travel between processes other than through a store lookup.

``_pickling`` (pickled kiln functions carry their entries), ``_bundle`` (``kiln export`` /
``kiln import`` files) and ``_jax_cache`` (the ``kiln://`` route: JAX's own persistent cache
kept in kiln's store, for code that calls ``jax.jit`` itself) and ``_eager`` (JAX's own eager
work under the ``jax.jit`` swap: loaded with no trace or lowering).
"""

from ._bundle import Exported as Exported
from ._bundle import ImportedEntry as ImportedEntry
from ._bundle import ImportReport as ImportReport
from ._bundle import export_entries as export_entries
from ._bundle import import_entries as import_entries
from ._bundle import write_bundle as write_bundle
from ._eager import disable_eager as disable_eager
from ._eager import enable_eager as enable_eager
from ._jax_cache import disable_jax_cache as disable_jax_cache
from ._jax_cache import enable_at_import as enable_at_import
from ._jax_cache import enable_jax_cache as enable_jax_cache
from ._jax_cache import kiln_compiling as kiln_compiling

__all__ = ["disable_eager", "disable_jax_cache", "enable_eager", "enable_at_import",
           "enable_jax_cache", "export_entries", "Exported", "import_entries", "ImportedEntry",
           "ImportReport", "kiln_compiling", "write_bundle"]
