"""The local store never crashes a program nor lets another user change its results.

Real file systems and real processes: a tmpfs remounted read-only or filled to the last byte,
stray files and directories in the store, a prune looping beside a compiling process, a store
directory writable by others with an entry planted by a second user (``nobody``, through
``setpriv``). Tests that need root (mount, setpriv) are skipped with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child, start_child

import kiln
from kiln._base import decode, encode
from kiln._cli import main

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mounting a tmpfs and setpriv need root")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    proc = run_child(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path])
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        run_child(["umount", "-l", path])


def _child(code: str, store: Path, *, env: dict[str, str] | None = None,
           user: str | None = None) -> dict:
    """Run ``code`` in a fresh Python process on store ``store``; it prints one JSON line."""
    prelude = textwrap.dedent('''\
        import json, warnings
        import jax.numpy as jnp, numpy as np
        import kiln
        caught = []
        warnings.simplefilter("always")
        _show = warnings.showwarning
        def _keep(message, category, *a, **k):
            caught.append(f"{category.__name__}: {message}")
        warnings.showwarning = _keep
        def out(**kw):
            s = kiln.stats()
            print(json.dumps({**kw, "warnings": caught, "hits": s.hits, "misses": s.misses,
                              "store_errors": s.store_errors,
                              "stores_written": s.stores_written}))
        ''')
    # KILN_JAX_CACHE=0: these tests count kiln's own entries (the kiln:// route would add the
    # child's eager operations; tests/test_jax_cache.py covers it)
    environment = child_env(KILN_CACHE_DIR=str(store), JAX_PLATFORMS="cpu", KILN_JAX_CACHE="0",
                            **(env or {}))
    cmd = [sys.executable, "-c", prelude + textwrap.dedent(code)]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    proc = run_child(cmd, env=environment, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


FILL = '''
f = kiln.jit(lambda x: x + 1)
out(y=np.asarray(f(jnp.ones(3))).tolist())
'''

# A warm hit of f, then 5 new functions that compile; results, warnings, counters.
WARM_AND_NEW = '''
f = kiln.jit(lambda x: x + 1)
ys = [np.asarray(f(jnp.ones(3))).tolist()]
hits_first = kiln.stats().hits
for k in range(5):
    g = kiln.jit(lambda x, k=k: x * k)
    ys.append(np.asarray(g(jnp.ones(3))).tolist())
out(ys=ys, hits_first=hits_first)
'''
WANT = [[2.0] * 3] + [[float(k)] * 3 for k in range(5)]


@needs_root
@pytest.mark.slow
def test_read_only_store_serves_hits_and_warns_once(tmp_path: Path) -> None:
    """Before: a read-only store raised sqlite3.OperationalError from the user's call."""
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        store = mnt / "kiln"
        assert _child(FILL, store)["y"] == [2.0] * 3
        run_child(["mount", "-o", "remount,ro", mnt], check=True)
        got = _child(WARM_AND_NEW, store)
    assert got["ys"] == WANT
    assert got["hits_first"] == 1  # read-only: hits still served, without a warning
    assert len(got["warnings"]) == 1, got["warnings"]
    assert got["warnings"][0].startswith("StoreWarning: kiln: cannot write to store")
    assert "compiling in memory" in got["warnings"][0]
    # (5 writes of entries, and the record of the guard the first call verified: this is
    # another program than the one that filled the store, another input of the guard)
    assert got["store_errors"] == 6 and got["stores_written"] == 0


@needs_root
@pytest.mark.slow
def test_full_store_serves_hits_and_warns_once(tmp_path: Path) -> None:
    """Before: 20 of 40 warm hits on a full disk raised 'database or disk is full'."""
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        store = mnt / "kiln"
        assert _child(FILL, store)["y"] == [2.0] * 3
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill it to its last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0")
                    f.flush()
        got = _child(WARM_AND_NEW, store)
    assert got["ys"] == WANT
    assert got["hits_first"] == 1
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "No space left on device" in got["warnings"][0] or "full" in got["warnings"][0]
    assert got["store_errors"] >= 1 and got["stores_written"] == 0


