"""``kiln_server`` in one process: which command lines ask for the warm process (and what the
child is given), and what the server's key changes with. The runs themselves, as real
processes: ``tests/test_server.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kiln_server
from kiln_server import _common


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KILN_SERVER", raising=False)
    path = tmp_path / "prog.py"
    path.write_text("print('hi')\n")
    return path


def test_only_a_kiln_run_that_asks_for_the_server_is_offered_to_it(
        script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kiln_server.target_of(["run", "prog.py"]) is None
    assert kiln_server.target_of(["ls"]) is None
    assert kiln_server.target_of(["--version"]) is None
    assert kiln_server.target_of(["run", "--server", "--help"]) is None
    assert kiln_server.target_of(["run", "--server", "missing.py"]) is None
    target = kiln_server.target_of(["--cache-dir", "/tmp/c", "run", "--server", "--no-jit",
                                    "prog.py", "--server", "x"])
    assert target is not None
    # --server is the client's; the script's own arguments are left as they are
    assert target.argv == ["--cache-dir", "/tmp/c", "run", "--no-jit", "prog.py", "--server",
                           "x"]
    assert target.options == ["--cache-dir", "/tmp/c", "run", "--no-jit"]
    assert target.script == "prog.py" and target.cli_cache_dir == "/tmp/c"
    assert target.own_dir == os.path.realpath(script.parent)
    monkeypatch.setenv("KILN_SERVER", "1")
    assert kiln_server.target_of(["run", "prog.py"]) is not None
    assert kiln_server.target_of(["run", "--no-server", "prog.py"]) is None
    module = kiln_server.target_of(["run", "-m", "pkg.mod", "a"])
    assert module is not None and module.module == "pkg.mod"
    assert module.describe() == "-m pkg.mod" and module.argv == ["run", "-m", "pkg.mod", "a"]


def test_the_key_changes_with_the_environment_the_options_and_the_modules(
        script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def key(argv: list[str], modules: list[str]) -> str:
        target = kiln_server.target_of(argv)
        assert target is not None
        return _common.key_of(target, modules)

    base = key(["run", "--server", "prog.py"], ["numpy"])
    assert key(["run", "--server", "prog.py", "other", "args"], ["numpy"]) == base
    assert key(["run", "--server", "prog.py"], ["numpy", "scipy"]) != base
    assert key(["run", "--server", "--no-jit", "prog.py"], ["numpy"]) != base
    monkeypatch.setenv("KILN_SERVER_TIMEOUT", "3")  # the client's own: not in the key
    assert key(["run", "--server", "prog.py"], ["numpy"]) == base
    monkeypatch.setenv("JAX_ENABLE_X64", "1")  # read by JAX at import
    assert key(["run", "--server", "prog.py"], ["numpy"]) != base


def test_a_folder_of_sockets_open_to_others_or_not_ours_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "socks"
    monkeypatch.setenv("KILN_SERVER_DIR", str(where))
    assert _common.server_dir() == str(where)
    assert (where.stat().st_mode & 0o777) == 0o700
    where.chmod(0o777)
    with pytest.raises(OSError, match="open to other users"):
        _common.server_dir()
    link = tmp_path / "link"
    link.symlink_to(where)
    monkeypatch.setenv("KILN_SERVER_DIR", str(link))
    with pytest.raises(OSError, match="is not a folder"):
        _common.server_dir()


def test_a_record_that_is_not_a_list_of_names_is_no_record(
        script: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "store"))
    target = kiln_server.target_of(["run", "--server", "prog.py"])
    assert target is not None
    assert _common.read_record(target) is None
    _common.write_record(target, ["numpy", "jax"])
    assert _common.read_record(target) == ["numpy", "jax"]
    Path(_common.record_path(target)).write_text('{"modules": [1, 2]}')
    assert _common.read_record(target) is None
    Path(_common.record_path(target)).write_text("not json")
    assert _common.read_record(target) is None
