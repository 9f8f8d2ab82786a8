"""The guard (``kiln._keys._guard``, recorded by ``kiln_early._inputs``): the process's inputs
beside the precise key. A warm start skips the trace only when the key and the guard both
hold; when only the key does, it verifies once (trace, lower, compare: load or compile) and
remembers the guard, so the next run with the same inputs traces nothing.

In process: what the record holds and leaves out, and how a stored guard is checked (a file
by its identity first: an unchanged one is never read again; one replaced by another of the
same size and modification time is). Across processes (slow): inputs that do not change the
program (a run name on the command line, another dataset of the same shapes, an edit to code
that runs after the trace) cost one verify and no compile; one that does (a variable the
program reads at import) compiles; and what differs in every run by construction (a temporary
folder, the files the run writes, a per-job variable a library reads, the pid, the clock) never
moves the guard.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_test_children import child_env as children_env
from kiln_test_children import run_child

import kiln
from kiln._keys import _guard, _reads
from kiln_early import _inputs

FILE = "<file>"


def _items(guard: _guard.Guard, kind: str) -> dict[str, list[str]]:
    return {i[0]: i for i in guard.items if i[1] == kind}


def _fresh_snapshot() -> _guard.Guard:
    _guard._snapshots.state = None
    return _guard.snapshot()


# -- what a stored guard's check reads ---------------------------------------------------------
def test_an_unchanged_file_is_checked_by_its_identity_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_reads, "_RACY_FINE_NS", 0)  # (the clock: the file is not "racy")
    path = tmp_path / "checkpoint.bin"
    path.write_bytes(b"\1" * 4096)
    st = os.stat(path)
    identity = _guard._identity_text(_guard._identity(st))
    digest = _reads.content_digest(str(path))
    reads = []
    monkeypatch.setattr(_guard, "content_digest", lambda p: reads.append(p) or digest)
    item = [str(path), FILE, digest, identity]
    assert _guard.check([item]) is None
    assert reads == []  # (a stat, no read: a large checkpoint costs a warm start nothing more)


def test_a_file_replaced_by_one_of_the_same_size_and_mtime_is_read_again(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_reads, "_RACY_FINE_NS", 0)
    path = tmp_path / "table.bin"
    path.write_bytes(b"\1" * 64)
    old = path.stat().st_mtime_ns - 10_000_000_000
    os.utime(path, ns=(old, old))
    item = [str(path), FILE, _reads.content_digest(str(path)),
            _guard._identity_text(_guard._identity(os.stat(path)))]
    assert _guard.check([item]) is None
    other = tmp_path / "other.bin"
    other.write_bytes(b"\2" * 64)  # same size
    os.utime(other, ns=(old, old))  # same modification time
    os.replace(other, path)  # (as `cp -p` or a restore would leave it)
    assert os.stat(path).st_size == 64 and os.stat(path).st_mtime_ns == old
    assert _guard.check([item]) == f"{path} changed"
    path.write_bytes(b"\1" * 64)  # the old content again: the guard holds
    assert _guard.check([item]) is None


def test_malformed_or_unknown_guards_never_hold_and_never_raise() -> None:
    assert _guard.check(None) == "the entry holds no guard"
    assert _guard.check([["a"]]) == "the entry's guard is malformed"
    assert _guard.check([[1, 2, 3]]) == "the entry's guard is malformed"
    assert _guard.check([["x", "<nothing>", "d"]]) == "an input of unknown kind '<nothing>'"
    assert _guard.check([["/no/such/file", FILE, "absent", ""]]) is None
    assert _guard.check([["/no/such/file", FILE, "0" * 32, ""]]) == "/no/such/file changed"


# -- what the record holds and leaves out ------------------------------------------------------
def _folder_of_another_process(children: Any) -> Path:
    """A folder another process made, holding ``input.txt`` it wrote: this process's inputs."""
    made = children.run_child(
        [sys.executable, "-c", "import os, tempfile\nd = tempfile.mkdtemp()\n"
         "open(os.path.join(d, 'input.txt'), 'w').write('input')\n"
         "open(os.path.join(d, 'history.log'), 'w').write('run 1')\nprint(d)"],
        check=True).stdout.strip()
    return Path(made)


