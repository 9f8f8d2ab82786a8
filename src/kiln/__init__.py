"""kiln: make XLA compilation a one-time cost for JAX programs."""

from ._base._config import Config as Config
from ._base._config import config_context as config_context
from ._base._config import configure as configure
from ._base._config import get_config as get_config
from ._base._errors import BundleError as BundleError
from ._base._errors import ConfigError as ConfigError
from ._base._errors import EntryError as EntryError
from ._base._errors import KilnError as KilnError
from ._base._errors import KilnWarning as KilnWarning
from ._base._errors import StaticArgumentError as StaticArgumentError
from ._base._errors import StoreError as StoreError
from ._base._errors import StoreWarning as StoreWarning
from ._base._errors import VerifyError as VerifyError
from ._base._stats import Stats as Stats
from ._base._stats import reset_stats as reset_stats
from ._base._stats import stats as stats
from ._base._version import __version__ as __version__
from ._jit._api import filter_jit as filter_jit
from ._jit._api import jit as jit
from ._jit._function import JitFunction as JitFunction
from ._jit._noinline import DynamicNoinline as DynamicNoinline
from ._jit._noinline import NoinlineFunction as NoinlineFunction
from ._jit._noinline import noinline as noinline
from ._jit._stages import Compiled as Compiled
from ._jit._stages import Lowered as Lowered
from ._miss._tier_up import wait_for_tier_up as wait_for_tier_up
from ._travel._bundle import ImportedEntry as ImportedEntry
from ._travel._bundle import ImportReport as ImportReport
from ._travel._bundle import export_entries as export_entries
from ._travel._bundle import import_entries as import_entries
from ._travel._jax_cache import disable_jax_cache as disable_jax_cache
from ._travel._jax_cache import enable_jax_cache as enable_jax_cache

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
    "noinline",
    "reset_stats",
    "stats",
    "wait_for_tier_up",
]

# The kiln:// route (JAX's own persistent cache in kiln's store) from import on, so what a
# script compiles before its first kiln.jit is cached too; KILN_JAX_CACHE=0 or a JAX cache
# directory of the user's own leaves JAX alone (README, "What kiln changes in JAX").
from ._travel._jax_cache import enable_at_import as _enable_at_import  # noqa: E402

_enable_at_import()