# -- stray files ---------------------------------------------------------------------------------
def _fill_with_strays(store: Path) -> list[Path]:
    kiln.configure(cache_dir=store)
    for k in range(3):
        kiln.jit(lambda x, k=k: x + k)(jnp.ones(2))
    entries = store / "entries"
    (entries / "ab").mkdir(mode=0o700, exist_ok=True)
    strays = [entries / "ab" / "notakey.kiln", entries / "ab" / "also-not-a-key.kiln",
              entries / "cd" / ("e" * 64 + ".kiln"), entries / "README"]
    strays[0].write_bytes(b"garbage")
    strays[1].write_bytes(b"more garbage")
    strays[2].mkdir(parents=True)
    (strays[2] / "inside").write_bytes(b"x")
    strays[3].write_text("not an entry folder")
    (store / "index.sqlite").unlink()  # the index lost: rebuilt from the directory
    return strays


def test_stray_files_never_crash_eviction_or_the_cli(
    kiln_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: prune died with ValueError, a kiln.jit call raised it under KILN_MAX_SIZE=1,
    verify printed '[Errno 21] Is a directory: 3', clear stopped halfway."""
    strays = _fill_with_strays(kiln_store)
    store_args = ["--cache-dir", str(kiln_store)]
    assert main(["prune", "--max-size", "1GB", *store_args]) == 0
    assert all(p.exists() for p in strays)  # not entries: never evicted as entries
    kiln.configure(max_size=1)  # every write evicts all others
    assert np.asarray(kiln.jit(lambda x: x * 7)(jnp.ones(2))).tolist() == [7.0, 7.0]
    kiln.configure(max_size=None)
    capsys.readouterr()

    assert main(["ls", *store_args]) == 0
    out, err = capsys.readouterr()
    assert "4 stray file(s)" in err
    keys = [line.split()[-1] for line in out.splitlines()[1:]]
    assert len(keys) == len(set(keys)) >= 1  # a key per row, each its own

    assert main(["verify", *store_args]) == 1
    out, _ = capsys.readouterr()
    for p in strays:
        assert f"BAD {p} stray: " in out, out
    assert "[Errno" not in out
    assert main(["stats", "--json", *store_args]) == 0
    assert json.loads(capsys.readouterr()[0])["stray_files"] == 4

    assert main(["verify", "--delete-bad", *store_args]) == 1
    assert out.count("BAD") == 4
    capsys.readouterr()
    assert not any(p.exists() for p in strays)
    assert main(["verify", *store_args]) == 0
    capsys.readouterr()

    strays = _fill_with_strays(kiln_store)
    assert main(["clear", "--yes", *store_args]) == 0
    out, _ = capsys.readouterr()
    assert "and 4 stray file(s)" in out
    assert not [p for p in (kiln_store / "entries").rglob("*") if p.is_file()]


# -- concurrent prune and writers -------------------------------------------------------------
@pytest.mark.slow
def test_a_looping_prune_loses_no_entry_of_a_writer(tmp_path: Path) -> None:
    """Before: a prune swept every temp file, so a concurrent writer lost 39 of 60 entries."""
    store = tmp_path / "kiln"
    stop = tmp_path / "stop"
    pruner = start_child(
        [sys.executable, "-c", textwrap.dedent(f'''\
            import os, sys
            from kiln._cli import main
            n = 0
            while not os.path.exists({str(stop)!r}):
                main(["prune", "--max-size", "1GB", "--cache-dir", {str(store)!r}])
                n += 1
            print("prunes", n)
            ''')],
        env=child_env(JAX_PLATFORMS="cpu", KILN_JAX_CACHE="0"), stderr=subprocess.DEVNULL,
    )
    try:
        got = _child('''
            ys = []
            for n in range(1, 31):
                ys.append(float(kiln.jit(lambda x: x.sum())(jnp.ones(n))))
            out(ys=ys)
            ''', store)
    finally:
        stop.write_text("")
        lines = pruner.communicate(timeout=120)[0].strip().splitlines()
        prunes = int(lines[-1].split()[1]) if lines and lines[-1].startswith("prunes") else 0
    assert prunes >= 1
    assert got["ys"] == [float(n) for n in range(1, 31)]
    assert got["warnings"] == [] and got["store_errors"] == 0
    assert got["stores_written"] == 30
    assert len(list((store / "entries").glob("*/*.kiln"))) == 30


# -- stores other users can change ---------------------------------------------------------------
def test_store_writable_by_others_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "shared"
    store.mkdir()
    os.chmod(store, 0o777)
    kiln.configure(cache_dir=store)
    f = kiln.jit(lambda x: x + 1)
    with pytest.warns(kiln.StoreWarning, match=r"writable by other users.*chmod 700") as rec:
        assert np.asarray(f(jnp.ones(3))).tolist() == [2.0] * 3
    assert len(rec) == 1
    assert stat.S_IMODE(store.stat().st_mode) == 0o777  # never changed
    assert list(store.iterdir()) == []  # nothing read, nothing written
    assert kiln.stats().store_errors >= 1
    kiln.configure(strict=True)
    with pytest.raises(kiln.StoreError, match=r"writable by other users.*\(KILN_STRICT=1 makes"):
        kiln.jit(lambda x: x + 2)(jnp.ones(3))
    kiln.configure(strict=None, signing_key="team-secret")  # a signed store may be shared
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.asarray(kiln.jit(lambda x: x + 3)(jnp.ones(3))).tolist() == [4.0] * 3
    assert kiln.stats().stores_written == 1
    assert main(["verify", "--cache-dir", str(store)]) == 0  # signed with the key in force


@needs_root
def test_store_owned_by_another_user_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "theirs"
    store.mkdir(mode=0o700)
    os.chown(store, 65534, 65534)
    kiln.configure(cache_dir=store)
    with pytest.warns(kiln.StoreWarning, match=r"owned by uid 65534, not by you"):
        assert np.asarray(kiln.jit(lambda x: x + 1)(jnp.ones(3))).tolist() == [2.0] * 3
    assert main(["ls", "--cache-dir", str(store)]) == 1
    assert "error: kiln store directory" in capsys.readouterr()[1]


@needs_root
@pytest.mark.slow
def test_an_entry_planted_by_another_user_is_never_used(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Before: a second user planted an entry compiled from ``x + 100`` under the owner's key
    in a 0777 store; the owner's warm run printed [101. 101. 101.]."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    program = 'f = kiln.jit(lambda x: x + {c})\nout(y=np.asarray(f(jnp.ones(3))).tolist())\n'
    # a folder the second user can reach (pytest's own temp root is private to root)
    tmp_path = Path(tempfile.mkdtemp(prefix="kiln-planted-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    assert _child(program.format(c=1), mine)["y"] == [2.0] * 3
    assert _child(program.format(c=100), theirs)["y"] == [101.0] * 3
    (key_file,) = (mine / "entries").glob("*/*.kiln")
    (evil_file,) = (theirs / "entries").glob("*/*.kiln")
    evil = decode(evil_file.read_bytes(), signing_key=None)
    planted = encode({**evil.header, "key": key_file.stem}, evil.sections, signing_key=None)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)
    drop = tmp_path / "planted.bin"
    drop.write_bytes(planted)
    os.chmod(drop, 0o644)
    target = shared / "entries" / key_file.parent.name / key_file.name
    proc = run_child(  # the second user's tools only (it may not reach this Python)
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
         'mkdir -p -m 777 "$1" && cp "$2" "$3"', "sh", target.parent, drop, target],
    )
    assert proc.returncode == 0, proc.stderr
    assert target.stat().st_uid == 65534
    got = _child(program.format(c=1), shared)
    assert got["y"] == [2.0] * 3
    assert len(got["warnings"]) == 1 and "writable by other users" in got["warnings"][0]
    # the owner makes the directory private: entries/ still belongs to the other user
    os.chmod(shared, 0o700)
    got = _child(program.format(c=1), shared)
    assert got["y"] == [2.0] * 3
    assert len(got["warnings"]) == 1 and "owned by uid 65534" in got["warnings"][0]


# -- configuration -------------------------------------------------------------------------------
def test_cache_dir_of_an_unknown_user_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: pathlib's RuntimeError from the first kiln.jit call."""
    monkeypatch.setenv("KILN_CACHE_DIR", "~nonexistentuser/x")
    kiln.configure(cache_dir=None)
    with pytest.raises(kiln.ConfigError, match=r"KILN_CACHE_DIR='~nonexistentuser/x'"):
        kiln.jit(lambda x: x + 1)(jnp.ones(3))


def test_cache_dir_that_is_a_file_warns_once_and_the_cli_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: two warnings per call, and ls / verify / clear exited 0."""
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    kiln.configure(cache_dir=path)
    with pytest.warns(kiln.StoreWarning) as rec:
        for k in range(3):
            assert float(kiln.jit(lambda x, k=k: x + k)(jnp.float32(1))) == 1.0 + k
    assert len(rec) == 1 and "is not a directory" in str(rec[0].message)
    for verb in (["ls"], ["verify"], ["clear", "--yes"]):
        assert main([*verb, "--cache-dir", str(path)]) == 1
        assert "is not a directory" in capsys.readouterr()[1]
    assert path.read_text() == "not a directory"


# -- results that are not JAX types --------------------------------------------------------------
class _Holder:
    def __init__(self, x: object) -> None:
        self.x = x


def _generator(x: object) -> object:
    return (i for i in range(3))


@pytest.mark.parametrize("fun", [_Holder, _generator])
def test_results_that_are_not_jax_types_raise_as_jax_jit(fun: object) -> None:
    """Before: kiln.jit(C)(x) returned a C holding a leaked tracer."""
    import jax

    # both warn first that a generator is a pytree leaf (jax's DeprecationWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="not a valid JAX type") as jax_error:
            jax.jit(fun)(jnp.ones(3))
        with pytest.raises(TypeError, match="not a valid JAX type") as kiln_error:
            kiln.jit(fun)(jnp.ones(3))
    assert str(kiln_error.value).split(" returned ")[1] == str(jax_error.value).split(
        " returned ")[1]
    assert kiln.stats().stores_written == 0


_HOLD_AND_CORRUPT = """
import sys, time
from kiln.stores import LocalStore
store = LocalStore(sys.argv[1])
key = sys.argv[2]
lease = store.lease(key, 60)
assert lease.acquire()
print("held", flush=True)
time.sleep(1.5)  # the other process is polling for the entry by now
store.put(key, b"KILNENT\\x00 not an entry")
time.sleep(1.5)
lease.release()
"""


@pytest.mark.parametrize("strict", [False, True])
def test_an_entry_that_goes_bad_while_a_process_waits_for_it_is_reported(
        kiln_store: Path, strict: bool) -> None:
    """Before: polling muted the report, so KILN_STRICT=1 replaced it without raising."""
    from kiln.stores import LocalStore

    store_dir = kiln_store

    def twice(x):
        return x * 2.0 + 1.0

    f = kiln.jit(twice)
    assert float(f(jnp.float32(1.0))) == 3.0  # cold: learn the key
    (key,) = [k for k in LocalStore(store_dir).iter()
              if decode(LocalStore(store_dir).get(k), signing_key=None).header.get("kind")
              != "verify-only"]
    LocalStore(store_dir).delete(key)
    f.clear_cache()
    with start_child([sys.executable, "-c", _HOLD_AND_CORRUPT, store_dir, key],
                     env=child_env(KILN_JAX_CACHE="0"), stderr=None) as holder:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = kiln.stats().bad_entries
        if strict:
            kiln.configure(strict=True)
            with pytest.raises(kiln.StoreError, match="KILN_STRICT=1 makes this an error"):
                f(jnp.float32(1.0))
        else:
            with pytest.warns(kiln.StoreWarning, match="is unusable"):
                assert float(f(jnp.float32(1.0))) == 3.0
        assert kiln.stats().bad_entries == before + 1
        holder.wait(timeout=60)
