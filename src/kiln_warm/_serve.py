"""The warm process server: preloads a program's imports, checks before each run that none of
them changed, forks a child per run and reports how it ended. Started by
:func:`kiln_server.after_run` as ``python -c "import kiln_warm._serve as s; s.main()" SPEC``.

One process, one thread: a select loop over the listening socket, a pipe that SIGCHLD wakes,
and the connections of the running children (to see a client vanish: its child is then killed
as the client was). Never starts a JAX backend and never holds a thread when it forks
(``os.fork`` copies only the calling thread; JAX's backend holds many)."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from kiln_server._common import Reader, files_of, sandbox, send, take_lock, write_json

__all__ = ["main"]

# how long a connection may stay silent before its first message, or between the parts of one
_SILENT_S = 2.0


def _log(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()}] {message}\n")
    sys.stderr.flush()


def main() -> None:
    """Serve the spec in ``sys.argv[1]`` until idle, stopped, or stale."""
    spec_path = sys.argv[1]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    with contextlib.suppress(OSError):
        os.unlink(spec_path)
    sys.path[:] = spec["path"]
    sys.argv = ["kiln"]
    if json.loads(json.dumps(sandbox())) != spec.get("sandbox"):
        # (the run that started it changed its limits, niceness or affinity: this process is
        # not in the sandbox its key names)
        _log("not in the sandbox of the command that started it: leaving")
        return
    files = files_of(spec["key"], spec["dir"])
    lock = take_lock(files["lock"])
    if lock is None:
        _log("another server holds this key: leaving")
        return
    server = Server(spec, files, lock)
    job = server.run()
    if job is not None:  # in a child: the stack of the loop is gone; run the program
        from ._child import run_child

        sys.exit(run_child(job))


class Server:
    def __init__(self, spec: dict[str, Any], files: dict[str, str], lock: int) -> None:
        self.spec = spec
        self.files = files
        self.lock = lock
        self.key = spec["key"]
        self.children: dict[int, socket.socket] = {}
        # connections accepted whose first message has not come yet -> when they are dropped
        self.pending: dict[socket.socket, float] = {}
        self.stopping = False
        self.in_child = False  # (this process is a run's child, after the fork)
        self.last_used = time.time()
        self.started = time.time()

    # -- start -------------------------------------------------------------------------------

    def run(self) -> Any:
        from ._fresh import Snapshot
        from ._preload import preload

        self.pid = os.getpid()
        self.preloaded, self.unsafe = [], {}
        self._describe("starting")  # listed (and stoppable: SIGTERM) while it imports
        _after(int(self.spec.get("client", 0)))
        before = set(sys.modules)
        self.preloaded, self.unsafe = preload(self.spec)
        if self.unsafe:
            _log(f"not preloaded (imported by each run instead): {self.unsafe}")
        new = [m for m in sys.modules if m not in before]
        self.snapshot = Snapshot(new, self.started)
        why = self.snapshot.stale() or _unsafe_now()
        if why:
            _log(f"not serving: {why}")
            self._remove()
            return None
        self.listener = self._listen()
        self._describe("serving")
        _log(f"serving {self.spec['target']} ({len(self.preloaded)} modules preloaded) on "
             f"{self.files['sock']}")
        self._cap()
        try:
            return self._loop()
        finally:
            if os.getpid() == self.pid:
                self._remove()

    def _listen(self) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.files["sock"])
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(self.files["sock"])
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        return listener

    def _describe(self, state: str) -> None:
        self.meta = {"pid": os.getpid(), "state": state, "key": self.key,
                     "target": self.spec["target"], "sock": self.files["sock"],
                     "preloaded": len(self.preloaded), "not_preloaded": self.unsafe,
                     "started": self.started, "last_used": self.last_used,
                     "idle": self.spec["idle"], "runs": 0, "python": sys.executable}
        write_json(self.files["meta"], self.meta)

    def _remove(self) -> None:
        for name in ("sock", "meta", "lock"):  # the lock last, while this server holds it
            with contextlib.suppress(OSError):
                os.unlink(self.files[name])

    def _cap(self) -> None:
        """Past ``KILN_SERVER_MAX`` servers for this user, stop the least recently used."""
        from kiln_server import list_servers, stop_server

        others = [m for m in list_servers() if m.get("pid") != os.getpid()]
        excess = len(others) + 1 - max(int(self.spec["max"]), 1)
        for meta in sorted(others, key=lambda m: m.get("last_used", 0))[:max(excess, 0)]:
            _log(f"stopping server {meta.get('pid')} ({meta.get('target')}): past "
                 f"KILN_SERVER_MAX={self.spec['max']}")
            stop_server(meta, wait_s=0)

    # -- loop --------------------------------------------------------------------------------

    def _loop(self) -> Any:
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._stop_listening())
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            if self.stopping and not self.children:
                return None
            timeout = None
            if not self.children:
                timeout = self.last_used + float(self.spec["idle"]) - time.time()
                if timeout <= 0:
                    _log("idle: leaving")
                    return None
            self._drop_silent()
            if self.pending:
                first = min(self.pending.values()) - time.time()
                timeout = first if timeout is None else min(timeout, first)
            for item, _ in self.selector.select(timeout):
                if item.data == "accept":
                    self._accept()
                elif item.data == "request":
                    job = self._request(item.fileobj)  # type: ignore[arg-type]
                    if job is not None:
                        return job
                elif item.data == "wake":
                    self._drain_wake()
                    self._reap()
                else:
                    self._client_event(item.fileobj, item.data)
            self._reap()

    def _stop_listening(self) -> None:
        if not self.stopping:
            self.stopping = True
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.listener.close()
            self._remove()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                message = {"status": "signal", "signal": os.WTERMSIG(status)}
            else:
                message = {"status": "exit", "code": os.waitstatus_to_exitcode(status)}
            with contextlib.suppress(OSError):
                send(conn, message)
            self._forget(conn)
            self.last_used = time.time()

    def _forget(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        conn.close()

    def _client_event(self, conn: Any, pid: int) -> None:
        """A running child's client wrote or went away: gone, its child is killed (as the
        client's own process would have been)."""
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if data:
            return
        if pid in self.children:
            _log(f"client of {pid} went away: killing its process group")
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)

    # -- one run -----------------------------------------------------------------------------

    def _accept(self) -> None:
        """A new connection: served when its first message comes (a connection that stays
        silent never holds up the others; it is dropped after ``_SILENT_S``)."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        self.pending[conn] = time.time() + _SILENT_S
        self.selector.register(conn, selectors.EVENT_READ, "request")

    def _drop_silent(self) -> None:
        now = time.time()
        for conn, deadline in list(self.pending.items()):
            if deadline <= now:
                _log("a connection sent nothing: dropped")
                del self.pending[conn]
                self._forget(conn)

    def _request(self, conn: socket.socket) -> Any:
        """A connection's first message came: serve it (the child's job, in the child)."""
        del self.pending[conn]
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        conn.setblocking(True)
        conn.settimeout(_SILENT_S)
        try:
            return self._serve(conn)
        except Exception as e:  # noqa: BLE001 - a message it does not understand never ends it
            if self.in_child:
                raise
            _log(f"a connection failed: {type(e).__name__}: {e}")
            conn.close()
            return None

    def _serve(self, conn: socket.socket) -> Any:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            _log(f"refused a connection from uid {uid}")
            conn.close()
            return None
        reader = Reader(conn)
        request = reader.next()
        fds = reader.fds
        try:
            if request is None:
                conn.close()
                return None
            op = request.get("op")
            if op == "ping":
                send(conn, self.meta)
                conn.close()
                return None
            if op == "stop":
                send(conn, {"ok": True})
                conn.close()
                self._stop_listening()
                return None
            if op != "run" or request.get("key") != self.key:
                send(conn, {"why": "the server was asked something else than a run of its key"})
                conn.close()
                return None
            if self.stopping:
                send(conn, {"why": "the server is stopping"})
                conn.close()
                return None
            why = self.snapshot.stale(request.get("own_dir")) or _unsafe_now()
            if why:
                _log(f"stale: {why}: leaving")
                send(conn, {"why": f"the server's imports are stale ({why}); it ended"})
                conn.close()
                self._stop_listening()
                return None
            # only now the client's stdin, stdout and stderr: descriptors sent to a server that
            # never reads them would stay open in its socket (a reader of the client's output
            # would wait for their end as long)
            send(conn, {"ready": True})
            message = reader.next()
            fds = reader.fds
            numbers = message.get("numbers") if message is not None else None
            if (message is None or message.get("op") != "stdio" or not isinstance(numbers, list)
                    or len(numbers) != len(fds) or numbers[:3] != [0, 1, 2]):
                conn.close()
                return None
            request["numbers"] = numbers
            return self._fork(conn, reader, request, fds)
        finally:
            if fds and not self.in_child:
                for fd in fds:
                    os.close(fd)

    def _fork(self, conn: socket.socket, reader: Reader, request: dict[str, Any],
              fds: list[int]) -> Any:
        go_r, go_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.in_child = True
            os.close(go_w)
            return self._child_job(conn, request, fds, go_r)
        os.close(go_r)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        self.children[pid] = conn
        try:
            send(conn, {"pid": pid, "preloaded": len(self.preloaded),
                        "not_preloaded": self.unsafe})
            go = reader.next()
        except (OSError, ValueError):
            go = None
        if not go or go.get("op") != "go":
            # the client gave up before the hand-over (its deadline): it runs plainly; the
            # child never starts the program
            os.close(go_w)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            return None
        os.write(go_w, b"g")
        os.close(go_w)
        conn.settimeout(None)
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, pid)
        self.last_used = time.time()
        self.meta["last_used"] = self.last_used
        self.meta["runs"] = self.meta.get("runs", 0) + 1
        with contextlib.suppress(OSError):
            write_json(self.files["meta"], self.meta)
        return None

    def _child_job(self, conn: socket.socket, request: dict[str, Any], fds: list[int],
                   go_r: int) -> dict[str, Any]:
        """In the child, right after the fork: drop every resource of the server; what
        :func:`kiln_warm._child.run_child` needs."""
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        self.selector.close()
        self.listener.close()
        for fd in (self.wake_r, self.wake_w, self.lock):
            os.close(fd)
        for other in [*self.children.values(), *self.pending]:
            other.close()
        self.children.clear()
        self.pending.clear()
        return {"conn": conn, "request": request, "fds": fds, "go": go_r,
                "preloaded": self.preloaded}


def _after(pid: int, limit_s: float = 60.0) -> None:
    """Wait (at most ``limit_s``) until the run that started this server has ended: its own
    exit (JAX's clean-up, atexit handlers) never shares the machine with this import work."""
    end = time.monotonic() + limit_s
    while pid > 0 and time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(0.02)
            continue
        if state == b"Z":
            return
        time.sleep(0.02)


def _unsafe_now() -> str | None:
    """Why this process may not fork now: a thread, or a JAX backend started."""
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} thread(s) running in the server"
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "a JAX backend was started in the server"
    return None
