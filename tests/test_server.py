"""``kiln run --server`` (issue 46): a run forked from a warm process behaves as a plain run.

Every case runs the same program both ways, as real processes (``python -m kiln run
--no-server`` and ``--server`` once the program's server is up), and compares stdout, stderr,
exit status and files written; a case counts as served only where the server's description
says it started one more run. Staleness: a preloaded module edited, a library reinstalled with
the same version, a variable changed, a new ``.pth``, a module of the program's folder that would
shadow a preloaded one: each run gives what a plain run gives. Faults: the server killed with
``kill -9`` in the middle of a run, the client killed, a server that does not answer, no room
to write. Lifecycle: idle exit, the cap on servers, ``kiln server ls|stop``, and no process
left behind by any case, nor a zombie (each test's processes carry a marker in their
environment; a zombie is known by its parent's).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, run_child, start_child

pytestmark = pytest.mark.slow

PROG = textwrap.dedent('''
    import atexit, faulthandler, os, sys, threading, time, warnings
    # (what the cases import lazily, imported by every run: the server preloads it all)
    import multiprocessing.connection, multiprocessing.pool, multiprocessing.popen_fork
    import multiprocessing.popen_spawn_posix, multiprocessing.queues
    import multiprocessing.resource_tracker, multiprocessing.spawn, multiprocessing.synchronize
    import jax.numpy
    import numpy as np


    def square(x):
        return x * x


    if __name__ == "__main__":
        try:  # (whether a server's fork runs it: its parent says; a full disk: not said)
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                served = b"kiln_warm" in f.read()
            with open(os.environ["PROG_WHO"], "a") as f:
                f.write("served\\n" if served else "plain\\n")
        except (KeyError, OSError):
            pass
        case = sys.argv[1]
        if case == "argv":
            print(sys.argv, __name__, os.path.basename(__file__),
                  sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
        elif case == "exit":
            print("bye")
            sys.exit(7)
        elif case == "exit_text":
            sys.exit("a message")
        elif case == "raise":
            def inner():
                raise ValueError("boom")
            inner()
        elif case == "stdin":
            print("got", input(), input())
        elif case == "isatty":
            print(sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty())
        elif case == "atexit":
            atexit.register(lambda: print("atexit ran", flush=True))
            print("main done")
        elif case == "thread":
            def late():
                time.sleep(0.3)
                print("thread done", flush=True)
            threading.Thread(target=late).start()
            print("main done")
        elif case in ("fork", "spawn"):
            import multiprocessing as mp
            with mp.get_context(case).Pool(2) as pool:
                print(pool.map(square, range(5)))
        elif case == "pid":
            with open(sys.argv[2], "w") as f:
                f.write(str(os.getpid()))
            with open(sys.argv[2]) as f:
                print(int(f.read()) == os.getpid(), os.getppid() != os.getpid())
            os.kill(os.getpid(), 0)
        elif case == "warn":
            warnings.warn("careful")
            print("after")
        elif case == "flags":
            print(sys.flags.optimize, sys.flags.dont_write_bytecode, sys.flags.verbose,
                  sys.warnoptions, sys.stdout.line_buffering, sys.stdout.encoding)
        elif case == "config":
            import jax
            jax.config.update("jax_enable_x64", True)
            import jax.numpy as jnp
            print(jnp.arange(3).dtype)
        elif case == "dtype":
            import jax.numpy as jnp
            print(jnp.arange(3).dtype)
        elif case == "syspath":
            sys.path.insert(0, sys.argv[2])
            import extra_mod
            print(extra_mod.VALUE)
        elif case == "noextra":
            print("extra_mod" in sys.modules, [p for p in sys.path if "extra" in p])
        elif case == "numpy":
            print(np.random.rand())
        elif case == "hash":
            print(hash("kiln"))
        elif case == "sleep":
            print("ready", flush=True)
            time.sleep(float(sys.argv[2]))
            print("done", flush=True)
            sys.exit(5)
        elif case == "jit":
            import jax, jax.numpy as jnp
            print(jax.jit(lambda x: jnp.cos(x) + 1)(jnp.arange(3.0)))
        elif case == "env":
            print(os.environ.get("HOME") is not None, os.getcwd(), oct(os.umask(0o22)))
        elif case == "write":
            with open("written.txt", "w") as f:
                f.write("made by the program")
            print(os.path.abspath("written.txt"))
        elif case == "faulthandler":
            import faulthandler
            faulthandler.dump_traceback(file=sys.stderr, all_threads=False)
        elif case == "names":
            print(sys.stdout.name, sys.stdin.buffer.raw.name, repr(sys.stderr))
        elif case == "fd3":
            os.write(3, b"to fd3\\n")
            print("ok")
        elif case == "fd800":
            os.write(800, b"to fd800\\n")
            print("ok")
        elif case == "big":
            for i in range(200000):
                print("line", i)
        elif case == "handler":
            import signal
            def on_term(signum, frame):
                print("handled", signal.Signals(signum).name, flush=True)
                sys.exit(3)
            signal.signal(signal.SIGTERM, on_term)
            print("ready", flush=True)
            time.sleep(60)
            print("not signalled")
        elif case == "nosignal":
            time.sleep(4)
            print("no signal")
        elif case == "tty":
            print(sys.stdin.isatty(), sys.stdout.isatty(), flush=True)
            print("got", input(), flush=True)
''')

SUMMARY = re.compile(r"^kiln: hits: .*$", re.M)


class Place:
    """One test's folders and environment: its own store, its own server folder (short: a
    socket's path has 107 bytes at most), a marker variable its processes carry."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server_dir = tempfile.mkdtemp(prefix="ks", dir="/tmp")
        self.mark = uuid.uuid4().hex
        self.lib = root / "lib"
        self.lib.mkdir()
        self.app = root / "app"
        self.app.mkdir()
        (self.app / "prog.py").write_text(PROG)
        self.base = {"KILN_CACHE_DIR": str(root / "store"), "KILN_SERVER_DIR": self.server_dir,
                     "KILN_SERVER_TIMEOUT": "20", "KILN_SERVER_IDLE": "300",
                     "KILN_TEST_MARK": self.mark, "PYTHONPATH": str(self.lib),
                     "PROG_WHO": str(root / "who.txt")}
        _OPEN.append(self)

    def env(self, **extra: str | None) -> dict[str, str]:
        return child_env(**{**self.base, **extra})

    def kiln(self, *args: str, server: bool = True, input: str | None = None,
             env: dict[str, str] | None = None, cwd: Path | None = None,
             flags: tuple[str, ...] = ()) -> Any:
        return run_child([sys.executable, *flags, "-m", "kiln", "run",
                          "--server" if server else "--no-server", *args],
                         env=env or self.env(), cwd=cwd or self.app, input=input, timeout=240)

    def servers(self) -> list[dict[str, Any]]:
        found = []
        for meta in Path(self.server_dir).glob("*.json"):
            try:
                data = json.loads(meta.read_text())
                os.kill(int(data["pid"]), 0)
            except (OSError, ValueError, KeyError):
                continue
            found.append(data)
        return found

    def server_of(self, target: str) -> dict[str, Any] | None:
        return next((s for s in self.servers()
                     if s.get("target") == target and s.get("state") == "serving"), None)

    def wait_server(self, target: str, timeout: float = 120) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.server_of(target)
            if found is not None:
                return found
            time.sleep(0.1)
        logs = "\n".join(p.read_text() for p in (self.root / "store").rglob("*.log"))
        raise AssertionError(f"no server for {target} within {timeout} s; logs:\n{logs}")

    def runs(self, target: str) -> int:
        """The runs the servers of ``target`` have forked (-1: it has none)."""
        found = [s for s in self.servers()
                 if s.get("target") == target and s.get("state") == "serving"]
        return -1 if not found else sum(int(s.get("runs", 0)) for s in found)

    def warm(self, target: str = "prog.py", *args: str, **kwargs: Any) -> dict[str, Any]:
        """A plain first run with --server (it starts the server); the server, once up."""
        first = self.kiln(target, *args, **kwargs)
        assert "Traceback" not in first.stderr, first.stderr
        return self.wait_server(target)

    def marked(self) -> list[int]:
        """The processes that carry this test's marker (its servers and their children)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if f"KILN_TEST_MARK={self.mark}".encode() in environ:
                found.append(int(entry))
        return found

    def zombies(self, wait_s: float = 5.0) -> list[str]:
        """The zombie processes (ended, never waited for) whose parent carries this test's
        marker, left so for ``wait_s`` seconds (a child that just ended is reaped within
        milliseconds): a server or a client that does not reap its children. A zombie's own
        environment cannot be read (/proc gives none): its parent says whose it is."""
        end = time.monotonic() + wait_s
        while True:
            parents = set(self.marked())
            found = []
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                except OSError:
                    continue
                name = stat[stat.find(b"(") + 1:stat.rfind(b")")].decode(errors="replace")
                state, ppid = stat.rsplit(b")", 1)[1].split()[:2]
                if state == b"Z" and int(ppid) in parents:
                    found.append(f"{entry} ({name}), child of {int(ppid)}")
            if not found or time.monotonic() >= end:
                return found
            time.sleep(0.1)

    def close(self) -> None:
        _OPEN.remove(self)
        # (zombies first: a server that ends hands its children to init, which reaps them)
        zombies = self.zombies()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            # (again while any is left: a server started by the last run may not have
            # described itself yet)
            run_child([sys.executable, "-m", "kiln", "server", "stop"], env=self.env(),
                      timeout=60)
            wait = time.monotonic() + 3
            while self.marked() and time.monotonic() < wait:
                time.sleep(0.1)
            if not self.marked():
                break
        left = self.marked()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.server_dir, ignore_errors=True)
        assert not left, f"processes left behind: {left}"
        assert not zombies, f"zombie processes left behind: {zombies}"


# the places not closed yet (the module's shared one): checked for zombies after each test
_OPEN: list[Place] = []


@pytest.fixture(autouse=True)
def no_zombies() -> Any:
    """After each test, no zombie left by the servers or clients of a place still open (a
    test's own place checks at its close; the shared one's server outlives the test)."""
    yield
    for p in _OPEN:
        found = p.zombies()
        assert not found, f"zombie processes left behind: {found}"


@pytest.fixture
def place(tmp_path: Path) -> Any:
    p = Place(tmp_path)
    yield p
    p.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One program's server, shared by the cases that compare a run with a plain one."""
    p = Place(tmp_path_factory.mktemp("server"))
    p.warm("prog.py", "argv")
    yield p
    p.close()