def test_files_the_process_wrote_and_folders_it_made_are_not_inputs(children: Any) -> None:
    folder = _folder_of_another_process(children)
    (folder / "input.txt").read_text()  # read: an input
    output = folder / "output.txt"
    output.write_text("out")  # written first: the run's own output, even when read back
    output.read_text()
    made = tempfile.mkdtemp()  # a folder this process made, and what is in it
    with open(os.path.join(made, "run.log"), "w") as f:
        f.write("step 1\n")
    with open(os.path.join(made, "run.log")) as f:
        f.read()
    os.listdir(made)
    with open(folder / "history.log", "a+") as f:  # a log the run appends to: an output
        f.seek(0)
        f.read()
        f.write("run 2")
    fd, temporary = tempfile.mkstemp()  # (O_RDWR | O_CREAT | O_EXCL: made here, an output)
    os.close(fd)
    with open(temporary, "r+") as f:
        f.read()
    guard = _fresh_snapshot()
    files, listings = _items(guard, FILE), _items(guard, "<dir>")
    assert str(folder / "input.txt") in files
    assert temporary not in files and str(folder / "history.log") not in files
    assert str(output) not in files and os.path.join(made, "run.log") not in files
    assert made not in listings


def test_a_file_with_no_name_made_in_a_folder_leaves_the_folder_s_files_inputs(
        children: Any) -> None:
    # tempfile.TemporaryFile opens its folder for writing (O_TMPFILE, and io.open of the
    # folder first): the folder is not the run's output, and what is read under it is input
    folder = _folder_of_another_process(children)
    with tempfile.TemporaryFile(dir=folder) as f:
        f.write(b"scratch")
    with tempfile.TemporaryFile() as f:  # (in /tmp, where pytest's folders are)
        f.write(b"scratch")
    (folder / "input.txt").read_text()
    files = _items(_fresh_snapshot(), FILE)
    assert str(folder / "input.txt") in files


def test_a_file_read_then_overwritten_is_an_input_as_first_read(children: Any) -> None:
    path = _folder_of_another_process(children) / "input.txt"
    first = path.read_text()
    path.write_text("saved over")  # (the run saves its state over what it read)
    item = _items(_fresh_snapshot(), FILE)[str(path)]
    assert item[2] == _digest_of(first)


def _digest_of(text: str) -> str:
    import xxhash

    return xxhash.xxh3_128(text.encode()).hexdigest()


def test_variables_user_code_reads_are_inputs_and_libraries_reads_are_not(monkeypatch) -> None:
    monkeypatch.setenv("KILN_RUN_LABEL", "x")
    os.environ.get("GUARD_TEST_USER_VAR")  # user code (this file)
    os.environ.get("KILN_RUN_LABEL")  # kiln's own variables are never inputs
    site = next(p for p in sys.path if p.endswith("site-packages"))
    library = compile("import os\nos.environ.get('GUARD_TEST_LIBRARY_VAR')\n",
                      os.path.join(site, "kiln_guard_test_library.py"), "exec")
    exec(library, {"__name__": "kiln_guard_test_library"})  # noqa: S102 - a library's read
    reads = _inputs.env_reads()
    assert "GUARD_TEST_USER_VAR" in reads
    assert "GUARD_TEST_LIBRARY_VAR" not in reads and "KILN_RUN_LABEL" not in reads
    env = _items(_fresh_snapshot(), "<env>")
    assert "GUARD_TEST_USER_VAR" in env and "GUARD_TEST_LIBRARY_VAR" not in env


def test_the_command_line_the_folder_and_the_distributions_are_inputs() -> None:
    guard = _fresh_snapshot()
    kinds = {i[1] for i in guard.items}
    assert {"<argv>", "<cwd>", "<dists>"} <= kinds
    assert guard.lost is None
    assert _guard.check(guard.items) is None  # (a guard made here holds here)


def test_guard_exclude_leaves_kinds_and_patterns_out(monkeypatch, tmp_path: Path) -> None:
    with kiln.config_context(guard_exclude=("argv", "cwd", "GUARD_TEST_*")):
        os.environ.get("GUARD_TEST_EXCLUDED")
        kinds = {i[1] for i in _fresh_snapshot().items}
        names = {i[0] for i in _fresh_snapshot().items}
        assert "<argv>" not in kinds and "<cwd>" not in kinds
        assert not any(n.startswith("GUARD_TEST_") for n in names)
        assert _guard.check([["<argv>", "<argv>", "0" * 32]]) is None  # (left out: not checked)
    monkeypatch.setenv("KILN_GUARD_EXCLUDE", "files, /data/logs/*")
    assert kiln.get_config().guard_exclude == ("files", "/data/logs/*")


# -- across processes ----------------------------------------------------------------------------
LIBRARY = '''
import os


def job_id():
    return os.environ.get("GUARD_JOB_ID", "")
'''

POST = '''
def summary(values):
    return f"summary {values}"
'''

