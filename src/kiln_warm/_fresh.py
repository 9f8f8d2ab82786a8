"""Whether what a server imported is still what a plain run would import: the files of its
modules, the other files its imports read (a library's config file), the folders of
``sys.path`` (what in them could be imported under a name the process uses, ``.pth`` files,
installed distributions), the interpreter, and the program's own folder (a new file there
named as a preloaded module would shadow it). A file written in a folder of
``sys.path`` under another name (a program's output in its working folder) changes nothing."""

from __future__ import annotations

import os
import sys

__all__ = ["Snapshot"]

_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd", ".pth")
_DISTRIBUTIONS = (".dist-info", ".egg-info", ".egg-link")


def _ident(path: str) -> tuple[int, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size, info.st_ino, info.st_dev)


def _listing(where: str, names: set[str]) -> frozenset[str] | None:
    """The entries of folder ``where`` that could change an import: named as a module in use
    (a module, a package, a namespace folder, an extension), ``.pth`` files, distributions."""
    try:
        with os.scandir(where) as entries:
            return frozenset(e.name for e in entries
                             if e.name.endswith(".pth") or e.name.endswith(_DISTRIBUTIONS)
                             or (e.name.split(".", 1)[0] in names and e.name != "__pycache__"))
    except OSError:
        return None


class Snapshot:
    """The state of everything a server's imports read, taken after it imported them
    (``new``: the modules it imported itself; ``started``: when it began, seconds)."""

    def __init__(self, new: list[str], started: float) -> None:
        self.names = {name.split(".", 1)[0] for name in sys.modules}
        files: dict[str, tuple[int, int, int, int] | None] = {}
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str):
                files[file] = _ident(file)
        # the files read while the server imported (a library's config file in the working
        # folder: ./matplotlibrc), as kiln's record of the process's inputs saw them
        # (kiln_early._inputs: files outside the standard library and the installed packages)
        inputs = sys.modules.get("kiln_early._inputs")
        for path in inputs.files() if inputs is not None and inputs.started() else ():
            files.setdefault(path, _ident(path))
        folders: dict[str, frozenset[str] | None] = {}
        for entry in sys.path:
            where = entry or "."
            if not os.path.isdir(where):
                files[where] = _ident(where)  # a zip file
                continue
            folders[where] = listing = _listing(where, self.names)
            for name in listing or ():
                if name.endswith(".pth"):
                    files[os.path.join(where, name)] = _ident(os.path.join(where, name))
                elif name.endswith(_DISTRIBUTIONS):
                    record = os.path.join(where, name, "RECORD")
                    files[record] = _ident(record)
        self.files = files
        self.folders = folders
        self.interpreter = _ident(os.path.realpath(sys.executable))
        self.shadowing = {name.split(".", 1)[0] for name in new}
        # a file changed while the server imported it: what it imported may be either
        limit = int((started - 2.0) * 1e9)
        self.young = next((p for p, s in files.items() if s is not None and s[0] >= limit),
                          None)

    def stale(self, own_dir: str | None = None) -> str | None:
        """Why a fork now could differ from a plain run; None if it cannot."""
        if self.young is not None:
            return f"{self.young} changed while the server imported it"
        if _ident(os.path.realpath(sys.executable)) != self.interpreter:
            return f"the interpreter {sys.executable} changed"
        for path, before in self.files.items():
            if _ident(path) != before:
                return f"{path} changed"
        for where, before in self.folders.items():
            now = _listing(where, self.names)
            if now != before:
                added = sorted((now or frozenset()) - (before or frozenset()))
                removed = sorted((before or frozenset()) - (now or frozenset()))
                return f"the listing of {where} changed (new: {added}, gone: {removed})"
        if own_dir:
            try:
                names = os.listdir(own_dir)
            except OSError:
                return f"cannot list {own_dir}"
            for name in names:
                base = name.split(".", 1)[0]
                if base in self.shadowing and (name == base or name.endswith(_MODULE_SUFFIXES)):
                    return (f"{os.path.join(own_dir, name)} would shadow the preloaded module "
                            f"{base!r}")
        return None