def both(p: Place, *args: str, input: str | None = None) -> tuple[Any, Any]:
    """The same command line plain and served; asserts the served one was served."""
    plain = p.kiln("prog.py", *args, server=False, input=input)
    for attempt in range(4):
        # (a run that imported what the record lacked added it: the next run is a plain one,
        # which starts the server that preloads it too)
        if attempt:
            time.sleep(3)
        p.wait_server("prog.py")
        before = p.runs("prog.py")
        served = p.kiln("prog.py", *args, input=input)
        if p.runs("prog.py") == before + 1:
            return plain, served
    raise AssertionError(f"not served:\n{served.stderr}")


CASES = [("argv", "x", "y"), ("exit",), ("exit_text",), ("raise",), ("isatty",), ("atexit",),
         ("thread",), ("fork",), ("spawn",), ("warn",), ("flags",), ("dtype",)]


@pytest.mark.parametrize("args", CASES, ids=[c[0] for c in CASES])
def test_a_served_run_prints_and_exits_as_a_plain_run(shared: Place,
                                                      args: tuple[str, ...]) -> None:
    plain, served = both(shared, *args)
    # (kiln's summary line counts what each run loaded or compiled: the first run compiles)
    assert (served.returncode, served.stdout, SUMMARY.sub("", served.stderr)) == \
        (plain.returncode, plain.stdout, SUMMARY.sub("", plain.stderr))
    if args[0] == "raise":
        assert plain.returncode == 1 and "ValueError: boom" in plain.stderr
    if args[0] == "exit":
        assert plain.returncode == 7
    if args[0] == "thread":
        assert plain.stdout == "main done\nthread done\n"
    if args[0] == "atexit":
        assert plain.stdout == "main done\natexit ran\n"
    if args[0] in ("fork", "spawn"):
        assert plain.stdout == "[0, 1, 4, 9, 16]\n"


