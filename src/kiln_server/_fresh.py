"""Whether what a server imported is still what a plain run would import: the files of its
modules, the folders of ``sys.path`` (their listings, ``.pth`` files and installed
distributions), the interpreter, and the program's own folder (a new file there named as a
preloaded module would shadow it)."""

from __future__ import annotations

import os
import sys

__all__ = ["Snapshot"]

_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd", ".pth")


def _ident(path: str) -> tuple[int, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size, info.st_ino, info.st_dev)


class Snapshot:
    """The state of everything a server's imports read, taken after it imported them
    (``new``: the modules it imported itself; ``started``: when it began, seconds)."""

    def __init__(self, new: list[str], started: float) -> None:
        watched: dict[str, tuple[int, int, int, int] | None] = {}
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str):
                watched[file] = _ident(file)
        for entry in sys.path:
            where = entry or "."
            watched[where] = _ident(where)
            if not os.path.isdir(where):
                continue
            try:
                names = os.listdir(where)
            except OSError:
                continue
            for name in names:
                if name.endswith(".pth"):
                    watched[os.path.join(where, name)] = _ident(os.path.join(where, name))
                elif name.endswith((".dist-info", ".egg-info")):
                    record = os.path.join(where, name, "RECORD")
                    watched[record] = _ident(record)
        watched[sys.executable] = _ident(os.path.realpath(sys.executable))
        self.watched = watched
        self.shadowing = {name.split(".", 1)[0] for name in new}
        # a file changed while the server imported it: what it imported may be either
        limit = int((started - 2.0) * 1e9)
        self.young = next((p for p, s in watched.items() if s is not None and s[0] >= limit
                           and p != sys.executable), None)

    def stale(self, own_dir: str | None = None) -> str | None:
        """Why a fork now could differ from a plain run; None if it cannot."""
        if self.young is not None:
            return f"{self.young} changed while the server imported it"
        for path, before in self.watched.items():
            now = _ident(os.path.realpath(path) if path == sys.executable else path)
            if now != before:
                return f"{path} changed"
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
