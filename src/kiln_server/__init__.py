"""``kiln run --server`` (``KILN_SERVER=1``): the second run of an unchanged program starts in a
process that has already imported what the program imports, so it skips Python's imports as a
warm start skips tracing, lowering and compiling.

A per-user server holds a process that imported the modules the program's previous run imported
from outside the program's own folder, and never started a JAX backend (no device, no XLA
thread). Each run forks a child of it that takes this client's stdin, stdout and stderr (passed
as file descriptors over a Unix socket in a 0700 folder; the server answers only its own user,
``SO_PEERCRED``), its working folder, arguments, umask and environment, and runs ``kiln run``
there exactly as a plain run would; this client forwards signals to it and exits with its
status. The tools that did this for other languages: Rails' Spring, the Gradle daemon, Nailgun
(JVM), the Bazel server.

- The first run is a plain ``kiln run``; at its end it records the modules the run imported
  (``<store folder>/server/records``) and starts a server in the background.
- A server belongs to one key (:func:`kiln_server._common.key_of`): interpreter, flags,
  ``sys.path``, the whole environment, kiln's version and the modules it preloads. Before each
  fork it checks that no preloaded module's file, no ``sys.path`` folder (its listing, ``.pth``
  files, installed distributions) and nothing in the program's folder that would shadow a
  preloaded module changed; on any change it ends, and the run is a plain one.
- Anything that fails or takes longer than ``KILN_SERVER_TIMEOUT`` seconds (default 0.05)
  before the hand-over makes this run a plain one, with the reason under ``KILN_EXPLAIN``.

This package imports only the standard library (the client starts in milliseconds); the server
is :mod:`kiln_warm._serve` (a package above kiln: it imports and runs kiln's command line),
the child's set-up :mod:`kiln_warm._child`; this package stands below kiln (``kiln server
ls|stop`` use it). Documented in docs/reference.md, "The warm process".
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from kiln_early import _inputs

from ._common import (
    Reader,
    Target,
    enabled_by_env,
    exit_status,
    explain,
    files_of,
    interpreter_flags,
    key_of,
    read_meta,
    read_record,
    record_path,
    remove_lock,
    send,
    server_dir,
    setting,
    write_json,
    write_record,
)

__all__ = ["after_run", "command_line", "run_warm", "target_of"]

# kiln's options before the verb and after ``run`` that take a value
_VALUED = ("--cache-dir", "--store")
_RUN_FLAGS = ("--explain", "--verify", "--jit", "--no-jit")
# the signals a terminal or a supervisor sends that the client hands to the child
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")


def command_line(load: Callable[[], Callable[[list[str] | None], int]]) -> int:
    """The ``kiln`` command line on ``sys.argv[1:]`` (``kiln_cli``, ``python -m kiln``): a
    ``kiln run`` that asks for the server is first offered to the program's warm process;
    otherwise, or where none takes it, ``load()`` gives kiln's own ``main`` (imported only
    then), and a plain run that asked for the server records its imports and starts one."""
    target = target_of(sys.argv[1:])
    if target is not None:
        status = run_warm(target)
        if status is not None:
            return exit_status(status)
    status = load()(target.argv[:] if target is not None else None)
    if target is not None:
        after_run(target)
    return exit_status(status)


def target_of(argv: list[str]) -> Target | None:
    """The program of a ``kiln run`` command line that asks for the server (``--server``, or
    ``KILN_SERVER=1`` without ``--no-server``), with ``argv`` less those flags; None for any
    other command line (``kiln`` then parses it as always)."""
    i, cache_dir, out = 0, None, []
    wanted: bool | None = None  # (None until the verb "run")
    while i < len(argv):
        word = argv[i]
        name, eq, value = word.partition("=")
        if wanted is None and word == "run":
            wanted = enabled_by_env()
            out.append(word)
            i += 1
        elif name in _VALUED:
            step = 1 if eq else 2
            if i + step > len(argv):
                return None
            if name == "--cache-dir":
                cache_dir = value if eq else argv[i + 1]
            out.extend(argv[i:i + step])
            i += step
        elif wanted is None:
            return None  # another verb, or an option kiln_server does not know
        elif word in ("--server", "--no-server"):
            wanted = word == "--server"
            i += 1
        elif word in _RUN_FLAGS:
            out.append(word)
            i += 1
        else:
            break
    if not wanted or i >= len(argv):
        return None
    rest = argv[i:]
    if rest[0] == "-m":
        if len(rest) < 2:
            return None
        return Target(out + rest, len(out), None, rest[1], cache_dir)
    if rest[0].startswith("-") or not os.path.isfile(rest[0]):
        return None  # --help, an unknown option, no such file: kiln's parser says so
    return Target(out + rest, len(out), rest[0], None, cache_dir)


def run_warm(target: Target) -> int | None:
    """Run ``target`` in a child of its server; its exit status, or None where no server can
    take it (no record yet, no server, a stale one, a fault, past the deadline): the caller
    then runs it as a plain ``kiln run``."""
    deadline = time.monotonic() + setting("TIMEOUT", 0.05)
    inherited = _inherited()
    if inherited is None:
        explain("stdin, stdout or stderr is closed: a plain run (it says what it says)")
        return None
    modules = read_record(target)
    if modules is None:
        explain("no record of this program's imports yet: a plain run, which records them "
                "and starts a server")
        return None
    conn: socket.socket | None = None
    try:
        key = key_of(target, modules)
        files = files_of(key)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            conn.connect(files["sock"])
        except (FileNotFoundError, ConnectionRefusedError):
            explain(f"no server for this program yet (key {key[:12]}): a plain run, which "
                    "starts one")
            return None
        send(conn, _request(target, key))
        reader = Reader(conn)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        ready = reader.next()
        if ready is None or not ready.get("ready"):
            why = (ready or {}).get("why", "the server closed the connection")
            explain(f"{why}: a plain run")
            return None
        # (stdin, stdout, stderr and every other descriptor a plain run inherits, only to a
        # server that answered: see _serve)
        send(conn, {"op": "stdio", "numbers": inherited}, fds=inherited)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        reply = reader.next()
        if reply is None or "pid" not in reply:
            why = (reply or {}).get("why", "the server closed the connection")
            explain(f"{why}: a plain run")
            return None
        # (signals are forwarded from before the child may start: one sent in between reaches
        # the program as in a plain run, not a client that would die of it)
        previous = _forward_signals(int(reply["pid"]))
        try:
            send(conn, {"op": "go"})
        except OSError:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            raise
    except (OSError, ValueError) as e:
        explain(f"{type(e).__name__}: {e}: a plain run")
        if conn is not None:
            conn.close()
        return None
    explain(f"run by the warm process {reply['pid']} ({reply.get('preloaded', '?')} modules "
            "preloaded)")
    for name, why in (reply.get("not_preloaded") or {}).items():
        explain(f"not preloaded: {name} ({why}); this run imports it and what follows it")
    return _wait(conn, reader, int(reply["pid"]))


def _inherited() -> list[int] | None:
    """The descriptors a plain run would have: 0, 1, 2 and every other inheritable one this
    process was given (a ``3>file`` of the shell, a pipe of a parent); None if 0, 1 or 2 is
    closed (a plain run then has ``sys.stdin`` None, which a server's child cannot give)."""
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
        others = sorted(int(n) for n in os.listdir("/proc/self/fd") if int(n) > 2)
    except (OSError, ValueError):
        return None
    extra = []
    for fd in others:
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed by now)
            if os.get_inheritable(fd):
                extra.append(fd)
    return [0, 1, 2, *extra[:200]]


