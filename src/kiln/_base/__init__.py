"""The base layer: what every other layer may use.

``_errors`` (kiln's exceptions and warnings), ``_config`` (settings from ``KILN_*``, files and
:func:`kiln.configure`), ``_stats`` (the counters :func:`kiln.stats` reads), ``_entry`` (the
format of one entry: its bytes, its header, what a key looks like), ``_gc``, ``_threads`` (a
thread's own setting for a block), ``_version``, and
``_jax_compat``: the only module of kiln that reaches into ``jax._src``.
"""

from ._config import Config as Config
from ._config import config_context as config_context
from ._config import configure as configure
from ._config import get_config as get_config
from ._entry import FORMAT_VERSION as FORMAT_VERSION
from ._entry import KEY_LENGTH as KEY_LENGTH
from ._entry import MAGIC as MAGIC
from ._entry import Entry as Entry
from ._entry import decode as decode
from ._entry import digest as digest
from ._entry import encode as encode
from ._entry import is_key as is_key
from ._entry import peek_header as peek_header
from ._entry import read_header as read_header
from ._entry import recorded_parts as recorded_parts
from ._entry import short_key as short_key
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
from ._threads import set_in_thread as set_in_thread
from ._version import __version__ as __version__

__all__ = ["BundleError", "Config", "config_context", "ConfigError", "configure", "decode",
           "digest", "encode", "Entry", "EntryError", "FORMAT_VERSION", "get_config", "is_key",
           "KEY_LENGTH", "KilnError", "KilnWarning", "MAGIC", "peek_header", "read_header",
           "recorded_parts", "reset_stats", "set_in_thread", "short_key", "StaticArgumentError",
           "Stats", "stats", "StoreError", "StoreWarning", "UnverifiableEntry", "VerifyError",
           "__version__"]
