"""Entry format, stores (LRU, atomicity, many processes), config, public surface."""

from __future__ import annotations

import multiprocessing
import os
import stat
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

import kiln
from kiln._base import decode, encode, is_key, peek_header
from kiln._base._config import parse_size
from kiln.stores import LocalStore, MemoryStore, NullStore, Store, open_store


def _key(i: int) -> str:
    return f"{i:064x}"


# --------------------------------------------------------------------------- entries
def test_entry_round_trip_and_header_peek():
    blob = encode({"function": "m.f", "n": 1}, {"exec": b"\x00\x01", "meta": b"abc"},
                  signing_key=None)
    entry = decode(blob, signing_key=None)
    assert entry.header["function"] == "m.f"
    assert entry.sections == {"exec": b"\x00\x01", "meta": b"abc"}
    assert peek_header(blob)["n"] == 1


@pytest.mark.parametrize(("text", "key", "digest"), [
    ("ab" * 32, True, True),  # a key: 64 lowercase hex characters
    (_key(7), True, True),
    ("ab" * 16, False, True),  # a fingerprint or static digest: 32
    ("ab" * 40, False, True),
    ("a" * 63, False, True),
    ("a" * 65, False, True),
    ("a" * 31, False, False),
    ("AB" * 32, False, False),  # uppercase
    ("g" + "a" * 63, False, False),
    ("../" + "a" * 61, False, False),
    ("", False, False),
    (b"ab" * 32, False, False),  # bytes, not text
    (None, False, False),
])
def test_is_key(text, key, digest):
    """One is_key for every check of a key (stores, bundles, the CLI, KILN_EXPLAIN's
    shortened digests), so that they all accept and refuse the same text."""
    assert is_key(text) is key
    assert is_key(text, digest=True) is digest


def test_stores_refuse_what_is_not_a_key(tmp_path):
    store = LocalStore(tmp_path / "s")
    for bad in ("ab" * 16, "AB" * 32, "../" + "a" * 61):
        with pytest.raises(ValueError, match="lowercase hex"):
            store.get(bad)
    assert store.get("ab" * 32) is None


@pytest.mark.parametrize("cut", [0, 5, 31, 40, -1])
def test_truncated_entry_is_refused(cut):
    blob = encode({"a": 1}, {"exec": b"x" * 100}, signing_key=None)
    with pytest.raises(kiln.EntryError):
        decode(blob[:cut], signing_key=None)


def test_every_single_byte_flip_is_detected():
    blob = encode({"a": 1}, {"exec": b"payload" * 3}, signing_key="k")
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(kiln.EntryError):
            decode(bytes(bad), signing_key="k")


def test_signature_under_other_key_is_refused():
    blob = encode({"a": 1}, {"exec": b"x"}, signing_key="alice")
    with pytest.raises(kiln.EntryError, match="digest mismatch"):
        decode(blob, signing_key="mallory")
    with pytest.raises(kiln.EntryError, match="no signing_key"):
        decode(blob, signing_key=None)


# --------------------------------------------------------------------------- stores
@pytest.mark.parametrize("make", [lambda p: LocalStore(p), lambda p: MemoryStore()])
def test_store_protocol(tmp_path, make):
    store = make(tmp_path / "s")
    assert isinstance(store, Store)
    blob = encode({"function": "m.f"}, {"exec": b"1"}, signing_key=None)
    assert store.get(_key(1)) is None and store.delete(_key(1)) is False
    store.put(_key(1), blob)
    assert store.get(_key(1)) == blob
    assert list(store.iter()) == [_key(1)]
    assert store.stat(_key(1)).size == len(blob)
    assert store.header(_key(1))["function"] == "m.f"
    assert store.delete(_key(1)) is True and list(store.iter()) == []


def test_null_store_stores_nothing():
    s = NullStore()
    s.put(_key(1), b"x")
    assert s.get(_key(1)) is None and list(s.iter()) == []


