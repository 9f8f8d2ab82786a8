"""The guard: the process's inputs, stored with each entry beside its precise key.

The precise key (fingerprint, manifest) says what a trace read. It cannot see state that code
set up *before* the trace, from something outside the process, and that the trace reads through
a channel nobody watches: a library's settings container filled by setup code, a registry, a
C-level context (``decimal.getcontext()``), a standard-library cache (``linecache``), entry
points. So each entry also stores its **guard**: what could have shaped that state, as this
process had seen it when the call missed (:func:`snapshot`), as manifest-like items:

- ``[path, "<file>", digest, identity]``: a file the process read (any code: the standard
  library's and libraries' too, ``linecache``, ``importlib.metadata``, a config loader), and
  the source file of every user module loaded (a module imported from a zip archive: the
  archive), by the xxh3-128 digest of its content as first read (``"absent"``: it did not
  exist) and its ``os.stat`` identity then (``device:inode:size:mtime_ns:ctime_ns``; empty for
  a file changed less than 2 s before: git's "racy" rule);
- ``[path, "<dir>", digest]``: a folder listed, by its sorted names;
- ``[name, "<env>", digest]``: an environment variable user code read (``"absent"``: unset),
  and ``["<environ>", "<env>", digest, "names"]`` when user code iterated the environment: its
  names (each value read is an item of its own);
- ``["<argv>", "<argv>", digest]``: the command line (``sys.argv``: under ``kiln run`` the
  script's, as under ``python``); ``["<code>", "<code>", digest]``: a ``python -c`` program's
  text (its code has no file); ``["<cwd>", "<cwd>", digest]`` (the working folder) and
  ``["<distributions>", "<dists>", digest]`` (every distribution installed on ``sys.path``: its
  folder's name and its ``RECORD``, which lists each installed file with its hash, so a package
  reinstalled at the same version, an editable one's new entry point, count);
- the file, folder and variable items of the manifests of the traces that ran (or whose
  entries were loaded in their place) before the call (:func:`kiln_early._inputs.merge`).

What the record leaves out and why: :mod:`kiln_early._inputs`. Values that differ in every
process (the pid, the clock, a host name, a temporary folder the run makes, the files and logs
it writes, per-job variables libraries read) are not items, so they never move a guard.

A warm lookup whose key matches uses the entry without tracing only when :func:`check` finds
every item of its guard as it is in this process: a file this process read, as it read it,
and any other by its content now (a stat first: an unchanged identity is not read again, so a
1 GB checkpoint costs one ``os.stat``; a file replaced by another of the same size and
modification time has another inode or change time, and is read). Otherwise kiln verifies
once (``kiln._miss``): it traces, lowers and compares the module with the entry's.

Files' digests are kept between processes in ``<cache_dir>/guard/digests.json`` by path and
identity, so an unchanged large input is hashed once, not in every run.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fnmatch
import json
import os
import sys
import sysconfig
import threading
import types
from typing import Any

import xxhash

from kiln_early import _inputs

from .._base import _jax_compat, get_config
from ._environ import check_env, value_digest
from ._libraries import KILN_ROOT, is_user_file
from ._reads import content_digest, racy

__all__ = ["Guard", "check", "snapshot"]

FILE, DIR, ENV = "<file>", "<dir>", "<env>"
ARGV, CODE, CWD, DISTS = "<argv>", "<code>", "<cwd>", "<dists>"
KINDS = {  # guard_exclude's kinds -> the items' kinds they leave out
    "files": (FILE,), "listings": (DIR,), "env": (ENV,), "argv": (ARGV, CODE), "cwd": (CWD,),
    "distributions": (DISTS,),
}
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Guard:
    """A guard made now (:func:`snapshot`).

    Attributes:
        items: the items (sorted), stored in the entry's header.
        digest: xxh3-128 of the items' names and digests: two guards of the same inputs are
            equal, wherever and whenever they were made.
        lost: why this process's inputs cannot guard an entry (a file it read changed before
            kiln could digest it), else None: every lookup then verifies, and nothing is
            recorded as verified.
    """

    items: list[list[str]]
    digest: str
    lost: str | None = None


# -- digests of files, kept by identity ------------------------------------------------------
def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _identity_text(identity: tuple[int, ...] | None) -> str:
    """The identity as an item keeps it, or ``""`` for a racy file (:func:`racy`: read)."""
    if identity is None or racy(identity[3], identity[4]):
        return ""
    return ":".join(map(str, identity))


class _Digests:
    """File digests by (path, identity), in this process and in ``digests.json`` under the
    cache folder (loaded at the first use, merged and written at exit)."""

    _MAX = 20_000

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.known: dict[str, tuple[str, str]] = {}  # path -> (identity text, digest)
        self.new: dict[str, tuple[str, str]] = {}
        self.path: str | None = None

    def _load(self) -> None:
        if self.path is not None:
            return
        self.path = os.path.join(str(get_config().cache_dir), "guard", "digests.json")
        with contextlib.suppress(OSError, ValueError, TypeError):
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            self.known.update({p: (v[0], v[1]) for p, v in data.items()
                               if isinstance(v, list) and len(v) == 2})
        atexit.register(self.save)

    def digest(self, path: str, identity: tuple[int, ...]) -> str:
        """The content digest of ``path``, whose identity is ``identity`` (read, unless this
        process or an earlier one digested it at that identity)."""
        text = _identity_text(identity)
        with self.lock:
            self._load()
            known = self.known.get(path)
        if text and known is not None and known[0] == text:
            return known[1]
        digest = content_digest(path)
        if text:
            with self.lock:
                self.known[path] = self.new[path] = (text, digest)
        return digest

    def save(self) -> None:
        """Merge what this process digested into ``digests.json`` (atomically; a cache: a
        failure costs a read of the file in a later run, nothing else)."""
        with self.lock:
            new, self.new = self.new, {}
        if not new or self.path is None:
            return
        with contextlib.suppress(OSError, ValueError, TypeError):
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            data: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
            data = dict(list({**data, **{p: list(v) for p, v in new.items()}}.items())
                        [-self._MAX:])
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)


_digests = _Digests()


def _stat(path: str) -> tuple[int, int, int, int, int] | None:
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def _digest_observed(path: str, seen: _inputs.Observed) -> str | None:
    """The digest of ``path`` as this process first read it (None: lost, it changed since)."""
    if seen.digest is not None:
        return seen.digest
    if seen.lost:
        return None
    if seen.identity is None:
        seen.digest = "absent"
        return seen.digest
    if _stat(path) != seen.identity:
        seen.lost = True
        return None
    try:
        seen.digest = _digests.digest(path, seen.identity)
    except OSError:
        seen.lost = True
        return None
    return seen.digest


def _digest_before_change(path: str, seen: _inputs.Observed) -> None:
    with contextlib.suppress(Exception):  # (an audit hook: never raise into the user's call)
        _digest_observed(path, seen)


# -- a snapshot of the inputs ----------------------------------------------------------------
class _Snapshots:
    """The last guard made, reused while nothing new was recorded (most calls of a program
    come after its inputs were read: one guard for all of them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state: tuple[Any, ...] | None = None
        self.guard: Guard | None = None
        self.modules: tuple[int, list[list[str]], str | None] = (-1, [], None)
        self.dists: str | None = None


_snapshots = _Snapshots()


def _state() -> tuple[Any, ...]:
    cfg = get_config()
    return (_inputs.sizes(), len(sys.modules), _cwd(), str(cfg.cache_dir), cfg.store,
            cfg.guard_exclude)


def snapshot() -> Guard:
    """This process's inputs now, as a guard (see the module doc); never raises (an input
    that cannot be read is an item that never matches)."""
    state = _state()
    with _snapshots.lock:
        if _snapshots.state == state and _snapshots.guard is not None:
            return _snapshots.guard
    guard = _make()
    with _snapshots.lock:
        _snapshots.state, _snapshots.guard = state, guard
    return guard


def _make() -> Guard:
    cfg = get_config()
    ignored = _ignored_roots(cfg)
    items: dict[tuple[str, str], list[str]] = {}
    lost: str | None = None
    for path, seen in sorted(_inputs.files().items()):
        if path.startswith(ignored):
            continue
        digest = _digest_observed(path, seen)
        if digest is None:
            lost = lost or f"{path} changed while this process ran"
            continue
        items[(path, FILE)] = [path, FILE, digest, _identity_text(seen.identity)]
    modules, modules_lost = _module_items()
    lost = lost or modules_lost
    for item in modules:
        items.setdefault((item[0], FILE), item)
    for path, listed in sorted(_inputs.listings().items()):
        if not path.startswith(ignored):
            items[(path, DIR)] = [path, DIR, _listing_digest(path, listed, ignored)]
    for name, value in sorted(_inputs.env_reads().items()):
        items[(name, ENV)] = [name, ENV, value_digest(value)]
    names = _inputs.whole_environment()
    if names is not None:
        items[("<environ>", ENV)] = ["<environ>", ENV, value_digest("\0".join(names)), "names"]
    for item in _inputs.merged():
        if item[1] == ENV or not item[0].startswith(ignored):
            items.setdefault((item[0], item[1]), item)
    items[(ARGV, ARGV)] = [ARGV, ARGV, _argv_now()]
    code = _command_code()
    if code is not None:
        items[(CODE, CODE)] = [CODE, CODE, value_digest(code)]
    items[(CWD, CWD)] = [CWD, CWD, value_digest(_cwd())]
    items[(DISTS, DISTS)] = ["<distributions>", DISTS, _distributions()]
    kept = [item for item in items.values() if not _excluded(item, cfg.guard_exclude)]
    kept.sort(key=lambda item: (item[1], item[0]))
    h = xxhash.xxh3_128()
    for item in kept:
        h.update("\0".join(item[:3]).encode("utf-8", "surrogateescape") + b"\n")
    return Guard(kept, h.hexdigest(), lost)


def _ignored_roots(cfg: Any) -> tuple[str, ...]:
    """Folders whose files are kiln's or JAX's caches, never the program's inputs."""
    roots = [str(cfg.cache_dir)]
    if cfg.store and "://" not in cfg.store and cfg.store not in ("local", "memory", "null"):
        roots.append(cfg.store)
    with contextlib.suppress(Exception):
        jax = sys.modules.get("jax")
        where = jax.config.jax_compilation_cache_dir if jax is not None else None
        if isinstance(where, str) and where and "://" not in where:
            roots.append(where)
    return tuple(os.path.abspath(os.path.expanduser(r)) + os.sep for r in roots)


def _module_items() -> tuple[list[list[str]], str | None]:
    """A ``<file>`` item for the source of each user module loaded (cached while
    ``sys.modules`` keeps its size)."""
    count = len(sys.modules)
    if _snapshots.modules[0] == count:
        return _snapshots.modules[1], _snapshots.modules[2]
    out, lost = [], None
    seen = _inputs.files()
    for mod in list(sys.modules.values()):
        file = getattr(mod, "__file__", None) if isinstance(mod, types.ModuleType) else None
        if not isinstance(file, str) or not is_user_file(file):
            continue
        path = _source_of(os.path.abspath(file))
        if path is None or path.startswith(KILN_ROOT):
            continue
        observed = seen.get(path) or _inputs.Observed(_stat(path))
        digest = _digest_observed(path, observed)
        if digest is None:
            lost = lost or f"{path} changed while this process ran"
            continue
        out.append([path, FILE, digest, _identity_text(observed.identity)])
    _snapshots.modules = (count, out, lost)
    return out, lost


def _source_of(path: str) -> str | None:
    """The file a module was loaded from: ``path``, or the zip archive holding it."""
    probe = path
    while probe and probe != os.sep:
        if os.path.isfile(probe):
            return probe
        if os.path.exists(probe):
            return None
        probe = os.path.dirname(probe)
    return None


def _excluded(item: list[str], exclude: tuple[str, ...]) -> bool:
    """Left out by ``guard_exclude`` (a kind, or a glob pattern of paths and variable names)."""
    for rule in exclude:
        kinds = KINDS.get(rule)
        if kinds is not None:
            if item[1] in kinds:
                return True
        elif item[1] in (FILE, DIR, ENV) and fnmatch.fnmatchcase(item[0], rule):
            return True
    return False


def _listing_digest(path: str, names: tuple[str, ...] | None, ignored: tuple[str, ...]) -> str:
    """A folder's names (sorted) as a guard keys them, less what the run wrote or made there
    (at any time: :func:`kiln_early._inputs.made`) and kiln's and JAX's caches (a store made in
    the folder the program lists); ``"absent"``."""
    if names is None:
        return "absent"
    written = _inputs.made()
    h = xxhash.xxh3_128()
    for name in sorted(names):
        full = os.path.join(path, name)
        if full not in written and not (full + os.sep).startswith(ignored):
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


def _argv_now() -> str:
    """The command line's digest, less a ``jax.distributed`` job's coordinator address (its
    host and port, which a launcher picks anew for every job): where the job's processes
    meet is not what they compute, and the key holds the job's topology already."""
    args = [str(a) for a in sys.argv]
    address = _jax_compat.coordinator_address() if "jax" in sys.modules else None
    if address is not None:
        port = address.rpartition(":")[2]
        args = ["<coordinator>" if a in (address, port) or a.endswith(":" + port) else a
                for a in args]
    return value_digest("\0".join(args))


def _command_code() -> str | None:
    """The text of a ``python -c`` program (``sys.orig_argv``), or None."""
    orig = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(orig[1:-1], 1):
        if arg == "-c":
            return orig[i + 1]
        if not arg.startswith("-") or arg in ("-m", "--"):
            return None
    return None


def _cwd() -> str:
    try:
        return os.path.realpath(os.getcwd())
    except OSError:
        return ""


def _distributions() -> str:
    """Every distribution installed on ``sys.path``, once per process: the folders' names and
    each one's ``RECORD`` and entry points (by content; one without a ``RECORD`` by its
    ``PKG-INFO`` or ``METADATA`` too), and the ``.pth`` and ``.egg-link`` files beside them."""
    if _snapshots.dists is not None:
        return _snapshots.dists
    h = xxhash.xxh3_128()
    stdlib = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()[k]
                                                for k in ("stdlib", "platstdlib")})
    for root in dict.fromkeys(os.path.abspath(p or ".") for p in sys.path):
        if os.path.realpath(root) in stdlib:
            continue  # (no distribution is installed there)
        try:
            names = sorted(os.listdir(root))
        except OSError:
            continue
        for name in names:
            full = os.path.join(root, name)
            if name.endswith((".dist-info", ".egg-info")):
                files = [os.path.join(full, n) for n in ("RECORD", "entry_points.txt",
                                                          "PKG-INFO", "METADATA")]
                files = files[:2] if os.path.isfile(files[0]) else files[1:]
            elif name.endswith((".pth", ".egg-link")):
                files = [full]
            else:
                continue
            h.update(full.encode("utf-8", "surrogateescape") + b"\0")
            for file in files:
                identity = _stat(file)
                if identity is None:
                    continue
                with contextlib.suppress(OSError):
                    h.update(_digests.digest(file, identity).encode())
    _snapshots.dists = h.hexdigest()
    return _snapshots.dists


