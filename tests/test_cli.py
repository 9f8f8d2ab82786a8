"""Tests for the ``kiln`` command line (kiln._cli), through ``main(argv)`` and one subprocess."""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
from kiln_test_children import child_env, run_child

import kiln
from kiln._base import encode
from kiln._cli import _demo, _inspect, _render, main
from kiln.stores import LocalStore


def _double(x: Any) -> Any:
    return x * 2


def _inc(x: Any) -> Any:
    return x + 1


DOUBLE = f"{_double.__module__}._double"
INC = f"{_inc.__module__}._inc"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KILN_STORE", "KILN_CACHE_DIR", "KILN_SIGNING_KEY", "KILN_EXPLAIN",
                "KILN_VERIFY", "KILN_STRICT", "KILN_PROGRESS", "KILN_MAX_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def store_dir(tmp_path: Path) -> Any:
    """An empty local store, configured process-wide for the test."""
    d = tmp_path / "store"
    kiln.configure(cache_dir=d)
    yield d
    kiln.configure(cache_dir=None, signing_key=None)


@pytest.fixture
def filled(store_dir: Path) -> Path:
    """A store holding three entries: _double at two shapes, then _inc."""
    double, inc = kiln.jit(_double), kiln.jit(_inc)
    double(jnp.ones(3))
    double(jnp.ones((2, 2)))
    inc(jnp.ones(3))
    double.clear_cache()
    inc.clear_cache()
    return store_dir


def _entry_files(store_dir: Path) -> list[Path]:
    return sorted((store_dir / "entries").glob("*/*.kiln"))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _ls_json(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    code, out, _ = _run(["ls", "--json"], capsys)
    assert code == 0
    return json.loads(out)


# -- formatting helpers ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (29082, "28.4 KiB"),
     (5 * 1024**2, "5.0 MiB"), (3 * 1024**3 // 2, "1.5 GiB")],
)
def test_human_size(n: int, text: str) -> None:
    assert _render.human_size(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-1.0, "0 s ago"), (5.9, "5 s ago"), (61, "1 min ago"), (7300, "2 h ago"),
     (3 * 86400 + 5, "3 d ago")],
)
def test_ago(seconds: float, text: str) -> None:
    assert _render.ago(seconds) == text


# -- usage ----------------------------------------------------------------------------------------
def test_no_verb_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([], capsys)
    assert code == 2
    assert out == ""
    assert err.splitlines()[-1].startswith("error: ")


def test_unknown_verb_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["frobnicate"], capsys)
    assert code == 2
    assert "error: argument VERB: invalid choice: 'frobnicate'" in err


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    assert "demo" in out and "prune" in out