def test_local_store_is_private(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put(_key(1), b"x" * 10)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    (path,) = (tmp_path / "s" / "entries").glob("*/*.kiln")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_lru_eviction_keeps_recently_used(tmp_path):
    store = LocalStore(tmp_path / "s", max_size=350)
    for i in range(3):
        store.put(_key(i), b"x" * 100)
    store.get(_key(0))  # 0 is now more recent than 1
    store.put(_key(3), b"x" * 100)  # 400 > 350: evict the least recently used (1)
    assert sorted(store.iter()) == [_key(0), _key(2), _key(3)]
    assert store.total_size() == 300


def test_prune_dry_run_and_real(tmp_path):
    store = LocalStore(tmp_path / "s")
    for i in range(4):
        store.put(_key(i), b"x" * 100)
    assert len(store.prune(150, dry_run=True)) == 3
    assert len(list(store.iter())) == 4
    assert store.prune(150) == [_key(0), _key(1), _key(2)]
    assert list(store.iter()) == [_key(3)]


def test_index_rebuilt_when_lost_or_corrupt(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put(_key(1), b"x" * 10)
    (tmp_path / "s" / "index.sqlite").write_bytes(b"not a database at all" * 100)
    fresh = LocalStore(tmp_path / "s")
    assert fresh.total_size() == 10
    assert fresh.get(_key(1)) == b"x" * 10


def test_special_files_at_entry_paths(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put(_key(1), b"x")
    path = next((tmp_path / "s" / "entries").glob("*/*.kiln"))
    path.unlink()
    path.symlink_to("/dev/zero")  # never read through a link (it would never end)
    with pytest.raises(OSError, match="symlink"):
        store.get(_key(1))
    path.unlink()
    path.mkdir()  # a directory where an entry should be: refused, then replaced by put
    with pytest.raises(OSError):
        store.get(_key(1))
    store.put(_key(1), b"y")
    assert store.get(_key(1)) == b"y"


def test_temp_files_of_killed_writers_are_swept(tmp_path, children):
    """Temp files are removed only when no live writer can own them: their writer (host and
    pid in the name) has exited, or they are older than any write takes. A prune must never
    delete the temp file of a writer in another process (a prune beside writers once lost 39
    of 60 entries)."""
    from kiln.stores import _local_files

    store = LocalStore(tmp_path / "s")
    store.put(_key(1), b"x")
    folder = next((tmp_path / "s" / "entries").iterdir())
    old = folder / ".0000000000000001.abc.tmp"
    old.write_bytes(b"half")
    os.utime(old, (1, 1))  # long ago
    unknown = folder / ".0000000000000001.def.tmp"  # an unknown writer: maybe alive
    unknown.write_bytes(b"half")
    exited = children.run_child([sys.executable, "-c", "import os; print(os.getpid())"],
                                check=True)
    dead_pid = int(exited.stdout)
    dead = folder / f".0000000000000001.{_local_files.HOST}.{dead_pid}.ghi.tmp"
    dead.write_bytes(b"half")
    live = folder / f".0000000000000001.{_local_files.HOST}.{os.getppid()}.jkl.tmp"
    live.write_bytes(b"half")
    mine = folder / f".0000000000000001.{_local_files.HOST}.{os.getpid()}.mno.tmp"
    mine.write_bytes(b"half")
    assert len(store.temp_files()) == 5
    # a writer sweeps a folder the first time it writes there (a process's first put; a
    # write per entry would cost a directory listing each)
    store = LocalStore(tmp_path / "s")
    store.put(_key(1), b"z")
    assert not old.exists() and not dead.exists()
    assert unknown.exists() and live.exists() and mine.exists()
    store.prune(10**9)
    assert unknown.exists() and live.exists() and mine.exists()
    assert store.get(_key(1)) == b"z"


def test_bad_key_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="hex"):
        LocalStore(tmp_path).get("../../etc/passwd")


def _writer(root: str, worker: int, rounds: int) -> None:
    store = LocalStore(root)
    for r in range(rounds):
        payload = bytes([worker]) * (50_000 + r)
        store.put(_key(r % 3), encode({"w": worker}, {"exec": payload}, signing_key=None))


def _reader(root: str, rounds: int, out) -> None:
    store = LocalStore(root)
    bad = 0
    for r in range(rounds):
        blob = store.get(_key(r % 3))
        if blob is not None:
            try:
                decode(blob, signing_key=None)
            except kiln.EntryError:
                bad += 1
    out.put(bad)


@pytest.mark.slow
def test_many_processes_never_see_half_written_entries(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    root = str(tmp_path / "s")
    LocalStore(root).put(_key(0), encode({}, {"exec": b"seed"}, signing_key=None))
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(root, w, 60)) for w in range(3)]
    procs += [ctx.Process(target=_reader, args=(root, 300, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert [out.get(timeout=10) for _ in range(2)] == [0, 0]
    assert not list((tmp_path / "s" / "entries").glob("*/*.tmp"))


def test_open_store_from_config(tmp_path):
    kiln.configure(store="memory")
    assert isinstance(open_store(kiln.get_config()), MemoryStore)
    kiln.configure(store="null")
    assert isinstance(open_store(kiln.get_config()), NullStore)
    kiln.configure(store=str(tmp_path / "d"))
    s = open_store(kiln.get_config())
    assert isinstance(s, LocalStore) and s.root == tmp_path / "d"


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "text, value",
    [("4GiB", 4 * 1024**3), ("500MB", 500_000_000), ("10k", 10_000), ("123", 123),
     ("1.5 MiB", 1572864)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_bad_env_var_names_variable(monkeypatch):
    monkeypatch.setenv("KILN_MAX_SIZE", "lots")
    with pytest.raises(kiln.ConfigError, match="KILN_MAX_SIZE"):
        kiln.get_config()
    monkeypatch.setenv("KILN_MAX_SIZE", "1GiB")
    monkeypatch.setenv("KILN_EXPLAIN", "maybe")
    with pytest.raises(kiln.ConfigError, match="KILN_EXPLAIN must be 1 or 0"):
        kiln.get_config()
    monkeypatch.setenv("KILN_EXPLAIN", "1")
    monkeypatch.setenv("KILN_STORE", "bogus://x")
    with pytest.raises(kiln.ConfigError, match="unknown store scheme 'bogus'"):
        kiln.get_config()


def test_unknown_setting():
    with pytest.raises(kiln.ConfigError, match="unknown kiln setting 'cache_size'"):
        kiln.configure(cache_size=1)


def test_precedence_context_over_configure_over_env(monkeypatch, tmp_path):
    kiln.configure(max_size=None)
    monkeypatch.setenv("KILN_MAX_SIZE", "1000")
    assert kiln.get_config().max_size == 1000
    kiln.configure(max_size=2000)
    assert kiln.get_config().max_size == 2000
    with kiln.config_context(max_size=3000) as cfg:
        assert cfg.max_size == 3000 and kiln.get_config().max_size == 3000
    assert kiln.get_config().max_size == 2000
    kiln.configure(max_size=None)
    assert kiln.get_config().max_size == 1000


def test_default_cache_dir_is_user_cache(monkeypatch):
    kiln.configure(cache_dir=None)
    assert "kiln" in str(kiln.get_config().cache_dir)
    monkeypatch.setenv("KILN_CACHE_DIR", "")
    assert kiln.get_config().cache_dir.is_absolute()
    monkeypatch.setenv("KILN_CACHE_DIR", "/tmp/somewhere")
    assert str(kiln.get_config().cache_dir) == "/tmp/somewhere"


# --------------------------------------------------------------------------- public surface
def test_public_surface_is_pinned():
    # "@py_builtins" / "@pytest_ar": pytest's assertion rewriting, which pytest applies to every
    # package of a distribution that ships a pytest11 plugin (kiln's: kiln_pytest)
    public = sorted(n for n in dir(kiln) if not n.startswith(("_", "@")))
    public = [n for n in public if n not in {"stores"}]
    assert sorted(kiln.__all__) == kiln.__all__
    assert public == kiln.__all__


def test_stores_public_surface_is_pinned():
    """kiln.stores.__all__ is the public names only: the Store protocol and its
    capabilities, the backends, open_store and wait_for_uploads (docs/fleets.md). What the face
    binds for kiln's own layers (single-flight, store faults) is not in it."""
    import kiln.stores

    assert kiln.stores.__all__ == sorted(kiln.stores.__all__)
    assert kiln.stores.__all__ == [
        "Checkable", "Counting", "EntryStat", "LayeredStore", "Leasable", "Lease", "LocalStore",
        "Maintainable", "MemoryStore", "NullStore", "Peekable", "Prunable", "Replaceable",
        "Store", "open_store", "wait_for_uploads",
    ]
    assert all(hasattr(kiln.stores, n) for n in kiln.stores.__all__)


def test_index_rows_of_writes_are_batched_and_a_row_lost_to_a_crash_comes_back(
    tmp_path: Path, children: ModuleType,
) -> None:
    """A put writes the entry file at once and its index row with the next batch (a commit
    per put took 2 ms of the 4.6 a put cost). A process killed before the batch is recorded
    loses rows, never entries: the entry is read as usual, its row is written again at that
    read, and ``prune`` reconciles the index with the directory."""
    root = tmp_path / "s"
    script = (
        "import os\n"
        "from kiln.stores import LocalStore\n"
        f"s = LocalStore({str(root)!r})\n"
        f"s.put({_key(1)!r}, b'a' * 100)\n"  # a process's first put records at once
        f"s.put({_key(2)!r}, b'b' * 200)\n"  # recorded with the next batch, or at exit
        f"s.put({_key(3)!r}, b'c' * 400)\n"
        "os._exit(0)\n"  # killed: no batch, no exit handler
    )
    children.run_child([sys.executable, "-c", script],
                       env=children.child_env(KILN_JAX_CACHE="0"), check=True)
    store = LocalStore(root)
    assert set(store.iter()) == {_key(1), _key(2), _key(3)}  # every entry is there, whole
    assert store.total_size() == 100  # only the first row reached the index
    assert store.get(_key(2)) == b"b" * 200
    store.flush()
    assert store.total_size() == 300  # the read wrote its row again
    assert store.prune(10**9) == []
    assert store.total_size() == 700  # prune reconciled the last one


_FORK_SCRIPT = """
import os, sys, time
from kiln.stores import LocalStore
store = LocalStore(sys.argv[1])
key = "ab" * 32
lease = store.lease(key, 30)
assert lease.acquire()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: outlives the parent's release
    os.close(read)
    os.write(write, b"up")
    time.sleep(30)
    os._exit(0)
os.close(write)
assert os.read(read, 2) == b"up"
other = store.lease(key, 30)
held_by_parent = other.acquire()
lease.release()
free_after_release = other.acquire()
os.kill(pid, 9)
os.waitpid(pid, 0)
print(held_by_parent, free_after_release)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_keep_its_parent_s_lease(tmp_path: Path,
                                                         children: ModuleType) -> None:
    """A lease is an flock, which belongs to the open file and is shared across fork: a child
    forked while its parent compiles closes its copy, so the parent's release frees the key.
    (In a fresh process: forking this one, with JAX's threads, is not safe.)"""
    proc = children.run_child([sys.executable, "-c", _FORK_SCRIPT, tmp_path / "s"],
                              env=children.child_env(KILN_JAX_CACHE="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]  # held by the parent; then free at once


def test_leases_lock_a_byte_each_of_one_file(tmp_path: Path, children: ModuleType) -> None:
    """On Linux a lease is an OFD lock on one byte of ``leases/keys.lock``: no file is created
    per key (a miss's read through the kiln:// route: 0.34 -> 0.16-0.21 ms, docs/benchmarks.md),
    and leases still exclude each other per key, within a process too."""
    from kiln.stores import _local_lease

    if not _local_lease.OFD:
        pytest.skip("no open-file-description locks on this system")
    store = LocalStore(tmp_path / "s")
    held = store.lease(_key(1), 30)
    assert held.acquire()
    assert store.lease(_key(1), 30).acquire() is False  # another descriptor, same process
    other = store.lease(_key(2), 30)
    assert other.acquire() is True  # another key
    assert sorted(p.name for p in (tmp_path / "s" / "leases").rglob("*")) == ["keys.lock"]
    code = (f"from kiln.stores import LocalStore; s = LocalStore({str(tmp_path / 's')!r}); "
            f"print(s.lease({_key(1)!r}, 30).acquire(), s.lease({_key(3)!r}, 30).acquire())")
    proc = children.run_child([sys.executable, "-c", code],
                              env=children.child_env(KILN_JAX_CACHE="0"), timeout=120)
    assert proc.stdout.split() == ["False", "True"], proc.stderr
    held.release()
    other.release()
    again = store.lease(_key(1), 30)
    assert again.acquire() is True
    assert again.acquire() is True  # held already: the same lock, not a second one
    again.release()
    last = store.lease(_key(1), 30)
    assert last.acquire() is True  # one release frees it
    last.release()


_FORK_CHILD_RELEASE_SCRIPT = """
import os, sys
from kiln.stores import LocalStore
store = LocalStore(sys.argv[1])
lease = store.lease("ab" * 32, 30)
assert lease.acquire()
pid = os.fork()
if pid == 0:
    # the child: its copy of the lock's descriptor was closed at the fork, so its next file
    # may get that number; releasing the inherited lease must leave that file alone
    path = os.path.join(sys.argv[1], "child-file")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    mine = store.lease("cd" * 32, 30)
    assert mine.acquire()
    lease.release()
    ok = os.write(fd, b"still open") == 10
    other = LocalStore(sys.argv[1]).lease("cd" * 32, 30)
    print(ok, other.acquire(), store.lease("ab" * 32, 30).acquire(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
lease.release()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_releasing_an_inherited_lease_closes_nothing_of_its_own(
        tmp_path: Path, children: ModuleType) -> None:
    """A lease taken before a fork, released in the child (kiln's route does that on the
    child's first miss), used to close whatever file of the child's had got the lease's
    descriptor number: the child's own file, or its own lease on another key."""
    proc = children.run_child([sys.executable, "-c", _FORK_CHILD_RELEASE_SCRIPT, tmp_path],
                              env=children.child_env(KILN_JAX_CACHE="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the child's file still writable; its own lease still held; the parent's still held
    assert proc.stdout.split() == ["True", "False", "False"]


_FORK_MID_ACQUIRE_SCRIPT = """
import os, sys, threading, time
from kiln.stores import LocalStore
from kiln.stores._local_lease import OFD, fcntl
store = LocalStore(sys.argv[1])
key = "ab" * 32
in_window, real = threading.Event(), fcntl.fcntl if OFD else fcntl.flock

def slow(*args):  # the system call of a lease another thread is taking, made slow
    in_window.set()
    time.sleep(0.5)
    return real(*args)

setattr(fcntl, "fcntl" if OFD else "flock", slow)
lease = store.lease(key, 30)
taker = threading.Thread(target=lease.acquire)
taker.start()
assert in_window.wait(30)
read, write = os.pipe()
pid = os.fork()  # in the middle of that acquire: the fork waits for it
if pid == 0:
    os.write(write, b"up")  # (after its fork handlers ran)
    time.sleep(30)
    os._exit(0)
assert os.read(read, 2) == b"up"
taker.join()
setattr(fcntl, "fcntl" if OFD else "flock", real)
lease.release()
print(LocalStore(sys.argv[1]).lease(key, 30).acquire(), flush=True)  # the child is alive
os.kill(pid, 9)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_during_another_thread_s_acquire_leaves_the_child_no_lock(
        tmp_path: Path, children: ModuleType) -> None:
    """A fork between another thread's open of the lock file and its lock (or its unlock and
    close) used to give the child a descriptor holding the lock that the child never closed:
    the key stayed locked while the child lived, after the parent released it (215 of 300
    forks in a stress run)."""
    proc = children.run_child([sys.executable, "-c", _FORK_MID_ACQUIRE_SCRIPT, tmp_path],
                              env=children.child_env(KILN_JAX_CACHE="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]


@pytest.mark.parametrize("ofd", [False, True])
def test_lease_files_are_removed_by_prune_and_clear_but_never_a_held_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ofd: bool) -> None:
    """One lock file per key ever compiled used to stay forever. Where there are no
    OFD locks (macOS) a lease is such a file; on Linux the files an earlier kiln left are
    swept the same way."""
    from kiln.stores import _local_lease

    monkeypatch.setattr(_local_lease, "OFD", False)  # files, as on macOS (or an earlier kiln)
    store = LocalStore(tmp_path / "s")
    for i in (1, 2, 3):
        lease = store.lease(_key(i), 30)
        assert lease.acquire()
        store.put(_key(i), b"x")
        lease.release()
    held = store.lease(_key(4), 30)
    assert held.acquire()  # a compile in progress
    locks = sorted((tmp_path / "s" / "leases").glob("*/*.lock"))
    assert len(locks) == 4
    old = time.time() - _local_lease.LEASE_MIN_AGE - 5
    for path in locks:
        os.utime(path, (old, old))
    if ofd:
        monkeypatch.setattr(_local_lease, "OFD", _local_lease.fcntl is not None
                            and hasattr(_local_lease.fcntl, "F_OFD_SETLK"))
    store.prune(10**9)
    assert [p.stem for p in (tmp_path / "s" / "leases").glob("*/*.lock")] == [_key(4)]
    lease = store.lease(_key(1), 30)  # taken again after the sweep: works as before
    assert lease.acquire()
    lease.release()
    assert store.delete(_key(1))  # (kiln clear deletes each entry): its lock file goes too
    assert not (tmp_path / "s" / "leases" / _key(1)[:2] / f"{_key(1)}.lock").exists()
    held.release()
