"""The base layer: what every other layer may use.

``_errors`` (kiln's exceptions and warnings), ``_config`` (settings from ``KILN_*``, files and
:func:`kiln.configure`), ``_stats`` (the counters :func:`kiln.stats` reads), ``_gc``,
``_version``, and ``_jax_compat``: the only module of kiln that reaches into ``jax._src``.
"""

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
from ._errors import UnverifiableEntry as UnverifiableEntry
from ._errors import VerifyError as VerifyError
from ._stats import Stats as Stats
from ._stats import reset_stats as reset_stats
from ._stats import stats as stats

__all__ = ["BundleError", "Config", "config_context", "ConfigError", "configure", "EntryError",
           "get_config", "KilnError", "KilnWarning", "reset_stats", "StaticArgumentError", "Stats",
           "stats", "StoreError", "StoreWarning", "UnverifiableEntry", "VerifyError"]