def test_stdin_from_a_pipe(shared: Place) -> None:
    plain, served = both(shared, "stdin", input="one\ntwo\n")
    assert served.stdout == plain.stdout == "got one two\n"
    assert served.returncode == plain.returncode == 0


def test_working_folder_umask_pid_and_files_written(shared: Place, tmp_path: Path) -> None:
    plain, served = both(shared, "env")
    assert served.stdout == plain.stdout and str(shared.app) in plain.stdout
    plain, served = both(shared, "write")
    assert served.stdout == plain.stdout == f"{shared.app / 'written.txt'}\n"
    assert (shared.app / "written.txt").read_text() == "made by the program"
    pids = []
    for _ in range(2):
        served = shared.kiln("prog.py", "pid", str(tmp_path / "pidfile"))
        assert served.stdout == "True True\n"
        pids.append(int((tmp_path / "pidfile").read_text()))
    assert pids[0] != pids[1]  # a process per run


def test_each_run_starts_from_the_server_not_from_the_last_run(shared: Place,
                                                              tmp_path: Path) -> None:
    """A run's jax.config, sys.path and imports do not reach the next run."""
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "extra_mod.py").write_text("VALUE = 41\n")
    assert shared.kiln("prog.py", "config").stdout == "int64\n"
    assert shared.kiln("prog.py", "dtype").stdout == "int32\n"
    assert shared.kiln("prog.py", "syspath", str(tmp_path / "extra")).stdout == "41\n"
    assert shared.kiln("prog.py", "noextra").stdout == "False []\n"


def _shell(p: Place, line: str, server: bool) -> Any:
    """``line`` in bash, ``KILN`` standing for this interpreter's ``kiln run`` with or without
    the server; whether the run was served, as the program itself saw its parent (a count of
    the server's runs cannot tell: a server may end and another start between two runs)."""
    kiln = f"{sys.executable} -m kiln run {'--server' if server else '--no-server'}"
    who = p.root / "who.txt"  # (one name for every run: the environment is in the key)
    who.unlink(missing_ok=True)
    done = run_child(["bash", "-c", line.replace("KILN", kiln)], env=p.env(), cwd=p.app,
                     timeout=240)
    return done, who.read_text().split() if who.exists() else []


def test_descriptors_names_pipes_and_ignored_signals_as_a_plain_run(shared: Place,
                                                                    tmp_path: Path) -> None:
    both(shared, "names")  # (the server preloads what these runs import)
    cases = [
        # (the shell line, served?)
        (f"KILN prog.py fd3 3>{tmp_path}/fd3.txt; cat {tmp_path}/fd3.txt", True),
        # a descriptor near the open-files limit (1024 by default)
        (f"ulimit -Sn 1024; KILN prog.py fd800 800>{tmp_path}/fd800.txt; "
         f"cat {tmp_path}/fd800.txt", True),
        ("KILN prog.py big | head -2; echo status ${PIPESTATUS[0]}", True),
        # nohup, a background job: the signal stays ignored in the run
        ("trap '' HUP INT; KILN prog.py nosignal & p=$!; sleep 2; kill -HUP $p; "
         "kill -INT $p; wait $p; echo status $?", True),
        # a closed stdin: sys.stdin is None in a plain run (a served run could not give it)
        ("KILN prog.py isatty <&-; echo status $?", False),
    ]
    for line, servable in cases:
        plain, _ = _shell(shared, line, server=False)
        # (a run that imported something new, or a server that found a file on its path
        # changed, as other tests' installs do: the next run is plain, the one after served)
        for _ in range(5):
            shared.wait_server("prog.py")
            served, who = _shell(shared, line, server=True)
            if who == ["served" if servable else "plain"]:
                break
        logs = "\n".join(p.read_text() for p in (shared.root / "store").rglob("*.log"))
        assert who == ["served" if servable else "plain"], (line, served.stderr, logs)
        assert (served.stdout, SUMMARY.sub("", served.stderr)) == \
            (plain.stdout, SUMMARY.sub("", plain.stderr)), line
    names = shared.kiln("prog.py", "names").stdout
    assert names.startswith("<stdout> <stdin> <_io.TextIOWrapper name='<stderr>'")


def test_numpy_global_generator_is_seeded_anew_each_run(shared: Place) -> None:
    draws = {shared.kiln("prog.py", "numpy").stdout for _ in range(3)}
    assert len(draws) == 3  # an unseeded program does not repeat its numbers


def test_a_jitted_function_loads_warm_in_a_served_run(shared: Place) -> None:
    plain, served = both(shared, "jit")
    assert served.stdout == plain.stdout
    assert "traces: 0" in SUMMARY.search(served.stderr).group(0)


def test_faulthandler_writes_to_the_clients_stderr(shared: Place) -> None:
    served = shared.kiln("prog.py", "faulthandler")
    assert f'File "{shared.app / "prog.py"}"' in served.stderr  # (__file__: as python's)
    assert "Stack (most recent call first)" in served.stderr


def _interrupted(p: Place, how: str) -> tuple[int, bool, bool]:
    """``prog.py sleep 60`` run by ``python`` or ``kiln run`` (plain, or served), sent SIGINT
    once it is ready: its status, whether its stderr shows the KeyboardInterrupt, and whether
    a server ran it."""
    before = p.runs("prog.py")
    command = ["prog.py"] if how == "python" else [
        "-m", "kiln", "run", "--server" if how == "served" else "--no-server", "prog.py"]
    proc = start_child([sys.executable, *command, "sleep", "60"], env=p.env(), cwd=p.app)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, "KeyboardInterrupt" in err, p.runs("prog.py") == before + 1


def test_ctrl_c_is_a_keyboard_interrupt_that_ends_the_run_by_sigint(shared: Place) -> None:
    # as python: the traceback, then the process ends by SIGINT (a shell sees 130)
    assert _interrupted(shared, "python")[:2] == (-signal.SIGINT, True)
    assert _interrupted(shared, "plain")[:2] == (-signal.SIGINT, True)
    for attempt in range(4):  # (as both(): until a server that preloads it all runs it)
        shared.wait_server("prog.py")
        status, shown, served = _interrupted(shared, "served")
        assert (status, shown) == (-signal.SIGINT, True)
        if served:
            break
        time.sleep(3)
    assert served


