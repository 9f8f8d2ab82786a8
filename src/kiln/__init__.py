"""kiln: make XLA compilation a one-time cost for JAX programs."""

from ._api import filter_jit as filter_jit
from ._api import jit as jit
from ._bundle import ImportedEntry as ImportedEntry
from ._bundle import ImportReport as ImportReport
from ._bundle import export_entries as export_entries
from ._bundle import import_entries as import_entries
from ._config import Config as Config
from ._config import config_context as config_context
from ._config import configure as configure
from ._config import get_config as get_config
from ._errors import BundleError as BundleError
from ._errors import ConfigError as ConfigError
from ._errors import EntryError as EntryError
from ._errors import KilnError as KilnError
from ._errors import KilnWarning as KilnWarning
from ._errors import StaticArgumentError as StaticArgumentError
from ._errors import StoreError as StoreError
from ._errors import StoreWarning as StoreWarning
from ._errors import VerifyError as VerifyError
from ._jax_cache import disable_jax_cache as disable_jax_cache
from ._jax_cache import enable_jax_cache as enable_jax_cache
from ._jit import JitFunction as JitFunction
from ._noinline import DynamicNoinline as DynamicNoinline
from ._noinline import NoinlineFunction as NoinlineFunction
from ._noinline import noinline as noinline
from ._stages import Compiled as Compiled
from ._stages import Lowered as Lowered
from ._stats import Stats as Stats
from ._stats import reset_stats as reset_stats
from ._stats import stats as stats
from ._tier_up import wait_for_tier_up as wait_for_tier_up
from ._version import __version__ as __version__

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
from ._jax_cache import enable_at_import as _enable_at_import  # noqa: E402

_enable_at_import()
