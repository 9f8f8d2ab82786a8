"""Library or user code: which files, modules and classes are the user's, and the version a
library counts by.

"User code" is any Python file outside the interpreter's stdlib and site-packages (and outside
kiln itself): its code is hashed. Installed libraries count by distribution name + version
(``importlib.metadata``) and by the files the installer wrote, never by code: a digest of the
distribution's ``RECORD`` (the list of installed files with their sha256, written by pip, uv
and every wheel installer), so a package reinstalled at the same version with changed files
(a local wheel rebuilt, ``pip install --force-reinstall .`` of your own package) is another
library. The digest covers the rows of files inside the installation (sorted: installers
order them differently), not the ``.dist-info`` folder (``INSTALLER``, ``direct_url.json``
differ between installs of one wheel), scripts outside it (their ``#!`` line names the
interpreter) or rows without a hash (bytecode compiled at install), so one wheel installed on
two machines counts as one library. One read per distribution per process (~0.1-5 ms: jax's
``RECORD`` lists ~1200 files). A distribution without a ``RECORD`` (an old ``.egg-info``)
counts by name and version only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import pathlib
import re
import sys
import types
from typing import Any

import xxhash

# installed code (LIB_ROOTS), kiln's own (KILN_ROOT) and user code (is_user_file) are told
# apart where the record of the process's inputs starts, before kiln is imported
from kiln_early._inputs import KILN_ROOT, LIB_ROOTS, is_user_file

__all__ = [
    "KILN_ROOT",
    "LIB_ROOTS",
    "has_file",
    "installed_path",
    "is_user_class",
    "is_user_file",
    "is_user_object",
    "library_version",
    "module_is_user",
    "script_module",
]

@functools.lru_cache(maxsize=4096)
def installed_path(filename: str) -> str | None:
    """Where installed file ``filename`` lies under the stdlib or site-packages folder it is
    in (``flax/core/scope.py``; the longest such folder: site-packages lie inside the stdlib's),
    by its real path; None for any other file."""
    real = os.path.realpath(filename)
    roots = sorted(LIB_ROOTS, key=len, reverse=True)
    return next((real[len(root):] for root in roots if real.startswith(root)), None)


def module_is_user(mod: types.ModuleType) -> bool:
    """``mod`` was loaded from a user file (a builtin module or a namespace package has none)."""
    f = getattr(mod, "__file__", None)
    return bool(f) and is_user_file(f)


def is_user_class(cls: type) -> bool:
    """Defined in a user file (classes of C extensions and builtins have no file)."""
    return has_file(cls) and is_user_file(inspect.getfile(cls))


def is_user_object(obj: Any) -> bool:
    """``obj`` is the user's: a function of a user file, a user class, or an instance of one
    (what a stored copy of a host callback must not hold: ``_jax_compat.pickle_callbacks``)."""
    if isinstance(obj, types.FunctionType):
        return is_user_file(obj.__code__.co_filename)
    if isinstance(obj, type):
        return is_user_class(obj)
    return is_user_class(type(obj))


def has_file(obj: Any) -> bool:
    """``inspect.getfile`` finds a file for ``obj``."""
    try:
        inspect.getfile(obj)
        return True
    except (TypeError, OSError):
        return False


def script_module(name: str) -> str:
    """A module's name as keys spell it: the script is ``__main__`` also where a spawned worker
    (multiprocessing, ProcessPoolExecutor) re-imported it as ``__mp_main__``, so the worker
    finds the entries its parent wrote (``sys.modules["__main__"]`` is that module there)."""
    return "__main__" if name == "__mp_main__" else name


def _providers(top: str) -> list[str]:
    """Names of the distributions installed beside top-level package ``top`` that provide it
    (what ``importlib.metadata.packages_distributions()[top]`` says), read from the
    ``.dist-info`` / ``.egg-info`` folders of the ``sys.path`` entry ``top`` is imported from:
    each folder's ``top_level.txt``, else its ``RECORD`` searched as text. Scanning every
    installed distribution with ``packages_distributions()`` parses each ``RECORD`` into
    paths: 0.2-0.65 s in a venv with flax, numpyro and jax-md, on the first call of a
    process; this reads the same files as text, those named like ``top`` first (~0.1 ms; ~10 ms
    for a namespace package or a name unlike its distribution's, 200 distributions)."""
    found: list[str] = []
    mod = sys.modules.get(top)
    regular = getattr(mod, "__file__", None) is not None  # not a namespace package
    for root in _import_roots(top):
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            continue
        folders = [e for e in entries if e.name.endswith((".dist-info", ".egg-info"))]
        if regular:
            # one distribution installs a regular package: those named like it first
            # (dm_haiku-0.0.17.dist-info for haiku)
            key = top.lower().replace("-", "_")
            folders.sort(key=lambda e: key not in e.name.lower())
        for entry in folders:
            if entry.is_dir() and _folder_provides(entry.path, top):
                try:
                    name = importlib.metadata.PathDistribution(
                        pathlib.Path(entry.path)).metadata["Name"]
                except Exception:  # noqa: BLE001 - a broken folder names nothing
                    name = None
                if name:
                    found.append(str(name))
                    if regular:
                        break
        if found:
            break
    return found


def _import_roots(top: str) -> list[str]:
    """The ``sys.path`` entries holding top-level package or module ``top``: the folder of
    the imported module (a namespace package's folders), else every entry."""
    mod = sys.modules.get(top)
    places = list(getattr(mod, "__path__", None) or ())
    if not places and getattr(mod, "__file__", None):
        places = [mod.__file__]  # type: ignore[union-attr]
    roots = list(dict.fromkeys(os.path.dirname(os.path.realpath(p))
                               for p in places if isinstance(p, str)))
    return roots or [p for p in sys.path if p and os.path.isdir(p)]


def _folder_provides(folder: str, top: str) -> bool:
    """A ``.dist-info`` / ``.egg-info`` folder's distribution installs ``top``."""
    try:
        with open(os.path.join(folder, "top_level.txt"), encoding="utf-8") as f:
            return top in f.read().split()
    except OSError:
        pass
    try:
        with open(os.path.join(folder, "RECORD"), encoding="utf-8",
                  errors="surrogateescape") as f:
            text = f.read()
    except OSError:
        return False
    # rows "top/...", "top.py,...", "top.cpython-311-x86_64-linux-gnu.so,..." (maybe quoted)
    pattern = re.compile(r'^"?' + re.escape(top) + r'(/|\.[^/,]*,)', re.MULTILINE)
    return pattern.search(text) is not None


def library_version(module_name: str) -> str:
    """``dist==version`` of the installed distribution that provides ``module_name``."""
    return _top_level_version(module_name.partition(".")[0])


@functools.lru_cache(maxsize=1024)
def _top_level_version(top: str) -> str:
    """``dist==version`` of the distribution of top-level package ``top`` (one metadata read
    per package: a cold fit's walk names ~30 modules of ~6 packages)."""
    if not top:
        return "unknown==unknown"
    if top == "__main__":  # a script run from site-packages: no distribution names it
        return "__main__==unknown"
    if top in sys.stdlib_module_names or top == "builtins":
        return f"python=={sys.version.split()[0]}"
    # Most distributions are named like their top-level package (jax, numpy, equinox): ask
    # for that first, then the distributions beside it (_providers).
    for name in (top, top.replace("_", "-")):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if top in (dist.read_text("top_level.txt") or top).split() or _provides(dist, top):
            meta = dist.metadata  # (parsed on each access: once here)
            return f"{meta['Name']}=={meta['Version']}{_record_digest(dist)}"
    dists = _providers(top)
    if not dists:
        return f"{top}==unknown"
    name = sorted(dists)[0]
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return f"{name}==unknown"
    return f"{name}=={dist.version}{_record_digest(dist)}"


def _record_digest(dist: importlib.metadata.Distribution) -> str:
    """`` record:<xxh3-64>`` of the installed files ``dist``'s ``RECORD`` lists with their
    hashes (see the module doc), or ``""`` without one."""
    try:
        text = dist.read_text("RECORD")
    except (OSError, UnicodeDecodeError):
        text = None
    if not text:
        return ""
    rows = []
    for row in text.splitlines():
        path = row.lstrip('"')
        if (row.endswith(",,") or path.startswith(("../", "/"))
                or path.partition("/")[0].endswith(".dist-info")):
            continue
        rows.append(row)
    rows.sort()
    digest = xxhash.xxh3_64("\n".join(rows).encode("utf-8", "surrogateescape")).hexdigest()
    return f" record:{digest}"


def _provides(dist: importlib.metadata.Distribution, top: str) -> bool:
    files = dist.files or []
    return any(f.parts and f.parts[0] in (top, f"{top}.py") for f in files[:2000])
