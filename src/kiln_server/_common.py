"""What the client, the server and ``kiln server`` share: settings, the per-user folder of
sockets, the server's key, the record of a program's imports, and the messages on the socket.
Standard library only (the client must start in milliseconds, without kiln or jax)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import sys
from typing import Any

__all__ = ["Target", "exit_status", "explain", "key_of", "read_meta", "read_record",
           "record_path", "remove_lock", "sandbox", "send", "server_dir", "setting", "take_lock",
           "write_json", "write_record"]

# KILN_SERVER* variables steer the client only; every other variable is part of the key
_OWN_PREFIX = "KILN_SERVER"
_FALSE = ("0", "false", "no", "off", "")


def exit_status(status: int) -> int:
    """``status`` as the process should exit with it: a negative one is a death by that signal
    (``-SIGINT``: the program raised ``KeyboardInterrupt`` that nothing caught, its traceback
    already shown), which Python itself carries out: a ``KeyboardInterrupt`` raised out of the
    main module, seen by a silent ``sys.excepthook``, makes Python finish as it always does
    (threads joined, ``atexit`` handlers run) and then end by SIGINT, as ``python prog.py``
    does. Another negative status ends the process by that signal now."""
    if status >= 0:
        return status
    import signal

    if -status == signal.SIGINT:
        sys.excepthook = lambda *exc: None
        raise KeyboardInterrupt
    sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return 128 - status


def setting(name: str, default: float) -> float:
    """``KILN_SERVER_<name>`` as a number, or ``default`` where unset or not a number."""
    raw = os.environ.get(f"KILN_SERVER_{name}", "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        return default


def enabled_by_env() -> bool:
    """``KILN_SERVER`` set to a true value (1, true, yes, on)."""
    return os.environ.get("KILN_SERVER", "").strip().lower() not in _FALSE


def explain(message: str) -> None:
    """One line on stderr under ``KILN_EXPLAIN`` (the client's reason to fall back, the
    server's choices); nothing otherwise."""
    if os.environ.get("KILN_EXPLAIN", "").strip().lower() not in _FALSE:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"kiln: server: {message}\n")
            sys.stderr.flush()


def cache_dir(cli_cache_dir: str | None = None) -> str:
    """The store's folder (``--cache-dir``, ``KILN_CACHE_DIR`` or the user cache): records of
    imports and the servers' logs live under ``<it>/server``."""
    if cli_cache_dir:
        return os.path.abspath(os.path.expanduser(cli_cache_dir))
    import kiln_early

    return kiln_early._cache_dir()


def server_dir() -> str:
    """The per-user folder of the servers' sockets, locks and descriptions: ``KILN_SERVER_DIR``,
    else ``$XDG_RUNTIME_DIR/kiln-server``, else ``/tmp/kiln-server-<uid>``. Made with mode 0700;
    raises :class:`OSError` where it is a link, another user's, or open to others (a socket
    there could be someone else's)."""
    where = os.environ.get("KILN_SERVER_DIR", "").strip()
    if not where:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "").strip()
        if runtime and os.path.isdir(runtime):
            where = os.path.join(runtime, "kiln-server")
        else:
            where = os.path.join("/tmp", f"kiln-server-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(where, 0o700)
    info = os.lstat(where)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{where} is not a folder")
    if info.st_uid != os.getuid():
        raise OSError(f"{where} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        raise OSError(f"{where} is open to other users (mode {info.st_mode & 0o777:o}); "
                      "make it 0700")
    return where


class Target:
    """What a ``kiln run`` runs: a script (by real path) or ``-m module`` (with the working
    folder, Python's ``sys.path[0]`` then); ``own_dir`` is the folder whose modules are the
    program's own (never preloaded)."""

    def __init__(self, argv: list[str], options: int, script: str | None, module: str | None,
                 cli_cache_dir: str | None) -> None:
        self.argv = argv  # kiln's own arguments, ``--server`` removed
        self.options = argv[:options]  # kiln's options up to the script (in the key)
        self.script = script
        self.module = module
        self.cli_cache_dir = cli_cache_dir
        cwd = os.getcwd()
        if script is not None:
            self.ident = "script\0" + os.path.realpath(script)
            self.own_dir = os.path.dirname(os.path.realpath(script))
        else:
            self.ident = f"module\0{module}\0{cwd}"
            self.own_dir = os.path.realpath(cwd)
        # what the client started with (a plain run's script may change them before the
        # server is spawned at its end)
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.cwd = cwd
        self.sandbox = sandbox()

    def describe(self) -> str:
        return self.script if self.script is not None else f"-m {self.module}"


def record_path(target: Target) -> str:
    """The file that lists the modules the program's last runs imported."""
    digest = hashlib.sha256(target.ident.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(cache_dir(target.cli_cache_dir), "server", "records", digest + ".json")


def read_record(target: Target) -> list[str] | None:
    """The recorded module names, in the order they were first imported; None if none."""
    modules = (read_meta(record_path(target)) or {}).get("modules")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        return None
    return modules


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a reader sees the old file or the new one,
    never half of it), readable by this user only: records, descriptions, specs."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
              encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def write_record(target: Target, modules: list[str]) -> None:
    """Write the record of ``target``'s imports (:func:`write_json`)."""
    path = record_path(target)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_json(path, {"target": target.describe(), "modules": modules})


def interpreter_flags() -> list[str]:
    """The command-line flags of this interpreter (``-O``, ``-W ...``, ``-X ...``), to start a
    server with the same ones (they are in its key)."""
    import subprocess

    return subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined,no-any-return]