PROG = '''
import os
import socket
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import kiln
import joblike  # an installed library (in site-packages) that reads a per-job variable
import post

SCALE = float(os.environ.get("MYAPP_SCALE", "1.0"))  # read at import: shapes the program
run_name = sys.argv[1]
scratch = tempfile.mkdtemp()  # a new folder every run, and what the run writes there
with open(os.path.join(scratch, "log.txt"), "w") as f:
    f.write(f"{run_name} {os.getpid()} {time.time()} {socket.gethostname()} {joblike.job_id()}")
with open(os.path.join(scratch, "log.txt")) as f:
    f.read()
os.listdir(scratch)
data = np.load("data.npy")  # another dataset of the same shapes: the same program
params = np.load("ckpt.npy")


@kiln.jit
def step(p, x):
    TRACE()
    return jnp.tanh(p * x).sum() * SCALE


call("step", step, params, data)
print(post.summary(float(step(params, data))))
report()
'''


@pytest.mark.slow
def test_inputs_that_change_and_inputs_that_do_not(tmp_path: Path, xp: Any) -> None:
    prog = xp.Program(tmp_path)
    site = prog.dir / "site" / "site-packages"
    site.mkdir(parents=True)
    (site / "joblike.py").write_text(LIBRARY)
    prog.base_env = {"PYTHONPATH": str(site), "KILN_GUARD_EXCLUDE": ""}
    prog.write("prog.py", PROG)
    prog.write("post.py", POST)
    np.save(prog.dir / "ckpt.npy", np.full(4, 0.5, np.float32))
    np.save(prog.dir / "data.npy", np.arange(4, dtype=np.float32))

    def run(name: str = "run-1", **env: str) -> dict[str, Any]:
        got = prog.run(name, env={"GUARD_JOB_ID": str(len(prog.runs)), **env})
        rec = got["step"]
        assert "error" not in rec, rec["error"]
        return rec

    def assert_verified(rec: dict[str, Any], compiles: int) -> None:
        assert rec["verifies"] == 1 and rec["traces"] == 1, rec
        assert rec["compiles"] == compiles, rec

    cold = run()
    xp.assert_cold(cold)
    # the same inputs, another job id a library reads, another temporary folder, pid, time
    xp.assert_warm(run())
    # a run name on the command line: verified once, loaded (no compile), then warm
    renamed = run("run-2")
    assert_verified(renamed, compiles=0)
    assert renamed["leaves"] == cold["leaves"]
    xp.assert_warm(run("run-2"))
    # another dataset of the same shapes: the same program, new values
    np.save(prog.dir / "data.npy", np.arange(4, 8, dtype=np.float32))
    new_data = run("run-2")
    assert_verified(new_data, compiles=0)
    want = float(np.tanh(0.5 * np.arange(4, 8, dtype=np.float32)).sum())
    np.testing.assert_allclose(xp.value(new_data), want, rtol=1e-6)
    xp.assert_warm(run("run-2"))
    # an edit to code that runs after the trace: the same program
    prog.write("post.py", POST.replace('f"summary {values}"', 'f"total {values:.3f}"'))
    assert_verified(run("run-2"), compiles=0)
    xp.assert_warm(run("run-2"))
    # a variable the program reads at import into a global the trace reads: another key
    scaled = run("run-2", MYAPP_SCALE="3.0")
    assert (scaled["misses"], scaled["compiles"], scaled["verifies"]) == (1, 1, 0), scaled
    np.testing.assert_allclose(xp.value(scaled), 3 * want, rtol=1e-6)
    xp.assert_warm(run("run-2", MYAPP_SCALE="3.0"))
    # back to the first inputs, every one: the first entry, as it was
    np.save(prog.dir / "data.npy", np.arange(4, dtype=np.float32))
    prog.write("post.py", POST)
    back = run()
    xp.assert_warm(back)
    assert back["leaves"] == cold["leaves"]
    # kiln stats counts the guards verified (the run name, the dataset, the edit after the
    # trace; the scaled program is another key)
    summary = json.loads(run_child(
        [sys.executable, "-m", "kiln", "--cache-dir", str(prog.cache), "stats", "--json"],
        check=True).stdout)
    assert summary["verified_guards"] == 3, summary


BIG = '''
import decimal
import sys

opened = []  # kiln's own opens of the table


def audit(event, args):
    if event == "open" and str(args[0]).endswith("big.npy"):
        if str(sys._getframe(1).f_globals.get("__name__")).startswith("kiln"):
            opened.append(1)


sys.addaudithook(audit)

import jax.numpy as jnp
import numpy as np

import kiln

table = np.load("big.npy", mmap_mode="r")
decimal.getcontext().prec = int(table[-1])  # state the key does not see: the guard does


@kiln.jit
def f(x):
    TRACE()
    return x * float(decimal.Decimal(1) / decimal.Decimal(3))


call("f", f, jnp.ones(3))
report(opened=len(opened))
'''