def _ignored() -> list[int]:
    """The signals this process was started with ignored (``nohup``, a shell's background
    job): a plain run keeps them ignored, so the child does, and the client forwards none."""
    signums = [getattr(signal, name) for name in (*_FORWARDED, "SIGTSTP")]
    return [int(signum) for signum in signums if signal.getsignal(signum) == signal.SIG_IGN]


def _request(target: Target, key: str) -> dict[str, Any]:
    umask = os.umask(0)
    os.umask(umask)
    return {"op": "run", "key": key, "argv": target.argv, "sys_argv": sys.argv,
            "orig_argv": getattr(sys, "orig_argv", sys.argv), "cwd": os.getcwd(),
            "umask": umask, "environ": target.environ, "path": target.path,
            "own_dir": target.own_dir, "record": record_path(target), "client": os.getpid(),
            "ignored": _ignored()}


def _forward_signals(child: int) -> dict[int, Any]:
    """Forward the signals a plain run would get to ``child`` (Ctrl-Z stops it, SIGCONT
    resumes it); the handlers they replace, by signal."""

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, signum)

    def stop(signum: int, frame: Any) -> None:  # Ctrl-Z: the child stops with the client
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, stop)

    ignored = set(_ignored())
    handlers: dict[int, Any] = {getattr(signal, name): forward for name in _FORWARDED}
    handlers[signal.SIGTSTP] = stop
    handlers = {signum: h for signum, h in handlers.items() if signum not in ignored}
    handlers[signal.SIGCONT] = forward  # (SIGCONT resumes the child too)
    return {signum: signal.signal(signum, h) for signum, h in handlers.items()}


