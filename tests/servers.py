"""Real servers for the remote-store tests: ``redis-server`` and ``moto_server`` (S3) as child
processes, and a loopback port that accepts connections and never answers.

``tests/conftest.py`` loads this module once (test modules cannot import each other under
``--import-mode=importlib``) and gives every test its fixtures below, and the module itself as
the ``servers`` fixture (``servers.free_port()``, ``servers.hung_server()``, ...).

Fixtures:

- ``redis_server`` (session): one ``redis-server`` (no persistence, loopback only);
  ``redis_url`` (per test): its URL, on a database emptied (``FLUSHDB``) for the test.
- ``s3_server`` (session): one ``moto_server`` with a bucket; ``s3_url`` (per test): an
  ``s3://bucket/<fresh prefix>`` URL, with ``FSSPEC_S3_*`` set (``monkeypatch``) so that
  ``FsspecStore`` and child processes reach the server.

A missing ``redis-server`` or ``moto_server`` skips the test with the reason, except under CI
(environment variable ``CI`` set), where it fails: CI must run these tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["HungServer", "S3Server", "Server", "free_port", "hung_server", "missing",
           "redis_server", "redis_url", "s3_server", "s3_url", "start_moto", "start_redis", "stop"]

START_TIMEOUT = 30.0  # seconds a server may take to answer after it was started
BUCKET = "kiln-test"
S3_KEY, S3_SECRET = "kiln-test-key", "kiln-test-secret"  # moto accepts any credentials


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nothing listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing(what: str) -> None:
    """Skip the test because ``what`` is not installed, or fail under CI (``CI`` set)."""
    reason = f"{what} is not installed; the remote-store tests need it"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: CI must run these tests)")
    pytest.skip(reason)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process (kill it if it does not exit within 5 s) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path,
                what: str) -> None:
    """Poll ``ready()`` until it is true; fail with the server's log when the process exits or
    ``START_TIMEOUT`` seconds pass."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        if ready():
            return
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"{what} did not answer within {START_TIMEOUT:g} s:\n"
                       f"{log.read_text(errors='replace')[-4000:]}")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)


def _redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(tmp_path: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Start ``redis-server`` on a free loopback port (no RDB, no AOF, its files in
    ``tmp_path``) and wait until it answers PING.

    Returns:
        ``("redis://127.0.0.1:<port>", process)``; stop it with :func:`stop`.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        missing("redis-server")
        raise AssertionError("unreachable")
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp_path / "redis.log"
    proc = _spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(tmp_path)], log)
    _wait_until(lambda: _redis_pings(port), proc, log, "redis-server")
    return f"redis://127.0.0.1:{port}", proc


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means it is up
    except OSError:
        return False


def start_moto(tmp_path: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Start ``moto_server`` (next to ``sys.executable``) on a free loopback port, wait for an
    HTTP answer, and create bucket ``BUCKET``.

    Returns:
        ``("http://127.0.0.1:<port>", process)``: the S3 endpoint URL; stop it with :func:`stop`.
    """
    exe = Path(sys.executable).parent / "moto_server"
    if not exe.exists():
        found = shutil.which("moto_server")
        if found is None:
            missing("moto_server (pip install 'moto[server]')")
        exe = Path(str(found))
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path / "moto.log"
    proc = _spawn([str(exe), "-H", "127.0.0.1", "-p", str(port)], log)
    _wait_until(lambda: _http_answers(endpoint + "/"), proc, log, "moto_server")
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)
        try:
            client.create_bucket(Bucket=BUCKET)
        finally:
            client.close()
    except BaseException:
        stop(proc)
        raise
    return endpoint, proc


@dataclass
class HungServer:
    """A listening loopback port that never answers: ``host``, ``port``, and ``accepted``, the
    number of connections made to it so far (one per attempt of a client: a count of retries)."""

    host: str
    port: int
    conns: list[socket.socket]

    @property
    def accepted(self) -> int:
        return len(self.conns)


@contextlib.contextmanager
def hung_server() -> Iterator[HungServer]:
    """A loopback TCP port that accepts connections and never answers (a hung server); the
    connections are held open until the block ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)
    server = HungServer("127.0.0.1", int(listener.getsockname()[1]), [])
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server.conns.append(conn)

    thread = threading.Thread(target=accept, name="hung-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        done.set()
        thread.join()
        listener.close()
        for conn in server.conns:
            conn.close()


# -- fixtures ----------------------------------------------------------------------------------
@dataclass
class Server:
    """A running server: its URL (redis) or endpoint (S3) and its process."""

    url: str
    proc: subprocess.Popen[bytes]


@dataclass
class S3Server(Server):
    """A running ``moto_server``: ``url`` is the endpoint; ``bucket`` exists."""

    bucket: str = BUCKET

    def env(self) -> dict[str, str]:
        """Environment variables that point fsspec's ``s3://`` at this server."""
        return {"FSSPEC_S3_ENDPOINT_URL": self.url, "FSSPEC_S3_KEY": S3_KEY,
                "FSSPEC_S3_SECRET": S3_SECRET}


# One server of each kind per process, whichever test module's fixture starts it first.
_running: dict[str, Server] = {}
_running_lock = threading.Lock()


def _shared(kind: str, start: Callable[[], Server]) -> Server:
    with _running_lock:
        server = _running.get(kind)
        if server is None or server.proc.poll() is not None:
            server = _running[kind] = start()
        return server


def _stop_shared(kind: str) -> None:
    with _running_lock:
        server = _running.pop(kind, None)
    if server is not None:
        stop(server.proc)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``redis-server`` for the session (see :func:`start_redis`)."""
    def start() -> Server:
        return Server(*start_redis(tmp_path_factory.mktemp("redis")))

    yield _shared("redis", start)
    _stop_shared("redis")


@pytest.fixture
def redis_url(redis_server: Server) -> str:
    """``redis://127.0.0.1:<port>/0``, emptied (``FLUSHDB``) for this test."""
    url = redis_server.url + "/0"
    port = int(redis_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"FLUSHDB\r\n")
        answer = s.recv(64)
    if not answer.startswith(b"+OK"):
        raise RuntimeError(f"FLUSHDB on {url} answered {answer!r}")
    return url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One ``moto_server`` with bucket ``BUCKET`` for the session (see :func:`start_moto`)."""
    def start() -> Server:
        return S3Server(*start_moto(tmp_path_factory.mktemp("moto")))

    server = _shared("s3", start)
    assert isinstance(server, S3Server)
    yield server
    _stop_shared("s3")


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<bucket>/<fresh prefix>`` on the session's moto server, with ``FSSPEC_S3_*``
    set for this test (and its child processes)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