def _signalled(p: Place, signum: int, *args: str, server: bool) -> tuple[Any, ...]:
    """``kiln run prog.py ARGS`` sent ``signum`` once it printed "ready": its status, stdout,
    stderr less kiln's summary line, and who ran it (as the program saw its parent)."""
    who = p.root / "who.txt"
    who.unlink(missing_ok=True)
    proc = start_child([sys.executable, "-m", "kiln", "run",
                        "--server" if server else "--no-server", "prog.py", *args],
                       env=p.env(), cwd=p.app)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return (proc.returncode, out, SUMMARY.sub("", err),
            who.read_text().split() if who.exists() else [])


@pytest.mark.parametrize(("signame", "args"),
                         [("SIGTERM", ("sleep", "60")), ("SIGHUP", ("sleep", "60")),
                          ("SIGQUIT", ("sleep", "60")), ("SIGTERM", ("handler",))],
                         ids=["sigterm", "sighup", "sigquit", "sigterm-handled"])
def test_sigterm_sighup_and_sigquit_reach_the_program_as_in_a_plain_run(
        shared: Place, signame: str, args: tuple[str, ...]) -> None:
    """The client forwards the signal to its child and ends as the child did: by the signal
    where the program has no handler, with the handler's status where it has one."""
    signum = getattr(signal, signame)
    plain = _signalled(shared, signum, *args, server=False)
    # (a server that found a file on its path changed, as other tests' installs do, or a
    # record of imports whose server is not up: a run that ends by a signal records nothing and
    # starts no server, so a run that ends normally does, and the next try is served)
    for _ in range(5):
        shared.wait_server("prog.py")
        served = _signalled(shared, signum, *args, server=True)
        if served[3] == ["served"]:
            break
        shared.kiln("prog.py")
    logs = "\n".join(p.read_text() for p in (shared.root / "store").rglob("*.log"))
    assert served[3] == ["served"], (served, logs)
    assert plain[3] == ["plain"]
    assert served[:3] == plain[:3]
    if args == ("handler",):
        assert plain[:2] == (3, "handled SIGTERM\n")
    else:
        assert plain[:2] == (-signum, "")  # ended by the signal (a shell sees 128 + signum)


def _through_pty(p: Place, server: bool) -> str:
    main, secondary = pty.openpty()
    proc = start_child([sys.executable, "-m", "kiln", "run",
                        "--server" if server else "--no-server", "prog.py", "tty"],
                       env=p.env(), cwd=p.app, stdin=secondary, stdout=secondary)
    os.close(secondary)
    seen = b""
    end = time.monotonic() + 120
    # (the whole line, its end included: a terminal may hand over "True True" and its "\r\n"
    # in two reads, and the echo of what is typed must come after both)
    while b"True True\r\n" not in seen and time.monotonic() < end:
        if select.select([main], [], [], 0.5)[0]:
            seen += os.read(main, 4096)
    os.write(main, b"typed\n")
    while proc.poll() is None and time.monotonic() < end:
        if select.select([main], [], [], 0.2)[0]:
            try:
                seen += os.read(main, 4096)
            except OSError:
                break
    proc.communicate(timeout=60)
    os.close(main)
    return seen.decode().replace("\r", "")


def test_a_terminal_is_a_terminal_and_input_reads_from_it(shared: Place) -> None:
    plain = _through_pty(shared, server=False)
    before = shared.runs("prog.py")
    served = _through_pty(shared, server=True)
    assert shared.runs("prog.py") == before + 1
    assert "True True\n" in plain and "got typed\n" in plain
    assert served == plain


def test_the_string_hash_seed_is_the_servers_and_a_set_one_is_kept(place: Place) -> None:
    """A child cannot draw a new hash seed (a running interpreter keeps its own): it gets its
    server's. PYTHONHASHSEED, part of the key, gives a plain run's hashes."""
    env = place.env(PYTHONHASHSEED="123")
    place.warm("prog.py", "hash", env=env)
    plain = place.kiln("prog.py", "hash", server=False, env=env)
    served = place.kiln("prog.py", "hash", env=env)
    assert place.runs("prog.py") == 1
    assert served.stdout == plain.stdout


def _served_twice(p: Place, *args: str, env: dict[str, str]) -> list[str]:
    """The stdout of two runs of ``prog.py ARGS`` forked by one server."""
    def counts() -> dict[int, int]:
        return {int(s["pid"]): int(s.get("runs", 0)) for s in p.servers()
                if s.get("target") == "prog.py" and s.get("state") == "serving"}

    for attempt in range(4):
        # (a run that imported what the record lacked added it, and a server that found a file
        # on its path changed ends: the next run is plain, which starts another server)
        if attempt:
            time.sleep(3)
        p.wait_server("prog.py")
        before = counts()
        outs = [p.kiln("prog.py", *args, env=env).stdout for _ in range(2)]
        if any(runs == before.get(pid, 0) + 2 for pid, runs in counts().items()):
            return outs
    raise AssertionError(f"two runs not served by one server: {outs}")


def test_without_pythonhashseed_the_runs_of_one_server_share_its_hash_seed(
        place: Place) -> None:
    """PYTHONHASHSEED unset: a child has its server's string hash seed (the same for every run
    one server forks), random per server as it is per process (docs/reference.md, "What a
    fork copies")."""
    env = place.env(PYTHONHASHSEED=None)
    plains = {place.kiln("prog.py", "hash", server=False, env=env).stdout for _ in range(2)}
    assert len(plains) == 2  # a plain run draws its own
    place.warm("prog.py", "hash", env=env)
    first = _served_twice(place, "hash", env=env)
    assert first[0] == first[1]
    stopped = run_child([sys.executable, "-m", "kiln", "server", "stop"], env=place.env(),
                        timeout=60)
    assert "stopped" in stopped.stdout and place.servers() == []
    place.warm("prog.py", "hash", env=env)  # another server
    second = _served_twice(place, "hash", env=env)
    assert second[0] == second[1] != first[0]


