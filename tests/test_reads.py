"""What a trace reads from outside Python (kiln._keys._reads): recorded, keyed, re-checked.

Cross-process behaviour (run, change the file, run again) is in tests/test_staleness.py; these
tests pin the recorder's rules in one process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln
from kiln._keys import _reads
from kiln._keys._reads import DIR, FILE, STAT, ReadRecorder, check_read, check_stat


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _old(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-date a file past the racy window, so its stat is recorded (its change time, which
    no call back-dates, is taken as old enough: the clock is the test's)."""
    t = time.time() - 60
    os.utime(path, (t, t))
    monkeypatch.setattr(_reads, "_RACY_FINE_NS", 0)


def test_files_and_listings_are_recorded_by_content(cwd: Path, monkeypatch) -> None:
    (cwd / "cfg.json").write_text('{"scale": 2.0}')
    (cwd / "data").mkdir()
    (cwd / "data" / "b").write_text("")
    (cwd / "data" / "a").write_text("")
    _old(cwd / "cfg.json", monkeypatch)
    with ReadRecorder() as r:
        with open("cfg.json") as fh:
            json.load(fh)
        os.listdir("data")
        try:
            open("missing.json")
        except FileNotFoundError:
            pass
        open("out.txt", "w").close()  # written only: an output, not an input
    items = r.items()
    assert r.unkeyable is None
    assert [i[:2] for i in items] == [["cfg.json", FILE], ["data", DIR], ["missing.json", FILE]]
    cfg, data, missing = items
    st = (cwd / "cfg.json").stat()
    assert cfg[3] == f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    assert missing[2] == "absent"
    assert all(check_read(*i) is None for i in items)
    (cwd / "cfg.json").write_text('{"scale": 3.0}')
    assert check_read(*cfg) == "cfg.json changed"
    (cwd / "data" / "c").write_text("")
    assert check_read(*data) == "listing of data changed"
    (cwd / "missing.json").write_text("{}")
    assert check_read(*missing) == "missing.json exists now (absent when the entry was made)"
    os.remove("cfg.json")
    assert check_read(*cfg) == "cfg.json no longer exists"


def test_a_warm_check_stats_first_and_reads_when_the_stat_moved(cwd: Path, monkeypatch) -> None:
    f = cwd / "w.npy"
    np.save(f, np.ones(3, np.float32))
    _old(f, monkeypatch)
    with ReadRecorder() as r:
        np.load("w.npy")
    (item,) = r.items()
    st = f.stat()
    assert check_read(*item) is None  # (a stat: unchanged)
    # same content, new mtime: read again, found equal
    os.utime(f, (time.time(), time.time()))
    assert check_read(*item) is None
    # new content behind the recorded size and mtime (as `cp -p` or a restore leaves it): its
    # change time moved, which no call sets back, so it is read, and found changed
    np.save(f, np.full(3, 2.0, np.float32))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert check_read(*item) == "w.npy changed"