@pytest.mark.slow
def test_a_large_input_is_hashed_once_not_in_every_run(tmp_path: Path, xp: Any) -> None:
    """A 64 MiB table read before the trace (it sets ``decimal``'s precision, which the trace
    uses): the cold run digests it (kiln opens it once); a warm run stats it and never opens it;
    a table replaced by another of the same size and modification time is read, and the result
    is the new one's."""
    prog = xp.Program(tmp_path)
    prog.base_env = {"KILN_GUARD_EXCLUDE": ""}
    prog.write("prog.py", BIG)
    table = np.zeros(16 * 1024 * 1024, np.float32)
    table[-1] = 2
    np.save(prog.dir / "big.npy", table)
    old = (prog.dir / "big.npy").stat().st_mtime_ns - 10_000_000_000
    os.utime(prog.dir / "big.npy", ns=(old, old))
    cold = prog.run()
    xp.assert_cold(cold["f"])
    assert cold.extra["opened"] == 1  # kiln's digest of it
    np.testing.assert_allclose(xp.value(cold["f"]), [0.33] * 3, rtol=1e-6)
    warm = prog.run()
    xp.assert_warm(warm["f"])
    assert warm.extra["opened"] == 0  # a stat, no read
    table[-1] = 5
    np.save(prog.dir / "other.npy", table)
    os.utime(prog.dir / "other.npy", ns=(old, old))
    os.replace(prog.dir / "other.npy", prog.dir / "big.npy")
    changed = prog.run()
    assert changed["f"]["verifies"] == 1 and changed["f"]["compiles"] == 1, changed["f"]
    np.testing.assert_allclose(xp.value(changed["f"]), [0.33333] * 3, rtol=1e-6)


CONFTEST = '''
import decimal

COEFF = float(open("coeff.txt").read())  # read before kiln is imported (pytest_configure)
decimal.getcontext().prec = int(COEFF * 2)
'''

SUITE = '''
import decimal

import jax
import jax.numpy as jnp


@jax.jit
def f(x):
    return x * float(decimal.Decimal(1) / decimal.Decimal(3))


def test_f():
    print("VALUE", float(f(jnp.float32(3.0))))
'''


@pytest.mark.slow
def test_pytest_kiln_records_from_before_the_first_conftest(tmp_path: Path) -> None:
    """Under ``pytest --kiln`` the record starts before the first conftest is imported (the
    plugin's ``pytest_load_initial_conftests``): a file a conftest reads to set up state is an
    input, so editing it gives the new value, not the stored one."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)

    def run(coeff: str) -> tuple[str, str]:
        (tmp_path / "coeff.txt").write_text(coeff)
        proc = run_child(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--kiln",
             "test_suite.py"], cwd=tmp_path, check=True,
            env=children_env(KILN_CACHE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu",
                             PYTHONDONTWRITEBYTECODE="1"))
        value = next(ln for ln in proc.stdout.splitlines() if ln.startswith("VALUE"))
        summary = next(ln for ln in proc.stdout.splitlines() if "kiln.jit hits" in ln)
        return value, summary

    cold = run("2.0")
    assert "misses 1, traces 1" in cold[1]
    warm = run("2.0")
    assert warm == (cold[0], warm[1]) and "hits 1, misses 0, traces 0" in warm[1]
    edited = run("3.0")
    assert edited[0] != cold[0] and "traces 1" in edited[1]  # (verified: another program)
    assert edited[0] == "VALUE 0.999998927116394"


ABSL = '''
from absl import app, flags

import jax
import jax.numpy as jnp

FLAGS = flags.FLAGS
flags.DEFINE_float("lr", 0.1, "learning rate")
flags.DEFINE_string("workdir", "/tmp/x", "where")


@jax.jit
def step(x):
    TRACE()
    return x * FLAGS.lr


def main(argv):
    call("step", step, jnp.ones(3))
    report()


if __name__ == "__main__":
    app.run(main)
'''


@pytest.mark.slow
def test_a_program_reading_absl_flags_warm_starts_with_no_trace(tmp_path: Path, xp: Any) -> None:
    """absl keeps its flags by ``id(module)`` (``FlagValues.__flags_by_module_id``): a key
    that held that dict whole differed in every process. A dict key that is an ``id()`` now
    counts as an identity: the second run traces nothing; another flag value is another
    program (the command line is an input, and the flag's value is keyed)."""
    pytest.importorskip("absl")
    prog = xp.Program(tmp_path)
    prog.base_env = {"KILN_GUARD_EXCLUDE": ""}
    prog.write("prog.py", ABSL)
    main = ("-m", "kiln", "run", "prog.py")
    cold = prog.run(main=main)["step"]
    xp.assert_cold(cold)
    xp.assert_warm(prog.run(main=main)["step"])
    other = prog.run("--lr=0.5", main=main)["step"]
    assert xp.value(other) == [0.5, 0.5, 0.5] and other["compiles"] == 1, other
    xp.assert_warm(prog.run("--lr=0.5", main=main)["step"])