def test_interpreter_flags_are_part_of_the_key(place: Place) -> None:
    flags = ("-O", "-W", "ignore::DeprecationWarning")
    place.warm("prog.py", "flags", flags=flags)
    plain = place.kiln("prog.py", "flags", server=False, flags=flags)
    served = place.kiln("prog.py", "flags", flags=flags)
    assert place.runs("prog.py") == 1
    assert served.stdout == plain.stdout and plain.stdout.startswith("1 ")
    # the same program without the flags: another key (this run is plain)
    other = place.kiln("prog.py", "flags")
    assert other.stdout.startswith("0 ")
    assert place.runs("prog.py") == 1


def test_module_mode_and_pytest_through_the_server(place: Place) -> None:
    pkg = place.app / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("import sys\nimport numpy\nprint('cli', sys.argv[1:], "
                                "__name__)\n")
    place.kiln("-m", "mypkg.cli", "a")
    place.wait_server("-m mypkg.cli")
    plain = place.kiln("-m", "mypkg.cli", "a", "b", server=False)
    served = place.kiln("-m", "mypkg.cli", "a", "b")
    assert place.runs("-m mypkg.cli") == 1
    assert served.stdout == plain.stdout == "cli ['a', 'b'] __main__\n"
    (place.app / "test_small.py").write_text(
        "import jax.numpy as jnp\n\ndef test_sum():\n    assert float(jnp.sum(jnp.ones(3))) "
        "== 3.0\n")
    args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_small.py")
    place.kiln(*args)
    place.wait_server("-m pytest")
    served = place.kiln(*args)
    assert place.runs("-m pytest") == 1
    assert served.returncode == 0 and "1 passed" in served.stdout


def _lib_program(p: Place, body: str, name: str = "libuser.py") -> None:
    (p.app / name).write_text(textwrap.dedent(body))


@pytest.mark.parametrize("what", ["module", "config"])
def test_an_edited_preloaded_module_or_file_it_read_gives_a_plain_runs_result(
        place: Place, what: str) -> None:
    # a preloaded library's own file, or a config file it reads when imported (matplotlib
    # reads ./matplotlibrc): the server checks both before each fork
    if what == "module":
        (place.lib / "helper_lib.py").write_text("VALUE = 'first'\n")
        edited, second = place.lib / "helper_lib.py", "VALUE = 'second'\n"
    else:
        (place.lib / "helper_lib.py").write_text(
            "with open('settings.cfg') as f:\n    VALUE = f.read().strip()\n")
        (place.app / "settings.cfg").write_text("first\n")
        edited, second = place.app / "settings.cfg", "second\n"
    _lib_program(place, "import helper_lib\nprint(helper_lib.VALUE)\n")
    time.sleep(2.1)  # (a file younger than the server's start makes it refuse to serve)
    place.warm("libuser.py")
    assert place.kiln("libuser.py").stdout == "first\n"
    assert place.runs("libuser.py") == 1
    edited.write_text(second)
    assert place.kiln("libuser.py").stdout == "second\n"  # the server saw it: a plain run