def test_a_file_modified_just_now_is_always_read_again(cwd: Path) -> None:
    (cwd / "cfg.json").write_text("1")
    with ReadRecorder() as r:
        with open("cfg.json") as fh:
            fh.read()
    (item,) = r.items()
    assert item[3] == ""  # racy: no stat shortcut (a write in the same mtime tick)
    st = (cwd / "cfg.json").stat()
    (cwd / "cfg.json").write_text("2")
    os.utime(cwd / "cfg.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert check_read(*item) == "cfg.json changed"


def test_threads_the_trace_starts_count_and_threads_running_before_do_not(cwd: Path) -> None:
    """A thread started while recording reads for the trace (a ThreadPoolExecutor the trace
    submits to); a thread that was running before the recording opened is not watched (a
    documented limit), and neither is a thread once the recording has closed."""
    import queue

    for name in ("mine", "child", "grandchild", "before", "after"):
        (cwd / name).write_text("")
    jobs: queue.Queue[str | None] = queue.Queue()
    done: queue.Queue[str] = queue.Queue()

    def worker() -> None:
        while (name := jobs.get()) is not None:
            open(name).close()
            done.put(name)

    running = threading.Thread(target=worker)
    running.start()

    def child() -> None:
        open("child").close()
        t = threading.Thread(target=lambda: open("grandchild").close())
        t.start()
        t.join()

    with ReadRecorder() as r:
        t = threading.Thread(target=child)
        t.start()
        t.join()
        jobs.put("before")
        assert done.get() == "before"
        open("mine").close()
        go = threading.Event()
        late = threading.Thread(target=lambda: (go.wait(), open("after").close()))
        late.start()
    go.set()
    late.join()
    jobs.put(None)
    running.join()
    assert [i[0] for i in r.items()] == ["child", "grandchild", "mine"]
    assert threading.Thread.start.__module__ == "threading" and os.stat.__module__ == "posix"


def test_libraries_imports_and_ignored_directories_are_not_inputs(cwd: Path) -> None:
    (cwd / "store").mkdir()
    (cwd / "store" / "entry").write_text("x")
    with ReadRecorder(ignore=(str(cwd / "store"),)) as r:
        open(np.__file__).close()  # an installed library's file: counted by its version
        open("store/entry").close()
        import colorsys  # noqa: F401  (the import system's own reads)
    assert r.items() == [] and r.unkeyable is None


def test_package_data_read_through_a_loader_is_the_user_s_read(
    cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pkgutil.get_data`` reads through the import system's loader (``get_data``): the data
    is the program's input; the import system importing a module stays machinery."""
    import importlib.resources
    import pkgutil

    (cwd / "udata").mkdir()
    (cwd / "udata" / "__init__.py").write_text("")
    (cwd / "udata" / "coeffs.txt").write_text("2.0")
    (cwd / "udata" / "scale.txt").write_text("5.0")
    (cwd / "ulater.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(cwd))
    import udata  # noqa: F401

    with ReadRecorder() as r:
        assert pkgutil.get_data("udata", "coeffs.txt") == b"2.0"
        assert importlib.resources.files("udata").joinpath("scale.txt").read_text() == "5.0"
        import ulater  # noqa: F401  (imported while recording: not a read)
    assert [i[:2] for i in r.items()] == [[str(cwd / "udata" / "coeffs.txt"), FILE],
                                         [str(cwd / "udata" / "scale.txt"), FILE]]
    monkeypatch.delitem(sys.modules, "udata")
    monkeypatch.delitem(sys.modules, "ulater")


@pytest.mark.parametrize(("database", "uri", "keyed"), [
    ("p.db", False, ["p.db", "p.db-journal", "p.db-wal"]),
    ("file:p.db?mode=ro", True, ["file:p.db?mode=ro", "file:p.db?mode=ro-journal",
                                 "file:p.db?mode=ro-wal", "p.db", "p.db-journal", "p.db-wal"]),
    (":memory:", False, []),
    ("", False, []),
    ("file:p.db?mode=memory", True, ["file:p.db?mode=memory", "file:p.db?mode=memory-journal",
                                     "file:p.db?mode=memory-wal"]),
])
def test_a_sqlite_database_is_keyed_with_its_companion_files(
    cwd: Path, database: str, uri: bool, keyed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database file and its -wal / -journal companions by content (a file: URI by its
    path, and by the name as given: the event does not say whether uri=True); an in-memory
    or a temporary database is no file."""
    import sqlite3

    with sqlite3.connect("p.db") as db:
        db.execute("CREATE TABLE t (v REAL)")
    db.close()
    _old(cwd / "p.db", monkeypatch)
    with ReadRecorder() as r:
        sqlite3.connect(database, uri=uri).close()
    items = r.items()
    assert r.unkeyable is None
    assert [i[0] for i in items] == keyed and all(i[1] == FILE for i in items)
    for path, _, digest, _stat in items:
        assert (digest == "absent") == (path != "p.db")
    if "p.db" in keyed:
        with sqlite3.connect("p.db") as db:
            db.execute("INSERT INTO t VALUES (1.0)")
        db.close()
        assert check_read(*next(i for i in items if i[0] == "p.db")) == "p.db changed"


def test_path_checks_are_keyed_by_what_they_see(cwd: Path, monkeypatch) -> None:
    """Existence and type checks open nothing: os.stat, os.lstat and os.access are wrapped
    while a recording is open, and each check is keyed by what it could see."""
    (cwd / "there.json").write_text("{}")
    _old(cwd / "there.json", monkeypatch)
    with ReadRecorder() as r:
        assert os.stat is not os.stat.__wrapped__  # type: ignore[attr-defined]
        assert os.stat in os.supports_dir_fd  # shutil.rmtree keeps its descriptor walk
        assert not os.path.exists("ovr.json")
        assert os.path.isfile("there.json")
        assert not Path("sub").is_dir()
        assert not os.path.lexists("link")
        st = os.stat("there.json")
        assert os.access("there.json", os.R_OK)
    assert os.stat.__module__ == "posix" and not hasattr(os.stat, "__wrapped__")
    items = r.items()
    assert r.unkeyable is None
    assert [i[0] for i in items if i[1] != STAT] == []
    checks = {(i[0], i[3]): i[2] for i in items}
    assert checks == {
        ("ovr.json", "type"): "absent", ("there.json", "type"): "file",
        ("sub", "type"): "absent", ("link", "ltype"): "absent",
        ("there.json", "stat"): (f"{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:"
                                 f"{st.st_dev}:{st.st_nlink}:{st.st_uid}:{st.st_gid}"),
        ("there.json", f"access:{os.R_OK}:0:1"): "1",
    }
    assert all(check_stat(i[0], i[2], i[3]) is None for i in items)
    (cwd / "ovr.json").write_text("{}")
    (cwd / "sub").mkdir()
    os.symlink("there.json", cwd / "link")
    os.utime(cwd / "there.json")
    by = {(i[0], i[3]): i for i in items}
    assert check_stat(*by["ovr.json", "type"][::2], "type") == (
        "ovr.json exists now (absent when the entry was made)")
    assert check_stat("sub", "absent", "type") is not None
    assert check_stat("link", "absent", "ltype") is not None
    assert check_stat("there.json", checks["there.json", "type"], "type") is None  # still a file
    assert check_stat("there.json", checks["there.json", "stat"], "stat") is not None  # touched
    os.remove(cwd / "there.json")
    assert check_stat("there.json", "file", "type") == "there.json no longer exists"


def test_a_check_that_changes_while_tracing_is_unkeyable(cwd: Path) -> None:
    with ReadRecorder() as r:
        if not os.path.exists("made.txt"):
            open("made.txt", "w").close()
    assert r.items() == [] and r.unkeyable == "made.txt changed while the function was traced"


def test_a_check_relative_to_a_directory_descriptor_is_unkeyable(cwd: Path) -> None:
    fd = os.open(".", os.O_RDONLY)
    try:
        with ReadRecorder() as r:
            with pytest.raises(FileNotFoundError):
                os.stat("nothing", dir_fd=fd)
    finally:
        os.close(fd)
    assert r.items() == [] and "dir_fd" in (r.unkeyable or "")


@pytest.mark.skipif(sys.version_info < (3, 12), reason="_thread.start_new_thread is audited "
                    "from Python 3.12")
def test_a_thread_started_without_threading_is_unkeyable(cwd: Path) -> None:
    import _thread

    done = threading.Event()
    with ReadRecorder() as r:
        _thread.start_new_thread(done.set, ())
        done.wait()
    assert r.items() == [] and "cannot follow" in (r.unkeyable or "")


@pytest.mark.parametrize("what", ["device", "changed", "socket", "subprocess", "fd", "proc"])
def test_what_cannot_be_keyed_is_unkeyable_with_the_reason(cwd: Path, what: str) -> None:
    with ReadRecorder() as r:
        if what == "device":
            open("/dev/urandom", "rb").close()
        elif what == "changed":
            with open("log.txt", "a") as fh:
                fh.write("+")
            open("log.txt").close()
        elif what == "socket":
            with socket.socket() as server, socket.socket() as client:
                server.bind(("127.0.0.1", 0))
                server.listen()
                client.connect(server.getsockname())
        elif what == "subprocess":
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        elif what == "fd":
            read_end, write_end = os.pipe()
            os.close(write_end)
            with open(read_end) as fh:
                fh.read()
        else:
            open("/proc/self/status").close()
    assert r.items() == []
    want = {"device": "/dev/urandom: it is a device", "changed": "log.txt changed while",
            "socket": "connects a socket", "subprocess": "starts a subprocess",
            "fd": "reads file descriptor", "proc": "the system's state"}[what]
    assert r.unkeyable is not None and want in r.unkeyable, r.unkeyable


def test_kiln_jit_keys_the_file_and_explains_the_verify_path(
    cwd: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (cwd / "cfg.json").write_text('{"scale": 2.0}')

    @kiln.jit
    def f(x):
        with open("cfg.json") as fh:
            return x * json.load(fh)["scale"]

    @kiln.jit
    def g(x):
        open("/dev/urandom", "rb").close()
        return x + 1.0

    kiln.configure(explain=True)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert float(f(jnp.float32(1.0))) == 2.0
        assert float(g(jnp.float32(1.0))) == 2.0
    assert kiln.stats().reasons["verify-path"] == 1
    assert "taking the verify path: the trace reads /dev/urandom: it is a device" in caplog.text


def test_kiln_s_own_writes_through_jax_s_cache_while_tracing_are_not_reads(cwd: Path) -> None:
    """An eager operation inside a trace compiles, and the kiln:// route writes JAX's cache
    value into kiln's store (``os.fdopen`` of a temporary file) while the trace runs: neither
    an input nor a reason for the verify path (it sent the Lotka-Volterra fit there)."""

    @kiln.jit
    def f(x):
        with jax.ensure_compile_time_eval():  # eager ops, compiled now (as libraries do)
            n = float(jnp.sum(jnp.arange(4.0) * 2.0))
        return x * n

    kiln.enable_jax_cache()
    assert float(f(jnp.float32(1.0))) == 12.0
    assert kiln.stats().jax_cache_writes >= 1
    assert kiln.stats().reasons["verify-path"] == 0


def test_a_written_file_descriptor_is_an_output(cwd: Path) -> None:
    with ReadRecorder() as r:
        fd = os.open("out.bin", os.O_WRONLY | os.O_CREAT)
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"x")
    assert r.items() == [] and r.unkeyable is None


def test_kiln_s_own_store_connection_while_tracing_is_not_the_trace_s(
    cwd: Path, redis_url: str
) -> None:
    """kiln reading its Redis store while a trace runs (a kiln.noinline function compiled
    inside it, a lease renewed): redis-py connects a socket on kiln's behalf, which is no
    input of the program. A socket the user's code connects is (see above)."""
    from kiln.stores import open_store

    with kiln.config_context(store=redis_url, signing_key="k", remote_mode="remote-only"):
        with ReadRecorder() as r:
            store = open_store(kiln.get_config(), layered=False)
            assert store.get("0" * 64) is None  # the first operation connects
    assert r.items() == [] and r.unkeyable is None, r.unkeyable


def test_a_directory_s_raw_stat_and_samefile_count_by_what_the_path_is(tmp_path):
    """jax 0.12 compares paths with ``os.path.samefile`` while tracing (its traceback filter);
    a directory's size and mtime move whenever an entry is added, so a directory counts by
    type, device and inode, and a new file in it changes nothing, while a path that becomes
    another directory does."""
    from kiln._keys._manifest import check_manifest
    from kiln._keys._reads import ReadRecorder

    d = tmp_path / "data"
    d.mkdir()
    with ReadRecorder() as rec:
        os.path.samefile(str(d), str(tmp_path / "data"))
        os.stat(str(d))
    items = rec.items()
    assert items and {i[3] for i in items} == {"ident", "stat"}, items
    (d / "new.txt").write_text("x")
    assert check_manifest(items) is None
    d.rename(tmp_path / "old")
    (tmp_path / "data").mkdir()
    assert check_manifest(items) is not None