# -- checking a stored guard -----------------------------------------------------------------
def check(items: Any) -> str | None:
    """None when every item of a stored guard holds in this process (see the module doc), else
    what changed (``"coeffs.txt changed"``): the first item that does not hold."""
    if not isinstance(items, list):
        return "the entry holds no guard"
    cfg = get_config()
    files, listings = _inputs.files(), _inputs.listings()
    traced = {(m[0], m[1]): m for m in _inputs.merged()}  # what this process's traces read
    env_reads = _inputs.env_reads()
    for item in items:
        if not isinstance(item, list) or len(item) < 3 or not all(isinstance(p, str)
                                                                 for p in item):
            return "the entry's guard is malformed"
        if _excluded(item, cfg.guard_exclude):
            continue
        name, kind, digest = item[0], item[1], item[2]
        seen = traced.get((name, kind))
        first = files if kind == FILE else listings if kind == DIR else env_reads
        if seen is not None and seen[3:4] == item[3:4] and name not in first:
            # read by a trace here (or by the trace of an entry loaded here), as it read it
            if seen[2] == digest:
                continue
            return f"{'environment variable ' if kind == ENV else ''}{name} changed"
        try:
            changed = _changed(name, kind, digest, item, files, listings)
        except Exception as e:  # noqa: BLE001 - an input that cannot be read has changed
            changed = f"{name} cannot be read ({type(e).__name__})"
        if changed is not None:
            return changed
    return None


