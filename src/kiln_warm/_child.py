"""A run in a child of the server: take over the client's stdin, stdout and stderr, working
folder, umask, environment and arguments; make anew what a fresh process makes anew and a fork
copies; run ``kiln run`` as a plain run does; say the status to the client."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import signal
import socket
import sys
from typing import Any

from kiln_server._common import exit_status, send, write_json

__all__ = ["run_child"]


def run_child(job: dict[str, Any]) -> int:
    """The exit status of the run ``job`` describes (the server's child, after the fork)."""
    conn, request, fds = job["conn"], job["request"], job["fds"]
    go = os.read(job["go"], 1)
    os.close(job["go"])
    if go != b"g":  # the client gave up before the hand-over and runs the program itself
        os._exit(0)
    conn = _place(conn, fds, list(request["numbers"]))
    for signum in request.get("ignored", ()):
        signal.signal(signum, signal.SIG_IGN)
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["environ"])
    sys.argv = list(request["sys_argv"])
    sys.orig_argv = list(request["orig_argv"])
    sys.path[:] = request["path"]
    _reopen_stdio()
    _make_anew()
    from kiln._cli import main

    status = main(list(request["argv"]))
    with contextlib.suppress(OSError):
        send(conn, {"code": status})
    _update_record(request, set(job["preloaded"]))
    return exit_status(status)


def _place(conn: socket.socket, fds: list[int], numbers: list[int]) -> socket.socket:
    """Put each descriptor the client passed at the number it has there (``fds[i]`` becomes
    ``numbers[i]``, inheritable, as a plain run inherits it), moving this child's own
    (the connection to the client) out of their way first; the connection, moved. Every
    descriptor made on the way is the lowest free one that is no number to fill, so all of
    them fit under the open-files limit the run has (a server's is the command's: its key)."""
    avoid = set(numbers)
    moved = socket.socket(fileno=_dup_away(conn.fileno(), avoid))
    os.close(conn.detach())
    temps = [_dup_away(fd, avoid) for fd in fds]
    for fd in fds:
        os.close(fd)
    for temp, number in zip(temps, numbers, strict=True):
        os.dup2(temp, number, inheritable=True)
        os.close(temp)
    return moved


def _dup_away(fd: int, avoid: set[int]) -> int:
    """A close-on-exec copy of ``fd`` at the lowest free number not in ``avoid``."""
    held: list[int] = []
    try:
        while True:
            new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
            if new not in avoid:
                return new
            held.append(new)  # (a number to fill: kept open until a free one is found)
    finally:
        for number in held:
            os.close(number)


def _reopen_stdio() -> None:
    """``sys.stdin``/``stdout``/``stderr`` for the client's descriptors, made as Python makes
    them at start (``create_stdio`` in CPython's pylifecycle.c): line-buffered where a terminal
    (stderr always), write-through under ``-u``, the encoding and errors the server's have
    (the same environment and flags made them)."""
    buffered = not getattr(sys.stdout, "write_through", False)  # -u, PYTHONUNBUFFERED
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or "strict"
        tty = os.isatty(fd)
        binary: Any = open(fd, "rb" if fd == 0 else "wb",  # noqa: SIM115 - sys's own
                              -1 if buffered or fd == 0 else 0, closefd=False)
        raw = binary.raw if hasattr(binary, "raw") else binary
        raw.name = f"<{name}>"
        line_buffering = buffered and fd != 0 and (tty or fd == 2)
        stream = io.TextIOWrapper(binary, encoding=encoding, errors=errors, newline="\n",
                                  line_buffering=line_buffering, write_through=not buffered)
        stream.mode = "r" if fd == 0 else "w"  # type: ignore[misc]
        with contextlib.suppress(OSError, ValueError):
            old.flush()
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _make_anew() -> None:
    """What a fresh process makes anew at start or import and a fork copies."""
    faulthandler = sys.modules.get("faulthandler")
    if faulthandler is not None and faulthandler.is_enabled():
        # -X faulthandler: to the client's stderr
        faulthandler.enable(file=sys.stderr, all_threads=True)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        # numpy seeds its global generator from the OS when imported: an unseeded program
        # must not repeat its numbers run after run
        numpy_random.seed()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        # a fresh process draws its own authentication key at import
        process.current_process().authkey = os.urandom(32)
    # Python's random reseeds itself after a fork (os.register_at_fork); the hash seed of str
    # and bytes cannot change in a running process: a child keeps its server's (see the docs)


def _update_record(request: dict[str, Any], preloaded: set[str]) -> None:
    """The program imported modules its record does not list: add them (the next plain run
    starts a server that preloads them too). Never raises."""
    with contextlib.suppress(Exception):  # a record is a hint
        from kiln_server import imported_modules

        path = request["record"]
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        old = list(data["modules"])
        seen = set(old) | preloaded
        new = imported_modules(request["own_dir"], request["path"], seen)
        if not new:
            return
        data["modules"] = old + new
        write_json(path, data)