def _interpreter() -> list[Any]:
    real = os.path.realpath(sys.executable)
    info = os.stat(real)
    return [sys.executable, real, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]


def _kiln_version() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(here, "kiln", "_base", "_version.py"), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return "?"


def sandbox() -> dict[str, Any]:
    """What the command's process runs in that a fork of the server cannot take from it: its
    resource limits (``ulimit``), niceness, CPU affinity (``taskset``), namespaces (``unshare``:
    the network one above all), cgroup, and groups. Part of the server's key: a run inside
    another sandbox is served by a server started inside that one, or is a plain run."""
    import resource

    state: dict[str, Any] = {
        "limits": sorted((name, resource.getrlimit(getattr(resource, name)))
                         for name in dir(resource) if name.startswith("RLIMIT_")),
        "groups": [os.getgid(), os.getegid(), sorted(os.getgroups())],
    }
    with contextlib.suppress(OSError):
        state["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(AttributeError, OSError):
        state["affinity"] = sorted(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        state["namespaces"] = sorted((name, os.readlink(f"/proc/self/ns/{name}"))
                                     for name in os.listdir("/proc/self/ns"))
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        state["cgroup"] = f.read()
    return state


def key_of(target: Target, modules: list[str]) -> str:
    """The server's key: the interpreter (path and file identity), its flags, ``sys.path``, the
    working folder (a module may keep it when imported: ``multiprocessing`` does), the whole
    environment but ``KILN_SERVER*``, kiln's version, kiln's options before the script
    (``--no-jit``, ``--store``: the server turns on what they say before it imports), the
    modules to preload, and the command's :func:`sandbox`. Two runs share a server only where
    all of it is equal."""
    env = sorted((k, v) for k, v in target.environ.items() if not k.startswith(_OWN_PREFIX))
    parts = {
        "interpreter": _interpreter(),
        "flags": [repr(sys.flags), list(sys.warnoptions), sorted(sys._xoptions.items())],
        "path": target.path,
        "cwd": target.cwd,
        "environ": env,
        "kiln": _kiln_version(),
        "options": target.options,
        "modules": modules,
        "sandbox": target.sandbox,
    }
    blob = json.dumps(parts, sort_keys=True, default=repr).encode("utf-8", "surrogateescape")
    return hashlib.sha256(blob).hexdigest()


def files_of(key: str, where: str | None = None) -> dict[str, str]:
    """The socket, lock and description files of the server with ``key``."""
    base = os.path.join(where or server_dir(), key[:20])
    return {"sock": base + ".sock", "lock": base + ".lock", "meta": base + ".json"}


def take_lock(path: str) -> int | None:
    """A descriptor of the lock file ``path`` (made if absent) holding its exclusive lock; None
    where another process holds it. Only a holder unlinks a lock file (:func:`remove_lock`, a
    server as it ends), so a lock taken on a file unlinked meanwhile is let go and the file now
    at ``path`` tried instead."""
    for _ in range(8):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except BlockingIOError:
            os.close(fd)
            return None
        except FileNotFoundError:
            pass
        os.close(fd)
    return None


def remove_lock(path: str) -> None:
    """Unlink the lock file ``path`` if no process holds it (its server was killed)."""
    fd = take_lock(path) if os.path.exists(path) else None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def read_meta(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path`` (a description, a record); None if there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def send(conn: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message: a line of JSON (with file descriptors alongside, SCM_RIGHTS)."""
    data = (json.dumps(message) + "\n").encode("utf-8", "surrogateescape")
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


class Reader:
    """Lines of JSON from a socket, with the file descriptors that came with them."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.fds: list[int] = []

    def next(self) -> dict[str, Any] | None:
        """The next message; None at the end of the stream."""
        while b"\n" not in self.buffer:
            data, fds, _flags, _addr = socket.recv_fds(self.conn, 1 << 16, 8)
            self.fds.extend(fds)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line.decode("utf-8", "surrogateescape"))
        if not isinstance(message, dict):
            raise ValueError("not a message")
        return message