def _changed(name: str, kind: str, digest: str, item: list[str],
             files: dict[str, _inputs.Observed],
             listings: dict[str, tuple[str, ...] | None]) -> str | None:
    if kind == FILE:
        identity = item[3] if len(item) > 3 else ""
        seen = files.get(name)
        if seen is not None:
            if identity and identity == _identity_text(seen.identity):
                return None
            now = _digest_observed(name, seen)
        else:
            st = _stat(name)
            if st is None:
                now = "absent"
            elif identity and identity == _identity_text(st):
                return None
            else:
                now = _digests.digest(name, st)
        return None if now == digest else f"{name} changed"
    if kind == DIR:
        ignored = _ignored_roots(get_config())
        if name in listings:
            now = _listing_digest(name, listings[name], ignored)
        else:
            try:
                names: tuple[str, ...] | None = tuple(os.listdir(name))
            except OSError:
                names = None
            now = _listing_digest(name, names, ignored)
        return None if now == digest else f"the listing of {name} changed"
    if kind == ENV:
        if len(item) > 3 and item[3] == "names":  # the names user code iterated
            variables = _inputs.whole_environment()
            if variables is None:
                variables = [name for name, _ in _inputs.environment()]
            return (None if value_digest("\0".join(variables)) == digest
                    else "the environment's variables changed")
        if len(item) > 3:  # a trace's whole environment: names and values, kiln's too
            return check_env(name, digest, True)
        reads = _inputs.env_reads()
        value = reads[name] if name in reads else _inputs.environ_value(name)
        return (None if value_digest(value) == digest
                else f"environment variable {name} changed")
    if kind == ARGV:
        return None if _argv_now() == digest else "the command line changed"
    if kind == CODE:
        return None if value_digest(_command_code()) == digest else "the -c program changed"
    if kind == CWD:
        return None if value_digest(_cwd()) == digest else "the working folder changed"
    if kind == DISTS:
        return (None if _distributions() == digest
                else "the installed distributions changed")
    return f"an input of unknown kind {kind!r}"


# a file read and not yet digested is digested before the process overwrites it
_inputs.set_overwrite_hook(_digest_before_change)