def _wait(conn: socket.socket, reader: Reader, child: int) -> int:
    """Wait until the server says how ``child`` ended (its signals forwarded since before it
    started: :func:`_forward_signals`); that status, or minus the signal that ended it."""
    conn.settimeout(None)
    code: int | None = None
    while True:
        try:
            message = reader.next()
        except (OSError, ValueError):
            message = None
        if message is None:
            break
        if "code" in message:
            code = int(message["code"])  # the child's own word, before Python's exit
        if message.get("status") == "exit":
            return int(message["code"])
        if message.get("status") == "signal":
            return -int(message["signal"])  # (ended by that signal: exit_status)
    if code is not None:
        return code
    sys.stderr.write(f"kiln: the warm process server ended during this run; the exit status "
                     f"of the program (pid {child}) is unknown\n")
    return 1


def after_run(target: Target) -> None:
    """At the end of a plain ``kiln run`` that asked for the server: record what it imported
    and start its server in the background (a few milliseconds here; the server imports in its
    own process). Never raises."""
    try:
        _after_run(target)
    except Exception as e:  # noqa: BLE001 - a warm process is a cache: never fail a run
        explain(f"could not start a server: {type(e).__name__}: {e}")


def _namespaces_of_its_own() -> list[str]:
    """The namespaces this process is in that its parent is not (``unshare`` made them for
    this command)."""
    own = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/proc/self/ns")):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/ns/{name}") != os.readlink(
                        f"/proc/{os.getppid()}/ns/{name}"):
                    own.append(name)
    return own


