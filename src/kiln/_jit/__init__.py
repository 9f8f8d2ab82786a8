"""The public constructors and the objects they return.

``_api`` (:func:`kiln.jit`, :func:`kiln.filter_jit`), ``_function`` (:class:`kiln.JitFunction`:
the dispatch of a call, the in-process table, nested calls, AOT), ``_options`` (its
:class:`JitOptions`, made once), ``_prepare`` (keying a call in the process), ``_dispatch`` (the
C++ dispatcher), ``_wrappers`` (the ``jax.jit`` functions made of the user's function),
``_stages`` (``.lower()`` / ``.compile()``: :class:`kiln.Lowered`, :class:`kiln.Compiled`) and
``_noinline`` (:func:`kiln.noinline`), ``_swap`` (:func:`kiln.replace_jax_jit`: every
``jax.jit`` a kiln.jit), ``_at_import`` (what ``import kiln`` turns on).
"""

from ._api import filter_jit as filter_jit
from ._api import jit as jit
from ._at_import import at_import as at_import
from ._function import JitFunction as JitFunction
from ._noinline import DynamicNoinline as DynamicNoinline
from ._noinline import NoinlineFunction as NoinlineFunction
from ._noinline import noinline as noinline
from ._stages import Compiled as Compiled
from ._stages import Lowered as Lowered
from ._swap import keep_jax_jit as keep_jax_jit
from ._swap import replace_at_import as replace_at_import
from ._swap import replace_jax_jit as replace_jax_jit
from ._swap import restore_jax_jit as restore_jax_jit

__all__ = ["at_import", "Compiled", "DynamicNoinline", "filter_jit", "jit", "JitFunction",
           "keep_jax_jit", "Lowered", "noinline", "NoinlineFunction", "replace_at_import",
           "replace_jax_jit", "restore_jax_jit"]
