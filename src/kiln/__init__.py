"""kiln: make XLA compilation a one-time cost for JAX programs."""

import importlib as _importlib
import re as _re
import sys as _sys
import typing as _typing

from kiln_early import _inputs

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
from ._base import __version__ as __version__
from ._base import config_context as config_context
from ._base import configure as configure
from ._base import get_config as get_config
from ._base import reset_stats as reset_stats
from ._base import stats as stats

# the record of the process's inputs (what an entry's guard is made of) from here on, before
# jax and what kiln imports with it read a file or a variable (kiln run and pytest --kiln
# start it before the program itself)
_inputs.start()

if _typing.TYPE_CHECKING:
    # the names whose modules import jax (_JAX_NAMES says where each comes from)
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

# The public names whose modules import jax, by module (the TYPE_CHECKING imports above, for
# type checkers; tests/test_cli_imports.py holds the two the same). `import kiln` binds them at
# once. The kiln command line imports kiln without them (_without_jax), so that the verbs that
# never run JAX (ls, stats, verify, prune, clear, --help, --version) answer without importing
# jax (~1.2 s of CPU): there each is bound at its first use (PEP 562), which turns on what
# `import kiln` turns on first.
_JAX_NAMES = {
    "Compiled": "._jit",
    "DynamicNoinline": "._jit",
    "JitFunction": "._jit",
    "Lowered": "._jit",
    "NoinlineFunction": "._jit",
    "filter_jit": "._jit",
    "jit": "._jit",
    "keep_jax_jit": "._jit",
    "noinline": "._jit",
    "replace_jax_jit": "._jit",
    "restore_jax_jit": "._jit",
    "wait_for_tier_up": "._miss",
    "ImportedEntry": "._travel",
    "ImportReport": "._travel",
    "disable_jax_cache": "._travel",
    "enable_jax_cache": "._travel",
    "export_entries": "._travel",
    "import_entries": "._travel",
}


def _without_jax() -> bool:
    """Whether the kiln command line is importing kiln: the ``kiln`` script (``kiln_cli``,
    which says so while it imports ``kiln._cli``), or ``python -m kiln``, whose package Python
    imports while ``sys.argv`` is ``['-m', ARGS...]`` and the token of ``sys.orig_argv`` before
    ARGS names the module (``kiln``, or ``-mkiln``)."""
    if getattr(_sys.modules.get("kiln_cli"), "importing", False):
        return True
    argv, orig = _sys.argv, getattr(_sys, "orig_argv", [])
    if not argv or argv[0] != "-m" or len(orig) <= len(argv):
        return False
    token = orig[-len(argv)]
    return token == "kiln" or _re.fullmatch(r"-[^m-]*mkiln", token) is not None


def _bind_jax_names() -> None:
    """Bind the names of :data:`_JAX_NAMES` and turn on what ``import kiln`` turns on (the
    kiln:// route; ``KILN_REPLACE_JIT=1``: the jax.jit swap), in that order."""
    names = globals()
    for name, module in _JAX_NAMES.items():
        names[name] = getattr(_importlib.import_module(module, __name__), name)
    from ._jit import at_import

    at_import()


if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in _JAX_NAMES:
            _bind_jax_names()
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_JAX_NAMES})


# The kiln:// route (JAX's own persistent cache in kiln's store) from import on, so what a
# script compiles before its first kiln.jit is cached too; KILN_JAX_CACHE=0 or a JAX cache
# directory of the user's own leaves JAX alone (docs/reference.md, "What kiln changes in JAX's
# global state").
# KILN_REPLACE_JIT=1: every jax.jit made from here on outside JAX itself is a kiln.jit
if not _without_jax():
    _bind_jax_names()
