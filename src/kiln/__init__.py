"""kiln: make XLA compilation a one-time cost for JAX programs."""

from ._base import BundleError as BundleError
from ._base import Config as Config
from ._base import ConfigError as ConfigError
from ._base import EntryError as EntryError
from ._base import KilnError as KilnError
from ._base import KilnWarning as KilnWarning
from ._base import StaticArgumentError as StaticArgumentError
from ._base import Stats as Stats
from ._base import StoreError as StoreError
from ._base import StoreWarning as StoreWarning
from ._base import VerifyError as VerifyError
from ._base import config_context as config_context
from ._base import configure as configure
from ._base import get_config as get_config
from ._base import reset_stats as reset_stats
from ._base import stats as stats
from ._base._version import __version__ as __version__
from ._jit import Compiled as Compiled
from ._jit import DynamicNoinline as DynamicNoinline
from ._jit import JitFunction as JitFunction
from ._jit import Lowered as Lowered
from ._jit import NoinlineFunction as NoinlineFunction
from ._jit import filter_jit as filter_jit
from ._jit import jit as jit
from ._jit import keep_jax_jit as keep_jax_jit
from ._jit import noinline as noinline
from ._jit import replace_jax_jit as replace_jax_jit
from ._jit import restore_jax_jit as restore_jax_jit
from ._miss import wait_for_tier_up as wait_for_tier_up
from ._travel import ImportedEntry as ImportedEntry
from ._travel import ImportReport as ImportReport
from ._travel import disable_jax_cache as disable_jax_cache
from ._travel import enable_jax_cache as enable_jax_cache
from ._travel import export_entries as export_entries
from ._travel import import_entries as import_entries

__all__ = [
    "BundleError",
    "Compiled",
    "Config",
    "ConfigError",
    "DynamicNoinline",
    "EntryError",
    "ImportReport",
    "ImportedEntry",
    "JitFunction",
    "KilnError",
    "KilnWarning",
    "Lowered",
    "NoinlineFunction",
    "StaticArgumentError",
    "Stats",
    "StoreError",
    "StoreWarning",
    "VerifyError",
    "config_context",
    "configure",
    "disable_jax_cache",
    "enable_jax_cache",
    "export_entries",
    "filter_jit",
    "get_config",
    "import_entries",
    "jit",
    "keep_jax_jit",
    "noinline",
    "replace_jax_jit",
    "reset_stats",
    "restore_jax_jit",
    "stats",
    "wait_for_tier_up",
]

# The kiln:// route (JAX's own persistent cache in kiln's store) from import on, so what a
# script compiles before its first kiln.jit is cached too; KILN_JAX_CACHE=0 or a JAX cache
# directory of the user's own leaves JAX alone (docs/reference.md, "What kiln changes in JAX's
# global state").
# KILN_REPLACE_JIT=1: every jax.jit made from here on outside JAX itself is a kiln.jit
from ._jit import replace_at_import as _replace_at_import  # noqa: E402
from ._travel import enable_at_import as _enable_at_import  # noqa: E402

_enable_at_import()
_replace_at_import()