def test_cache_dir_option_is_scoped_to_the_call(
    filled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    assert _run(["--cache-dir", str(other), "ls", "--json"], capsys) == (0, "[]\n", "")
    assert _run(["ls", "--json", "--cache-dir", str(other)], capsys) == (0, "[]\n", "")
    # The process-wide setting of the caller is back in force.
    assert kiln.get_config().cache_dir == filled
    assert len(_ls_json(capsys)) == 3


# -- ls -------------------------------------------------------------------------------------------
def test_ls_json(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _ls_json(capsys)
    assert [(r["function"], r["signature"]) for r in rows] == [
        (DOUBLE, "float32[3]"),
        (DOUBLE, "float32[2, 2]"),
        (INC, "float32[3]"),
    ]
    files = {p.stem: p.stat().st_size for p in _entry_files(filled)}
    for r in rows:
        assert re.fullmatch(r"[0-9a-f]{64}", r["key"])
        assert r["kind"] == "executable"
        assert r["size"] == files[r["key"]]
        assert r["created"] <= r["last_used"] <= time.time()
        assert r["compile_seconds"] > 0
    assert rows[0]["created"] < rows[1]["created"]


def test_ls_table(
    filled: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _ls_json(capsys)
    monkeypatch.setattr(_inspect, "_clock", lambda: time.time() + 7200)
    code, out, err = _run(["ls"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == [
        "FUNCTION", "SIGNATURE", "SIZE", "CREATED", "LAST USED", "COMPILE S", "KEY"
    ]
    assert len(lines) == 4
    for line, row in zip(lines[1:], rows, strict=True):
        assert re.split(r"\s{2,}", line.strip()) == [
            row["function"],
            row["signature"],
            _render.human_size(row["size"]),
            "2 h ago",
            "2 h ago",
            f"{row['compile_seconds']:.2f}",
            row["key"][:12],
        ]
        assert line == line.rstrip()


def _step(params: Any) -> Any:
    return [p * 2 for p in params]


def test_ls_cuts_a_long_signature_to_the_terminal(
    store_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step with 80 leaves: its SIGNATURE column fits a 120-column
    terminal, with the count of leaves; ``-v`` and ``--json`` give it whole."""

    kiln.jit(_step)([jnp.ones((i % 7 + 1, 3)) for i in range(80)])
    (row,) = _ls_json(capsys)
    assert row["signature"].count("float32[") == 80 and len(row["signature"]) > 800
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = _run(["ls"], capsys)
    assert code == 0
    line = out.splitlines()[1]
    assert len(line) <= 120, line
    shown = re.split(r"\s{2,}", line.strip())[1]
    assert shown.endswith(", ... (80 leaves)") and shown.startswith("float32[1, 3], ")
    code, out, _ = _run(["ls", "-v"], capsys)
    assert row["signature"] in out


def test_cli_warnings_read_as_the_cli_s_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kiln's warnings in a CLI run are ``kiln: warning: <text>`` on stderr, not Python's
    ``<file>:<line>: StoreWarning: kiln: ...``."""
    import warnings

    from kiln._base._errors import StoreWarning

    def warn(args: Any) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # (this suite turns warnings into errors)
            warnings.warn("kiln: store /x is full; entries compiled here are not stored",
                          StoreWarning, stacklevel=1)
            warnings.warn("a user's own warning", UserWarning, stacklevel=1)
        return 0

    parser_func = _inspect._cmd_stats
    try:
        _inspect._cmd_stats = warn  # the verb's function, as argparse calls it
        code, _, err = _run(["--cache-dir", str(tmp_path / "s"), "stats"], capsys)
    finally:
        _inspect._cmd_stats = parser_func
    assert code == 0
    assert "kiln: warning: store /x is full; entries compiled here are not stored\n" in err
    assert "StoreWarning" not in err
    assert "kiln: warning: a user's own warning" not in err  # not kiln's: left to Python


def _vf(y: Any) -> Any:
    return y * 0.5


def test_ls_shows_noinline_functions_with_the_programs_that_use_them(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vf = kiln.noinline(_vf)
    first = kiln.jit(lambda y: vf(vf(y)))
    with kiln.config_context(tier_up=False):
        first(jnp.ones(3))
    second = kiln.jit(lambda y: vf(y) + 1.0)
    second(jnp.ones(3))
    assert kiln.wait_for_tier_up(timeout=300)
    by_function = {r["function"]: r for r in _ls_json(capsys)}
    sub = by_function[f"{_vf.__module__}._vf[noinline]"]
    lam = f"{__name__}.test_ls_shows_noinline_functions_with_the_programs_that_use_them" \
        ".<locals>.<lambda>"
    assert sub["used_by"] == [lam] and sub["calls"] == []
    callers = [r for r in _ls_json(capsys) if r["function"] == lam]
    assert sorted(r["tier"] for r in callers) == ["inlined", "noinline"]
    assert all(r["calls"] == [sub["function"]] for r in callers)
    code, out, _ = _run(["ls"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[-1] == "NOINLINE"
    assert any(line.endswith("used by <lambda>") for line in lines)
    assert any(line.endswith("calls _vf[noinline] (inlined)") for line in lines)
    assert any(line.endswith("calls _vf[noinline] (not inlined yet)") for line in lines)


def test_ls_empty_store(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["ls"], capsys) == (0, "", f"no entries in {store_dir}\n")
    assert _run(["ls", "--json"], capsys) == (0, "[]\n", "")


def test_ls_unreadable_and_verify_only(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(filled)
    marker_key, old_marker_key = "ab" * 32, "ef" * 32
    store.put(marker_key, encode({"kind": "verify-only", "function": "m.f"}, {}, signing_key=None))
    # Markers written before they named their function held the format version there.
    old_marker = encode({"kind": "verify-only", "function": "1"}, {}, signing_key=None)
    store.put(old_marker_key, old_marker)
    garbage_key = "cd" * 32
    store.put(garbage_key, b"not an entry at all")
    rows = {r["key"]: r for r in _ls_json(capsys)}
    assert len(rows) == 6
    assert (rows[marker_key]["kind"], rows[marker_key]["function"],
            rows[marker_key]["signature"]) == ("verify-only", "m.f", "-")
    assert (rows[old_marker_key]["kind"], rows[old_marker_key]["function"],
            rows[old_marker_key]["signature"]) == ("verify-only", "-", "-")
    assert (rows[garbage_key]["kind"], rows[garbage_key]["function"],
            rows[garbage_key]["size"]) == ("unreadable", "<unreadable>", 19)
    code, out, _ = _run(["ls"], capsys)
    assert code == 0
    fields = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    assert ["-", "-", _render.human_size(rows[old_marker_key]["size"])] == fields[1][:3]
    assert ["<unreadable>", "-", "19 B"] == fields[2][:3]
    assert fields[2][-1] == "cdcdcdcdcdcd"
    assert ["m.f", "-", _render.human_size(rows[marker_key]["size"])] == fields[3][:3]
    code, out, _ = _run(["stats", "--json"], capsys)
    data = json.loads(out)
    assert (data["entries"], data["verify_only_markers"], data["unreadable"]) == (6, 2, 1)
    assert data["functions"] == {DOUBLE: 2, INC: 1}


# -- stats --------------------------------------------------------------------------------------
def test_stats(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _ls_json(capsys)
    total = sum(r["size"] for r in rows)
    seconds = sum(r["compile_seconds"] for r in rows)
    code, out, _ = _run(["stats", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data == {
        "store": str(filled),
        "entries": 3,
        "bytes": total,
        "compile_seconds": pytest.approx(seconds, abs=1e-5),
        "functions": {DOUBLE: 2, INC: 1},
        "machines": {kiln._keys._key.machine(): 3},
        "verify_only_markers": 0,
        "verified_guards": 0,
        "not_stored": {},
        "unreadable": 0,
        "stray_files": 0,
        "temp_files": 0,
        "temp_bytes": 0,
    }
    code, out, _ = _run(["stats"], capsys)
    assert code == 0
    assert out.splitlines() == [
        f"store: {filled}",
        "entries: 3",
        f"size: {_render.human_size(total)} ({total} bytes)",
        f"compile seconds stored: {data['compile_seconds']:.2f}",
        "machine kinds (entries each):",
        f"  3  {kiln._keys._key.machine()}",
        "functions:",
        f"  2  {DOUBLE}",
        f"  1  {INC}",
    ]


# -- verify -------------------------------------------------------------------------------------
def test_verify_ok(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {r["key"]: r["last_used"] for r in _ls_json(capsys)}
    code, out, _ = _run(["verify"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[-1] == "3 entries: 3 ok, 0 bad"
    assert sorted(lines[:-1]) == sorted(
        f"ok {k[:12]} {DOUBLE if n < 2 else INC}"
        for n, k in enumerate(r["key"] for r in _ls_json(capsys))
    )
    # Verifying reads every entry but does not count as a use (LRU order is kept).
    assert {r["key"]: r["last_used"] for r in _ls_json(capsys)} == before


def test_verify_detects_corruption(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = _entry_files(filled)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    key = victim.stem

    code, out, _ = _run(["verify"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert f"BAD {key[:12]} entry digest mismatch (corrupt or tampered)" in lines
    assert sum(line.startswith("ok ") for line in lines) == 2
    assert lines[-1] == "3 entries: 2 ok, 1 bad"

    code, out, _ = _run(["verify", "--json"], capsys)
    assert code == 1
    data_json = json.loads(out)
    assert (data_json["ok"], data_json["bad"], data_json["deleted"]) == (2, 1, 0)
    bad = [e for e in data_json["entries"] if not e["ok"]]
    assert [(e["key"], e["reason"]) for e in bad] == [
        (key, "entry digest mismatch (corrupt or tampered)")
    ]
    assert victim.exists()

    code, out, _ = _run(["verify", "--delete-bad"], capsys)
    assert code == 1
    assert f"BAD {key[:12]} entry digest mismatch (corrupt or tampered) (deleted)" in out
    assert out.splitlines()[-1] == "3 entries: 2 ok, 1 bad, 1 deleted"
    assert not victim.exists()
    code, out, _ = _run(["verify"], capsys)
    assert code == 0
    assert out.splitlines()[-1] == "2 entries: 2 ok, 0 bad"


def test_verify_reports_an_entry_stored_under_another_key(
    filled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A whole, valid entry copied over another key's file is never loaded; verify says so
    (it once checked only the digest: verify now decodes an entry as every reader does)."""
    first, second = _entry_files(filled)[:2]
    second.write_bytes(first.read_bytes())
    code, out, _ = _run(["verify"], capsys)
    assert code == 1
    assert f"BAD {second.stem[:12]} entry was written for key {first.stem[:12]}" in out.splitlines()
    assert out.splitlines()[-1] == "3 entries: 2 ok, 1 bad"


def test_verify_checks_signature(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kiln.configure(signing_key="secret")
    code, out, _ = _run(["verify"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert sum("entry is not signed but a signing_key is configured" in x for x in lines) == 3
    assert lines[-1] == "3 entries: 0 ok, 3 bad"


# -- prune --------------------------------------------------------------------------------------
def test_prune_dry_run_deletes_nothing(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _ls_json(capsys)
    total = sum(r["size"] for r in rows)
    code, out, _ = _run(["prune", "--max-size", "0", "--dry-run"], capsys)
    assert code == 0
    assert out == (
        f"would remove 3 entries ({_render.human_size(total)}); "
        f"0 entries (0 B) would remain in {filled}\n"
    )
    assert len(_entry_files(filled)) == 3


def test_prune_evicts_least_recently_used(
    filled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _ls_json(capsys)
    oldest = min(rows, key=lambda r: r["last_used"])
    total = sum(r["size"] for r in rows)
    keep = total - oldest["size"]
    code, out, _ = _run(["prune", "--max-size", str(keep)], capsys)
    assert code == 0
    assert out == (
        f"removed 1 entry ({_render.human_size(oldest['size'])}); "
        f"2 entries ({_render.human_size(keep)}) remain in {filled}\n"
    )
    assert {p.stem for p in _entry_files(filled)} == {r["key"] for r in rows} - {oldest["key"]}
    # Already under the cap: nothing to do.
    code, out, _ = _run(["prune", "--max-size", "1GiB"], capsys)
    assert code == 0
    assert out.startswith("removed 0 entries (0 B); 2 entries")


def test_prune_bad_size_is_usage_error(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["prune", "--max-size", "lots"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("error: --max-size must be a size such as '4GiB'")


def test_prune_needs_a_store_that_keeps_last_use(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--store", "memory", "prune", "--max-size", "1MB"], capsys)
    assert (code, out) == (1, "")
    assert err == "error: store 'memory' cannot be pruned (it keeps no last-use order)\n"


# -- clear --------------------------------------------------------------------------------------
def test_clear_needs_yes(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["clear"], capsys) == (
        2, "", f"error: clear deletes every entry in {filled}; pass --yes to confirm\n"
    )
    assert len(_entry_files(filled)) == 3


def test_clear_dry_run_and_yes(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    total = sum(r["size"] for r in _ls_json(capsys))
    size = _render.human_size(total)
    assert _run(["clear", "--dry-run"], capsys) == (
        0, f"would remove 3 entries ({size}) from {filled}\n", ""
    )
    assert len(_entry_files(filled)) == 3
    assert _run(["clear", "--yes"], capsys) == (
        0, f"removed 3 entries ({size}) from {filled}\n", ""
    )
    assert _entry_files(filled) == []
    assert _ls_json(capsys) == []


# -- run ----------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent(
    """
    import sys

    import jax.numpy as jnp
    import kiln

    import helper  # next to the script: the script's folder is sys.path[0]


    @kiln.jit
    def triple(x):
        return x * helper.FACTOR


    print(triple(jnp.ones(2)).tolist(), sys.argv[1:], __name__)
    """
)


def _summary(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_run_reports_miss_then_persistent_hit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "helper", raising=False)
    script = tmp_path / "prog" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    (script.parent / "helper.py").write_text("FACTOR = 3\n")
    cache = tmp_path / "cache"
    argv = sys.argv[:]

    code, out, err = _run(["--cache-dir", str(cache), "run", str(script), "a", "--b"], capsys)
    assert code == 0
    assert out == "[3.0, 3.0] ['a', '--b'] __main__\n"
    summary = _summary(err)
    assert summary.startswith("kiln: hits: 0, misses: 1, traces: 1, compiles: 1, ")
    # (then, under the swap, what JAX's eager work did: "eager loaded: 0, compiled: N, ...")
    assert re.search(r"compile_seconds: \d+\.\d\d, saved_seconds: 0\.00(,|$)", summary)
    assert sys.argv == argv

    # The script defines a new function object: a persistent hit, nothing traced or compiled
    # (its command line as before: another one is another input of the guard, verified once)
    code, out, err = _run(["--cache-dir", str(cache), "run", str(script), "a", "--b"], capsys)
    assert code == 0
    assert out == "[3.0, 3.0] ['a', '--b'] __main__\n"
    summary = _summary(err)
    assert summary.startswith(
        "kiln: hits: 1, misses: 0, traces: 0, compiles: 0, compile_seconds: 0.00, saved_seconds: "
    )
    # (the entry's compile seconds less its load: 0 when the load took longer)
    assert float(re.search(r"saved_seconds: (\d+\.\d\d)", summary).group(1)) >= 0
    assert kiln.get_config().cache_dir != cache


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("sys.exit(3)", 3),
        ("sys.exit()", 0),
        ("sys.exit('bye')", 1),
        ("raise ValueError('boom')", 1),
    ],
)
def test_run_propagates_exit_status(
    body: str, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "exits.py"
    script.write_text(f"import sys\nprint('before')\n{body}\n")
    got, out, err = _run(["--cache-dir", str(tmp_path / "c"), "run", str(script)], capsys)
    assert got == code
    assert out == "before\n"
    assert _summary(err).startswith("kiln: hits: 0, misses: 0, traces: 0, compiles: 0")
    if "ValueError" in body:
        assert "ValueError: boom" in err
        assert "runpy" not in err  # the traceback starts at the script
    if "bye" in body:
        assert err.startswith("bye\n")


def test_run_explain_logs_misses_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "explain.py"
    script.write_text(
        "import jax.numpy as jnp, kiln\n"
        "f = kiln.jit(lambda x: x - 1)\n"
        "f(jnp.ones(2)); f(jnp.ones(3))\n"
        "print(kiln.get_config().explain)\n"
    )
    code, out, err = _run(["--cache-dir", str(tmp_path / "c"), "run", "--explain", str(script)],
                          capsys)
    assert code == 0
    assert out == "True\n"
    assert "kiln: <lambda>: recompiling because argument x: float32[2] -> float32[3]" in err
    assert _summary(err).startswith("kiln: hits: 0, misses: 2")
    assert kiln.get_config().explain is False


def test_run_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.py")
    assert _run(["run", missing], capsys) == (
        2, "", f"error: cannot run {missing!r}: no such file\n"
    )


# -- demo ---------------------------------------------------------------------------------------
FAKE_EXAMPLE = textwrap.dedent(
    """
    import json, os, sys

    jit = sys.argv[sys.argv.index("--jit") + 1]
    how = "run" if "kiln" in sys.modules else jit  # under kiln run (kiln imported first)
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"jit": how, "env": {k: os.environ.get(k) for k in (
            "KILN_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")}}) + "\\n")
    a = float(os.environ.get("FAKE_A_" + jit, "0.55"))
    print("noise")
    print(json.dumps({"time_to_first_result_s": 1.5 if jit == "kiln" else 3.0,
                      "params": {"a": a, "b": 0.028, "c": 0.84, "d": 0.026}, "loss": 0.01}))
    """
)

DEMO_ROWS = [
    "kiln, cold (empty store)",
    "kiln, warm",
    "jax.jit",
    "jax.jit + JAX persistent cache, cold",
    "jax.jit + JAX persistent cache, warm",
    "kiln run (jax.jit code unchanged), cold",
    "kiln run (jax.jit code unchanged), warm",
]


@pytest.fixture
def fake_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    script = tmp_path / "fake_lv.py"
    script.write_text(FAKE_EXAMPLE)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("KILN_STORE", "memory")  # the demo must not inherit it
    return script, log


def test_demo_rows_and_environments(
    fake_example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    script, log = fake_example
    code, out, err = _run(["demo", "--script", str(script), "--runs", "3", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["identical_params"] is True
    assert (data["rounds"], data["warm_up_runs"]) == (3, 1)
    assert [r["mode"] for r in data["rows"]] == DEMO_ROWS
    assert [r["runs"] for r in data["rows"]] == [3] * 7
    plain_wall = data["rows"][2]["process_wall_s"]
    for r in data["rows"]:
        assert r["params"] == {"a": 0.55, "b": 0.028, "c": 0.84, "d": 0.026}
        assert r["loss"] == 0.01
        assert r["process_wall_s"] > 0
        assert len(r["times_s"]) == 3
        assert r["min_s"] <= r["time_to_first_result_s"] <= r["max_s"]
        expected = 0.5 if r["jit"] == "kiln" else 1.0
        if r["jit"] == "run":  # of the wall: kiln run imports jax before the script starts
            assert r["ratio_of"] == "process_wall_s"
            expected = r["process_wall_s"] / plain_wall
        assert r["ratio_to_jax_jit"] == pytest.approx(expected)
        assert r["speedup_vs_jax_jit"] == pytest.approx(1 / expected)
    assert err.splitlines()[0] == "kiln demo: warm-up (untimed: imports, disk cache) ... done"
    assert "round 1/3: kiln, cold (empty store) ..." in err
    assert "round 3/3: jax.jit + JAX persistent cache, warm ..." in err

    runs = [json.loads(line) for line in log.read_text().splitlines()]
    warm_up, timed = runs[0], runs[1:]
    assert warm_up["jit"] == "kiln"
    assert len(timed) == 3 * 7
    rounds = [timed[i:i + 7] for i in range(0, 21, 7)]
    cached: dict[str, set[str]] = {"KILN_CACHE_DIR": set(), "JAX_COMPILATION_CACHE_DIR": set()}
    for r, one in enumerate(rounds):
        kiln_runs = [x["env"] for x in one if x["jit"] == "kiln"]
        jax_runs = [x["env"] for x in one if x["jit"] == "jax"]
        run_runs = [x["env"] for x in one if x["jit"] == "run"]
        assert len(kiln_runs) == 2 and len(jax_runs) == 3 and len(run_runs) == 2
        # kiln run cold, then warm, on a store of their own
        assert len({e["KILN_CACHE_DIR"] for e in run_runs}) == 1
        assert run_runs[0]["KILN_CACHE_DIR"] != kiln_runs[0]["KILN_CACHE_DIR"]
        # kiln cold, then kiln warm on the store the cold run filled: one store a round
        assert len({e["KILN_CACHE_DIR"] for e in kiln_runs}) == 1
        cached["KILN_CACHE_DIR"].add(kiln_runs[0]["KILN_CACHE_DIR"])
        plain = [e for e in jax_runs if e["JAX_COMPILATION_CACHE_DIR"] is None]
        cache_runs = [e for e in jax_runs if e["JAX_COMPILATION_CACHE_DIR"] is not None]
        assert len(plain) == 1 and len(cache_runs) == 2
        assert plain[0]["KILN_CACHE_DIR"] is None
        assert plain[0]["JAX_ENABLE_COMPILATION_CACHE"] == "false"
        assert len({e["JAX_COMPILATION_CACHE_DIR"] for e in cache_runs}) == 1
        cached["JAX_COMPILATION_CACHE_DIR"].add(cache_runs[0]["JAX_COMPILATION_CACHE_DIR"])
        for e in cache_runs:
            assert e["KILN_CACHE_DIR"] is None
            assert e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
            assert e["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"
            assert e["JAX_ENABLE_COMPILATION_CACHE"] == "true"
        # the rounds are interleaved and start at a different group each: the first run
        assert [x["jit"] for x in one][0] == ["kiln", "jax", "jax"][r]
    # a new, empty store and JAX cache every round, none of them the warm-up's
    assert len(cached["KILN_CACHE_DIR"]) == len(cached["JAX_COMPILATION_CACHE_DIR"]) == 3
    assert warm_up["env"]["KILN_CACHE_DIR"] not in cached["KILN_CACHE_DIR"]
    # Temporary stores are gone.
    for d in (warm_up["env"]["KILN_CACHE_DIR"], *cached["KILN_CACHE_DIR"],
              *cached["JAX_COMPILATION_CACHE_DIR"]):
        assert not Path(d).exists()


def test_demo_default_rounds(
    fake_example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    script, log = fake_example
    code, out, _ = _run(["demo", "--script", str(script), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["rounds"] == _demo.DEFAULT_ROUNDS >= 3
    assert [r["runs"] for r in data["rows"]] == [_demo.DEFAULT_ROUNDS] * 7
    assert len(log.read_text().splitlines()) == 1 + 7 * _demo.DEFAULT_ROUNDS


def test_demo_runs_must_be_positive(
    fake_example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    script, log = fake_example
    code, out, err = _run(["demo", "--script", str(script), "--runs", "0"], capsys)
    assert (code, out, err) == (2, "", "error: --runs must be >= 1, got 0\n")
    assert not log.exists()


def test_demo_table(fake_example: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    script, _ = fake_example
    code, out, _ = _run(["demo", "--script", str(script), "--runs", "2"], capsys)
    assert code == 0
    assert "median of 2 interleaved rounds" in out
    for label in DEMO_ROWS:
        row = next(line for line in out.splitlines() if line.startswith(f"│ {label} "))
        decorated = label.startswith("kiln,")
        time_s = "1.50" if decorated else "3.00"
        assert f"{time_s}-{time_s}" in row  # min-max
        if label.startswith("kiln run"):
            assert "x (wall)" in row
        else:
            assert ("0.50x" if decorated else "1.00x") in row
    assert out.splitlines()[-1] == (
        "fitted parameters identical in every row: 0.55 / 0.028 / 0.84 / 0.026"
    )


def test_demo_mismatching_params_fail(
    fake_example: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script, _ = fake_example
    monkeypatch.setenv("FAKE_A_jax", "0.56")
    code, out, err = _run(["demo", "--script", str(script)], capsys)
    assert code == 1
    differ = ("jax.jit, jax.jit + JAX persistent cache, cold, jax.jit + JAX persistent cache, "
              "warm, kiln run (jax.jit code unchanged), cold, kiln run (jax.jit code unchanged), "
              "warm")
    assert out.splitlines()[-1] == f"fitted parameters DIFFER from the first row in: {differ}"
    assert err.splitlines()[-1] == f"error: fitted parameters differ between rows: {differ}"


def test_demo_script_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('kaput', file=sys.stderr)\nsys.exit(3)\n")
    code, out, err = _run(["demo", "--script", str(script)], capsys)
    assert (code, out) == (1, "")
    assert f"error: {script} --jit kiln exited with status 3:\nkaput\n" in err


def test_demo_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.py"
    code, out, err = _run(["demo", "--script", str(missing)], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: demo script not found: {missing}; ")


def test_demo_default_script_is_the_shipped_program() -> None:
    import kiln_demo

    path = _demo._default_demo_script()
    assert path == Path(kiln_demo.__file__).parent / "lotka_volterra.py" and path.is_file()
    assert (path.parent / "hudson_bay.csv").is_file()


@pytest.mark.parametrize(("absent", "message"), [
    ("kiln_demo", "the demo program is not installed (package kiln_demo, part of kiln); "
                  "reinstall kiln, or pass --script PATH"),
    ("diffrax", "the demo needs diffrax, not installed; install kiln's examples extra: "
                "pip install 'jax-kiln[examples]'"),
])
def test_demo_without_its_program_or_the_examples_extra(
    absent: str, message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == absent else find_spec(name, *a))
    assert _run(["demo"], capsys) == (1, "", f"error: {message}\n")


@pytest.mark.slow
def test_demo_runs_from_a_non_editable_install(tmp_path: Path) -> None:
    """``pip install .`` (not editable) into a fresh venv; there, outside the checkout,
    ``kiln demo`` runs the program and reads the data that the installed package holds."""
    repo = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info into it
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (source / name).write_bytes((repo / name).read_bytes())
    shutil.copytree(repo / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp_path / "venv"
    run_child([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
              timeout=120)
    python = venv / "bin" / "python"
    paths = run_child(
        [python, "-c", "import sysconfig; p = sysconfig.get_paths(); "
         "print(p['purelib']); print(p['scripts'])"],
        check=True, timeout=60,
    ).stdout.split("\n")
    purelib, scripts = Path(paths[0]).resolve(), Path(paths[1])
    # kiln's dependencies, pip, setuptools and wheel from this interpreter's site-packages: a
    # folder named in a .pth file is added alone, without running the .pth files in it, so
    # the editable kiln installed there stays out
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (purelib / "outer.pth").write_text("\n".join(outer) + "\n")
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=None)  # the installed kiln, not src/

    pip = run_child(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
         "--ignore-installed", source],
        cwd=tmp_path, env=env, timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-4000:] + pip.stderr[-4000:]
    where = run_child(
        [python, "-c", "import kiln, kiln_demo; print(kiln.__file__); "
         "print(kiln_demo.__file__)"],
        cwd=tmp_path, env=env, timeout=120, check=True,
    ).stdout.split()
    kiln_file, demo_file = (Path(p).resolve() for p in where)
    assert kiln_file == purelib / "kiln" / "__init__.py"
    assert demo_file == purelib / "kiln_demo" / "__init__.py"

    # one round: the rounds themselves are the fast tests' business (test_demo_rows_...)
    proc = run_child([scripts / "kiln", "demo", "--runs", "1", "--json"], cwd=tmp_path, env=env,
                     timeout=1200)
    assert proc.returncode == 0, proc.stderr[-8000:]
    data = json.loads(proc.stdout)
    assert Path(data["script"]).resolve() == purelib / "kiln_demo" / "lotka_volterra.py"
    assert [r["mode"] for r in data["rows"]] == DEMO_ROWS
    assert [r["runs"] for r in data["rows"]] == [1] * len(DEMO_ROWS)
    assert data["identical_params"] is True
    # the shipped data's least-squares fit (src/kiln_demo/README.md)
    assert data["rows"][0]["params"] == pytest.approx(
        {"a": 0.540, "b": 0.0272, "c": 0.796, "d": 0.0237}, rel=0.01)


# -- a real process -----------------------------------------------------------------------------
@pytest.mark.slow
def test_python_dash_m_kiln_ls(filled: Path) -> None:
    env = child_env(KILN_CACHE_DIR=str(filled))
    proc = run_child([sys.executable, "-m", "kiln", "ls", "--json"], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["function"] for r in rows] == [DOUBLE, DOUBLE, INC]

    proc = run_child([sys.executable, "-m", "kiln", "clear"], env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"error: clear deletes every entry in {filled}; pass --yes to confirm\n"