def imported_modules(own_dir: str, path: list[str],
                     known: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The modules in ``sys.modules`` that can be preloaded: importable by name, not from
    ``own_dir`` (the program's own, which change as it is edited), in import order, up to the
    first that the program could have changed: one imported after the program first set or
    removed an environment variable (it may have read it), or one that ``path`` (the
    ``sys.path`` the server imports with) would find elsewhere than this run did (the program
    put its working copy first on ``sys.path``: a server would import the installed one).
    ``known``: modules the record holds already, neither checked again nor returned."""
    own = {own_dir.rstrip(os.sep) + os.sep, os.path.realpath(own_dir).rstrip(os.sep) + os.sep}
    names = []
    before = _inputs.modules_before_env_write()
    for name, module in list(sys.modules.items()):
        if name in known or module is None or name in ("__main__", "__mp_main__"):
            continue
        if name.startswith(("kiln_server", "kiln_warm", "kiln_cli", "kiln_jax_plugin")):
            continue  # kiln's own: the server's, or imported when a backend starts (each run)
        if getattr(module, "__name__", None) != name or getattr(module, "__spec__", None) is None:
            continue  # an alias (os.path) or a module made by hand: not importable by name
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and any(file.startswith(p) for p in own):
            continue
        if (before is not None and name not in before) or (
                "." not in name and isinstance(file, str) and module.__spec__.origin == file
                and _found_elsewhere(name, file, path)):
            break  # (this one and those after it: each run imports them, as the program does)
        names.append(name)
    return names


def _found_elsewhere(name: str, file: str, path: list[str]) -> bool:
    """Whether top-level module ``name``, imported from ``file``, is found elsewhere (or not at
    all) by the import system with ``sys.path`` set to ``path``. Never raises."""
    saved = sys.path[:]
    try:
        sys.path[:] = path
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, None) if find is not None else None
            if spec is not None:
                origin = spec.origin
                return not isinstance(origin, str) or (
                    os.path.realpath(origin) != os.path.realpath(file))
        return True
    except Exception:  # noqa: BLE001 - cannot tell: not preloaded
        return True
    finally:
        sys.path[:] = saved


def _after_run(target: Target) -> None:
    import subprocess

    start = time.perf_counter()
    old = read_record(target) or []
    seen = set(old)
    modules = old + imported_modules(target.own_dir, target.path, seen)
    if modules != old:
        write_record(target, modules)
    own = _namespaces_of_its_own()
    if own:
        # (unshare -n kiln run ...: a namespace made for this command alone, which a server
        # would keep alive, unused: the next such command makes another one)
        explain(f"the command runs in namespaces of its own ({', '.join(own)}): no server")
        return
    key = key_of(target, modules)
    where = server_dir()
    files = files_of(key, where)
    meta = read_meta(files["meta"])
    if meta is not None and _alive(int(meta.get("pid", 0))):
        return
    logs = os.path.join(os.path.dirname(os.path.dirname(record_path(target))), "logs")
    os.makedirs(logs, mode=0o700, exist_ok=True)
    spec = {"key": key, "modules": modules, "argv": target.argv, "path": target.path,
            "client": os.getpid(),
            "own_dir": target.own_dir, "sandbox": target.sandbox,
            "target": target.describe(), "record": record_path(target), "dir": where,
            "idle": setting("IDLE", 900.0), "max": int(setting("MAX", 4))}
    spec_path = os.path.join(where, f"{key[:20]}.{os.getpid()}.spec")
    write_json(spec_path, spec)
    with open(os.path.join(logs, key[:20] + ".log"), "ab") as log:
        subprocess.Popen(
            [sys.executable, *interpreter_flags(), "-c",
             "import kiln_warm._serve as s; s.main()", spec_path],
            env=target.environ, cwd=target.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True)
    explain(f"started a server for this program (key {key[:12]}, {len(modules)} modules; "
            f"{(time.perf_counter() - start) * 1e3:.1f} ms of this run)")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_servers() -> list[dict[str, Any]]:
    """The live servers of this user (their descriptions); stale files of dead ones are
    removed (a lock file only where no process holds it: a server starting holds it before
    it describes itself)."""
    where = server_dir()
    found = []
    names = sorted(os.listdir(where))
    for name in names:
        if name.endswith(".lock") and name[:-5] + ".json" not in names:
            remove_lock(os.path.join(where, name))
        if not name.endswith(".json"):
            continue
        meta = read_meta(os.path.join(where, name))
        if meta is None or not _alive(int(meta.get("pid", 0))):
            for ext in (".json", ".sock"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(where, name[:-5] + ext))
            remove_lock(os.path.join(where, name[:-5] + ".lock"))
            continue
        found.append(meta)
    return found


def stop_server(meta: dict[str, Any], wait_s: float = 5.0) -> bool:
    """Ask the server of ``meta`` to end (after the runs it is serving); SIGTERM if it does not
    answer. True once it is gone."""
    pid = int(meta.get("pid", 0))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(meta["sock"])
            send(conn, {"op": "stop"})
            Reader(conn).next()
    except (OSError, ValueError, KeyError):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)