def test_a_reinstalled_library_and_a_new_pth_give_a_plain_runs_result(place: Place) -> None:
    # a folder Python treats as site-packages (its .pth files read at start): added by a
    # sitecustomize on PYTHONPATH (the user site is off in a virtual environment)
    site = place.root / "site-packages"
    site.mkdir()
    (place.lib / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    env = place.env()

    def install(value: int) -> None:
        shutil.rmtree(site / "fakedist-1.0.dist-info", ignore_errors=True)
        (site / "fakedist-1.0.dist-info").mkdir()
        (site / "fakedist-1.0.dist-info" / "RECORD").write_text("fakedist.py,,\n")
        (site / "fakedist-1.0.dist-info" / "METADATA").write_text("Name: fakedist\nVersion: 1.0\n")
        (site / "fakedist.py").unlink(missing_ok=True)
        (site / "fakedist.py").write_text(f"VALUE = {value}\n")
        os.utime(site / "fakedist.py", (time.time() - 10, time.time() - 10))

    install(1)
    _lib_program(place, "import fakedist\ntry:\n    import pthmod\n    print(fakedist.VALUE, "
                 "pthmod.X)\nexcept ImportError:\n    print(fakedist.VALUE, None)\n")
    time.sleep(2.1)
    place.warm("libuser.py", env=env)
    assert place.kiln("libuser.py", env=env).stdout == "1 None\n"
    assert place.runs("libuser.py") == 1
    install(2)  # the same version again, other files: what pip does
    assert place.kiln("libuser.py", env=env).stdout == "2 None\n"
    time.sleep(2.1)
    place.warm("libuser.py", env=env)
    assert place.kiln("libuser.py", env=env).stdout == "2 None\n"
    (place.root / "pthdir").mkdir()
    (place.root / "pthdir" / "pthmod.py").write_text("X = 'from the pth'\n")
    (site / "extra.pth").write_text(str(place.root / "pthdir") + "\n")
    assert place.kiln("libuser.py", env=env).stdout == "2 from the pth\n"


def test_a_changed_variable_and_a_shadowing_module_give_a_plain_runs_result(
        place: Place) -> None:
    (place.lib / "helper_lib.py").write_text("VALUE = 'library'\n")
    _lib_program(place, "import os, helper_lib\nprint(helper_lib.VALUE, "
                 "os.environ.get('SOME_SETTING'))\n")
    time.sleep(2.1)
    place.warm("libuser.py")
    assert place.kiln("libuser.py").stdout == "library None\n"
    assert place.runs("libuser.py") == 1
    changed = place.kiln("libuser.py", env=place.env(SOME_SETTING="2"))
    assert changed.stdout == "library 2\n"
    assert place.runs("libuser.py") == 1  # another key: the run was plain
    (place.app / "helper_lib.py").write_text("VALUE = 'program folder'\n")
    assert place.kiln("libuser.py").stdout == "program folder None\n"


def test_a_module_that_starts_a_thread_or_writes_at_import_is_left_to_each_run(
        place: Place) -> None:
    (place.lib / "noisy_lib.py").write_text("print('hello from noisy_lib')\n")
    (place.lib / "thready_lib.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), "
        "daemon=True).start()\nVALUE = 3\n")
    _lib_program(place, "import numpy\nimport noisy_lib\nprint('main')\n", "noisy.py")
    _lib_program(place, "import numpy\nimport thready_lib\nprint(thready_lib.VALUE)\n",
                 "thready.py")
    time.sleep(2.1)
    env = place.env(KILN_EXPLAIN="1")
    for script, expected in (("noisy.py", "hello from noisy_lib\nmain\n"), ("thready.py", "3\n")):
        place.warm(script, env=env)
        meta = place.wait_server(script)
        wanted = script.replace(".py", "_lib")
        end = time.monotonic() + 60
        while wanted not in meta.get("not_preloaded", {}) and time.monotonic() < end:
            time.sleep(0.2)  # (the server starts again without it)
            meta = place.server_of(script) or meta
        assert wanted in meta["not_preloaded"], meta
        plain = place.kiln(script, server=False, env=env)
        served = place.kiln(script, env=env)
        assert served.stdout == plain.stdout == expected
        assert place.runs(script) == 1
        # KILN_EXPLAIN names what was left to the run, and why
        assert f"not preloaded: {wanted} (" in served.stderr, served.stderr


def test_a_module_that_starts_a_jax_backend_at_import_is_left_to_each_run(
        place: Place) -> None:
    """A library of the program's (on sys.path, outside the script's folder) that asks for
    JAX's devices while imported: never in the server (a fork would copy a backend's state
    without its threads); each run imports it and prints what a plain run prints."""
    (place.lib / "backend_lib.py").write_text(
        "import jax\nimport jax.numpy as jnp\nDEVICES = len(jax.devices())\n"
        "VALUE = float(jnp.ones(1)[0])\n")
    _lib_program(place, "import numpy\nimport backend_lib\n"
                 "print(backend_lib.DEVICES > 0, backend_lib.VALUE)\n", "backend.py")
    time.sleep(2.1)
    env = place.env(KILN_EXPLAIN="1")
    place.warm("backend.py", env=env)
    meta = place.wait_server("backend.py")
    end = time.monotonic() + 60
    while "backend_lib" not in meta.get("not_preloaded", {}) and time.monotonic() < end:
        time.sleep(0.2)  # (the server starts again without it)
        meta = place.server_of("backend.py") or meta
    why = "started a JAX backend while imported (a device, XLA's threads)"
    assert meta["not_preloaded"].get("backend_lib") == why, meta
    plain = place.kiln("backend.py", server=False, env=env)
    served = place.kiln("backend.py", env=env)
    assert served.stdout == plain.stdout == "True 1.0\n"
    assert place.runs("backend.py") == 1
    assert f"not preloaded: backend_lib ({why})" in served.stderr, served.stderr


def test_the_server_killed_in_the_middle_of_a_run(place: Place) -> None:
    server = place.warm("prog.py", "argv")
    proc = start_child([sys.executable, "-m", "kiln", "run", "--server", "prog.py", "sleep",
                        "2"], env=place.env(), cwd=place.app)
    assert proc.stdout.readline() == "ready\n"
    os.kill(int(server["pid"]), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out) == (5, "done\n"), err  # the run's own result
    after = place.kiln("prog.py", "exit")  # no server: a plain run
    assert (after.returncode, after.stdout) == (7, "bye\n")


def test_the_client_killed_in_the_middle_of_a_run_leaves_no_process(place: Place) -> None:
    server = place.warm("prog.py", "argv")
    proc = start_child([sys.executable, "-m", "kiln", "run", "--server", "prog.py", "sleep",
                        "300"], env=place.env(), cwd=place.app)
    assert proc.stdout.readline() == "ready\n"
    proc.kill()
    proc.communicate(timeout=60)
    end = time.monotonic() + 30
    while time.monotonic() < end and [p for p in place.marked() if p != int(server["pid"])]:
        time.sleep(0.1)
    assert place.marked() == [int(server["pid"])]


def test_a_server_that_does_not_answer_means_a_plain_run(place: Place) -> None:
    server = place.warm("prog.py", "argv")
    os.kill(int(server["pid"]), signal.SIGSTOP)
    try:
        late = place.kiln("prog.py", "exit", env=place.env(KILN_SERVER_TIMEOUT="0.05"))
    finally:
        os.kill(int(server["pid"]), signal.SIGCONT)
    assert (late.returncode, late.stdout) == (7, "bye\n")  # once: the server's child never ran
    time.sleep(1)
    assert place.runs("prog.py") == 0


def _reasons(stderr: str) -> list[str]:
    """The lines of ``KILN_EXPLAIN`` that say why a run is not served (each says "a plain
    run")."""
    return [line for line in stderr.splitlines()
            if line.startswith("kiln: server: ") and "a plain run" in line]


def test_a_run_that_cannot_be_served_says_why_in_one_line(place: Place) -> None:
    """Under KILN_EXPLAIN, a run the server cannot take prints one line saying why, and the
    plain run's output: no record yet, no server, a server that does not answer, a server
    made stale by an edited preloaded module."""
    (place.lib / "helper_lib.py").write_text("VALUE = 1\n")
    _lib_program(place, "import helper_lib\nprint(helper_lib.VALUE)\n")
    time.sleep(2.1)  # (a file younger than the server's start makes it refuse to serve)
    env = place.env(KILN_EXPLAIN="1")

    def plain_and_why(run: Any, why: str) -> None:
        plain = place.kiln("libuser.py", server=False, env=env)
        assert (run.returncode, run.stdout) == (plain.returncode, plain.stdout), run.stderr
        reasons = _reasons(run.stderr)
        assert len(reasons) == 1 and why in reasons[0], run.stderr

    first = place.kiln("libuser.py", env=env)
    assert first.stdout == "1\n"
    plain_and_why(first, "no record of this program's imports yet: a plain run")
    place.wait_server("libuser.py")
    run_child([sys.executable, "-m", "kiln", "server", "stop"], env=place.env(), timeout=60)
    assert place.servers() == []
    plain_and_why(place.kiln("libuser.py", env=env), "no server for this program yet (key ")
    server = place.wait_server("libuser.py")
    os.kill(int(server["pid"]), signal.SIGSTOP)
    try:
        late = place.kiln("libuser.py", env=place.env(KILN_EXPLAIN="1",
                                                       KILN_SERVER_TIMEOUT="0.05"))
    finally:
        os.kill(int(server["pid"]), signal.SIGCONT)
    plain_and_why(late, "TimeoutError: timed out: a plain run")
    for attempt in range(4):
        # (a server may find one of kiln's own files changed first, as another edit makes it:
        # its reason names that file; again, once a server is up that imported both)
        if attempt:
            time.sleep(2.1)
            place.warm("libuser.py", env=env)
        place.wait_server("libuser.py")
        (place.lib / "helper_lib.py").write_text(f"VALUE = {22 + attempt}\n")
        stale = place.kiln("libuser.py", env=env)
        if any("helper_lib.py changed" in line for line in _reasons(stale.stderr)):
            break
    assert stale.stdout == f"{22 + attempt}\n"
    plain_and_why(stale, f"the server's imports are stale ({place.lib / 'helper_lib.py'} "
                         "changed); it ended: a plain run")


def test_two_runs_at_once_of_the_same_and_of_another_program(place: Place) -> None:
    (place.app / "other.py").write_text("import sys, time\nimport numpy\ntime.sleep(1)\n"
                                        "print('other', sys.argv[1])\n")
    place.warm("prog.py", "argv")
    place.warm("other.py", "0")
    procs = [start_child([sys.executable, "-m", "kiln", "run", "--server", *args],
                         env=place.env(), cwd=place.app)
             for args in (("prog.py", "sleep", "1"), ("prog.py", "sleep", "1"),
                          ("other.py", "1"), ("other.py", "2"))]
    outs = [(p.communicate(timeout=120)[0], p.returncode) for p in procs]
    assert outs == [("ready\ndone\n", 5), ("ready\ndone\n", 5), ("other 1\n", 0),
                    ("other 2\n", 0)]
    assert place.runs("prog.py") == 2 and place.runs("other.py") == 2


def test_no_room_to_write_still_runs_the_program(place: Place) -> None:
    """Every file write fails (RLIMIT_FSIZE 0, as a full disk): no record, no server, no
    store entry, and the program's result is a plain run's."""
    code = ("import os, resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            "os.execv(sys.executable, [sys.executable, '-m', 'kiln', 'run', '--server', "
            "'prog.py', 'exit'])\n")
    for _ in range(2):
        full = run_child([sys.executable, "-c", code], env=place.env(), cwd=place.app,
                         timeout=240)
        assert (full.returncode, full.stdout) == (7, "bye\n"), full.stderr
    assert place.servers() == []


def test_idle_exit_cap_and_kiln_server_ls_and_stop(place: Place) -> None:
    (place.app / "other.py").write_text("import numpy\nprint('other')\n")
    place.warm("prog.py", "argv")
    listed = run_child([sys.executable, "-m", "kiln", "server", "ls", "--json"],
                       env=place.env(), timeout=60)
    assert [s["target"] for s in json.loads(listed.stdout)] == ["prog.py"]
    text = run_child([sys.executable, "-m", "kiln", "server", "ls"], env=place.env(), timeout=60)
    assert "prog.py" in text.stdout and "KEY" in text.stdout
    # a cap of one: the second program's server stops the first
    place.warm("other.py", env=place.env(KILN_SERVER_MAX="1"))
    end = time.monotonic() + 30
    while place.server_of("prog.py") is not None and time.monotonic() < end:
        time.sleep(0.1)
    assert [s["target"] for s in place.servers()] == ["other.py"]
    stopped = run_child([sys.executable, "-m", "kiln", "server", "stop"], env=place.env(),
                        timeout=60)
    assert "stopped" in stopped.stdout and place.servers() == []
    # idle exit (after one second unused)
    place.kiln("prog.py", "argv", env=place.env(KILN_SERVER_IDLE="1"))
    logs = place.root / "store" / "server" / "logs"
    end = time.monotonic() + 60
    while time.monotonic() < end and not any("idle: leaving" in f.read_text()
                                              for f in logs.glob("*.log")):
        time.sleep(0.1)
    assert any("idle: leaving" in f.read_text() for f in logs.glob("*.log"))
    assert place.servers() == []
    assert run_child([sys.executable, "-m", "kiln", "server", "stop", "nosuchkey"],
                     env=place.env(), timeout=60).returncode == 1
    # every server that ended took its files with it, its lock too; a killed server's lock is
    # removed by the next listing, a lock someone holds is left
    end = time.monotonic() + 30
    while time.monotonic() < end and any(Path(place.server_dir).glob("*.lock")):
        time.sleep(0.1)
    assert sorted(p.name for p in Path(place.server_dir).iterdir()) == []
    (Path(place.server_dir) / "0123456789abcdef0123.lock").write_text("")
    held = os.open(Path(place.server_dir) / "fedcba9876543210fedc.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        run_child([sys.executable, "-m", "kiln", "server", "ls"], env=place.env(), timeout=60)
        assert [p.name for p in Path(place.server_dir).iterdir()] == [
            "fedcba9876543210fedc.lock"]
    finally:
        os.close(held)


def test_kiln_server_ls_does_not_import_jax(place: Place) -> None:
    code = ("import sys\nsys.argv = ['kiln', 'server', 'ls']\nimport kiln_cli\n"
            "status = kiln_cli.main()\nprint('jax' in sys.modules, status)\n")
    done = run_child([sys.executable, "-c", code], env=place.env(), timeout=60)
    assert done.stdout.splitlines()[-1] == "False 0"


def test_settings_a_program_sets_before_import_jax_hold_in_a_served_run(place: Place) -> None:
    # the server preloads only what the program imported before it set the environment:
    # jax is imported in the run, and reads what the program set, as under python
    (place.app / "env.py").write_text(textwrap.dedent("""
        import os, sys
        os.environ["JAX_ENABLE_X64"] = "1"
        os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
        import jax, jax.numpy as jnp
        print(jnp.ones(2).dtype, jax.config.jax_numpy_rank_promotion,
              jax.jit(lambda x: x / 3)(jnp.arange(3.0)).dtype)
    """))
    plain = run_child([sys.executable, "env.py"], env=place.env(), cwd=place.app)
    assert plain.stdout == "float64 raise float64\n"
    place.warm("env.py")
    for attempt in range(4):  # (as both(): until a server that preloads it all runs it)
        before = place.runs("env.py")
        served = place.kiln("env.py")
        assert served.stdout == plain.stdout, served.stderr
        if place.runs("env.py") == before + 1:
            break
        time.sleep(3)
        place.wait_server("env.py")
    assert place.runs("env.py") == before + 1
    assert "traces: 0" in SUMMARY.search(served.stderr).group(0)
    # one server for the program
    assert len([s for s in place.servers() if s.get("target") == "env.py"]) == 1
    listed = run_child([sys.executable, "-m", "kiln", "server", "ls"], env=place.env())
    assert listed.returncode == 0 and listed.stdout.count("env.py") == 1, listed.stdout


SANDBOX = """
import os, resource
print(resource.getrlimit(resource.RLIMIT_NOFILE), os.nice(0), sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("wrapper", [("sh", "-c", 'ulimit -Sn 256; exec "$@"', "sh"),
                                     ("nice", "-n", "5"), ("taskset", "-c", "0")],
                         ids=["ulimit", "nice", "taskset"])
def test_a_run_in_another_sandbox_is_served_by_a_server_in_that_sandbox(
        place: Place, wrapper: tuple[str, ...]) -> None:
    # limits, niceness and affinity are the command's, as under python: a fork of a server
    # started outside them would not have them (the sandbox is part of the server's key)
    if shutil.which(wrapper[0]) is None:
        pytest.skip(f"no {wrapper[0]} here")
    (place.app / "sandbox.py").write_text(SANDBOX)
    plain = run_child([sys.executable, "sandbox.py"], env=place.env(), cwd=place.app)
    wrapped = run_child([*wrapper, sys.executable, "sandbox.py"], env=place.env(),
                        cwd=place.app)
    assert wrapped.returncode == 0 and wrapped.stdout != plain.stdout, wrapped.stderr
    place.warm("sandbox.py")
    assert place.kiln("sandbox.py").stdout == plain.stdout
    outside = place.runs("sandbox.py")
    for attempt in range(4):
        served = run_child([*wrapper, sys.executable, "-m", "kiln", "run", "--server",
                            "sandbox.py"], env=place.env(), cwd=place.app)
        assert (served.returncode, served.stdout) == (0, wrapped.stdout), (attempt, served.stderr)
        if place.runs("sandbox.py") > outside + attempt:
            break  # (served by the server the first wrapped run started)
        time.sleep(3)
    assert place.runs("sandbox.py") > outside
    assert len([s for s in place.servers() if s.get("target") == "sandbox.py"]) == 2


def test_a_malformed_message_or_a_silent_connection_never_ends_or_holds_up_the_server(
        place: Place) -> None:
    place.warm("prog.py", "argv")
    both(place, "argv", "x")  # (the record settled: the next runs are served by this server)
    meta = place.server_of("prog.py")
    assert meta is not None
    sock = os.path.join(place.server_dir, meta["key"][:20] + ".sock")
    garbage = [b"not json\n", b'{"op": "run", "key": "%s", "own_dir": [1]}\n'
               % meta["key"].encode(), b'[1, 2]\n', b'{"op": 7}\n', b"\xff\xfe\n"]
    for message in garbage:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(sock)
            conn.sendall(message)
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                conn.recv(4096)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(sock)  # (sends nothing, stays open while the runs below are served)
    try:
        before = place.runs("prog.py")
        for _ in range(2):
            assert place.kiln("prog.py", "argv", "x").stdout.startswith("['prog.py', 'argv'")
        assert place.runs("prog.py") == before + 2  # the same server, still serving
    finally:
        silent.close()


def test_from_the_second_run_on_one_server_serves_the_program(place: Place) -> None:
    # (before: the first served run recorded kiln's own server modules as the program's, so
    # the third run was plain and started a second server)
    place.warm("prog.py", "jit")
    for _ in range(3):
        assert place.kiln("prog.py", "jit").returncode == 0
    assert place.runs("prog.py") == 3
    assert len([s for s in place.servers() if s.get("target") == "prog.py"]) == 1


def test_a_working_copy_a_program_puts_first_on_sys_path_is_the_one_a_served_run_imports(
        place: Place) -> None:
    # an older copy is installed (on PYTHONPATH); the program's working copy goes first
    (place.lib / "wc_lib.py").write_text("VALUE = 'installed'\n")
    src = place.root / "src"
    src.mkdir()
    (src / "wc_lib.py").write_text("VALUE = 'working copy'\n")
    _lib_program(place, f"import sys\nsys.path.insert(0, {str(src)!r})\nimport wc_lib\n"
                 "print(wc_lib.VALUE)\n")
    time.sleep(2.1)  # (a file younger than the server's start makes it refuse to serve)
    place.warm("libuser.py")
    for attempt in range(3):
        before = place.runs("libuser.py")
        assert place.kiln("libuser.py").stdout == "working copy\n"
        if place.runs("libuser.py") == before + 1:
            break  # (served, with the working copy imported by the run itself)
        place.wait_server("libuser.py")
    assert place.runs("libuser.py") == before + 1


NETWORK = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    print("reached")
except OSError as e:
    print("unreachable", type(e).__name__)
"""


def test_a_run_in_a_network_namespace_of_its_own_never_reaches_the_network(
        place: Place) -> None:
    # unshare -n kiln run --server: a server outside the namespace would reach the network the
    # sandbox removed; the namespace is the command's own, so no server is started either
    if run_child(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("unshare -n is not allowed here")
    (place.app / "network.py").write_text(NETWORK)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = str(listener.getsockname()[1])
        outside = place.kiln("network.py", port)
        assert outside.stdout == "reached\n"
        python = run_child(["unshare", "-n", sys.executable, "network.py", port],
                           env=place.env(), cwd=place.app)
        assert python.stdout.startswith("unreachable")
        place.wait_server("network.py")
        servers = len(place.servers())
        for _ in range(2):
            inside = run_child(["unshare", "-n", sys.executable, "-m", "kiln", "run", "--server",
                                "network.py", port], env=place.env(), cwd=place.app)
            assert inside.stdout == python.stdout, inside.stderr
        assert len(place.servers()) == servers  # (none started in the command's namespace)
