"""Bundles: ``kiln export`` writes entries of a store into one file,
``kiln import`` loads those that fit into a store on another machine.

A bundle with a changed byte, or signed with another ``KILN_SIGNING_KEY``, is refused as a
whole (exit 1, nothing imported); an entry that does not verify, or was built for another
kiln / jax / jaxlib, platform or devices, is reported and not loaded. The CLI is tested through
``main(argv)``; the last tests run real processes: one compiles into store A, ``kiln export``
and ``kiln import`` copy into an empty store B, and a fresh process runs from B with no trace
and no compile.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from kiln_test_children import child_env, run_child

import kiln
from kiln._base import decode, encode
from kiln._cli import main
from kiln._travel._bundle import decode_bundle, encode_bundle
from kiln.stores import LocalStore


def _double(x: Any) -> Any:
    return x * 2


def _inc(x: Any) -> Any:
    return x + 1


DOUBLE = f"{_double.__module__}._double"
INC = f"{_inc.__module__}._inc"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _keys(store_dir: Path) -> set[str]:
    return set(LocalStore(str(store_dir)).iter()) if store_dir.exists() else set()


def _keys_of(store_dir: Path, function: str) -> set[str]:
    store = LocalStore(str(store_dir))
    return {k for k in store.iter() if (store.header(k) or {}).get("function") == function}


@pytest.fixture
def store_a(kiln_store: Path) -> Path:
    """Store A (the configured store) holding one entry of _double and one of _inc."""
    for fun in (_double, _inc):
        f = kiln.jit(fun)
        f.clear_cache()  # compiled by an earlier test of this process: compile into this store
        f(jnp.ones(3))
    assert len(_keys_of(kiln_store, DOUBLE)) == 1 and len(_keys_of(kiln_store, INC)) == 1
    return kiln_store


def _warm_call(store_dir: Path) -> tuple[kiln.Stats, list[float]]:
    """Call a fresh kiln.jit(_double) with ``store_dir`` as the store: its counts and value."""
    kiln.configure(cache_dir=store_dir)
    double = kiln.jit(_double)
    double.clear_cache()  # this process's executables (jax's dispatch cache holds _double's)
    kiln.reset_stats()
    out = double(jnp.ones(3))
    return kiln.stats(), np.asarray(out).tolist()


# -- export and import ----------------------------------------------------------------------------
def test_export_then_import_loads_every_entry_and_runs_warm(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    everything = _keys(store_a)
    code, out, err = _run(["export", str(bundle)], capsys)
    assert (code, err) == (0, "")
    assert out.startswith(f"exported {len(everything)} entries of ")
    assert out.rstrip().endswith(f"SHA-256, not signed) from {store_a} to {bundle}")
    assert bundle.stat().st_mode & 0o777 == 0o600  # a bundle holds native code

    code, out, err = _run(["import", "--cache-dir", str(store_b), str(bundle)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-1] == (f"{len(everything)} entries in {bundle}: {len(everything)} loaded, "
                         f"0 already in the store, 0 skipped; store: {store_b}")
    (double_key,) = _keys_of(store_a, DOUBLE)
    assert f"loaded  {double_key[:12]} {DOUBLE}" in lines
    assert _keys(store_b) == everything
    for key in everything:  # byte for byte
        assert LocalStore(str(store_b)).get(key) == LocalStore(str(store_a)).get(key)

    stats, value = _warm_call(store_b)
    assert (stats.hits, stats.misses, stats.traces, stats.compiles) == (1, 0, 0, 0)
    assert value == [2.0, 2.0, 2.0]


def test_import_again_reports_entries_present(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    assert main(["export", str(bundle), "--function", "_inc"]) == 0
    assert main(["import", str(bundle), "--cache-dir", str(store_b)]) == 0
    capsys.readouterr()
    code, out, _ = _run(["import", "--json", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert code == 0
    data = json.loads(out)
    (inc_key,) = _keys_of(store_a, INC)
    assert (data["loaded"], data["present"], data["skipped"]) == (0, 1, 0)
    assert data["entries"] == [{"key": inc_key, "function": INC, "status": "present",
                                "reason": None}]


def test_import_replaces_a_corrupt_entry_under_the_same_key(
    store_a: Path, tmp_path: Path
) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    (key,) = _keys_of(store_a, DOUBLE)
    assert kiln.export_entries(bundle, functions=[DOUBLE]) == 1
    LocalStore(str(store_b)).put(key, b"garbage")
    with kiln.config_context(cache_dir=store_b):
        report = kiln.import_entries(bundle)
    assert [e.status for e in report.entries] == ["loaded"]
    assert LocalStore(str(store_b)).get(key) == LocalStore(str(store_a)).get(key)


# -- refusals of the whole bundle -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("where", "offset", "message"),
    [
        ("magic", 0, "the file is not a kiln bundle (bad magic bytes)"),
        ("manifest", 40, "bundle digest does not match (changed or damaged)"),
        ("an entry", -100, "bundle digest does not match (changed or damaged)"),
        ("the digest", -1, "bundle digest does not match (changed or damaged)"),
    ],
)
def test_a_changed_byte_refuses_the_whole_bundle(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    where: str, offset: int, message: str,
) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    assert main(["export", str(bundle)]) == 0
    data = bytearray(bundle.read_bytes())
    data[offset] ^= 0x01
    bundle.write_bytes(bytes(data))
    capsys.readouterr()
    code, out, err = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {bundle}: {message}; nothing was imported; ")
    assert _keys(store_b) == set()


def test_a_truncated_bundle_is_refused(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    assert main(["export", str(bundle)]) == 0
    bundle.write_bytes(bundle.read_bytes()[:-10])
    capsys.readouterr()
    code, _, err = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert code == 1
    assert "the bundle is truncated or padded" in err and "nothing was imported" in err
    assert _keys(store_b) == set()


def test_a_bundle_signed_with_another_key_is_refused(
    kiln_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kiln.configure(signing_key="key-X")
    double = kiln.jit(_double)
    double.clear_cache()
    double(jnp.ones(3))
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    code, out, _ = _run(["export", str(bundle)], capsys)
    assert code == 0 and "signed with KILN_SIGNING_KEY" in out

    kiln.configure(signing_key="key-Y")
    code, out, err = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert (code, out) == (1, "")
    assert err == (f"error: {bundle}: bundle digest does not match (changed or signed with "
                   "another KILN_SIGNING_KEY); nothing was imported; import it with the "
                   "KILN_SIGNING_KEY it was exported with, or copy or export it again\n")
    kiln.configure(signing_key=None)
    code, _, err = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert code == 1 and "the bundle is signed but KILN_SIGNING_KEY is not set" in err
    assert _keys(store_b) == set()

    kiln.configure(signing_key="key-X")
    code, out, _ = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert code == 0 and "1 loaded" in out
    assert _keys(store_b) == _keys(kiln_store)


def test_an_unsigned_bundle_is_refused_where_a_key_is_set(
    store_a: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "b.kilnbundle"
    kiln.export_entries(bundle)
    with (
        kiln.config_context(signing_key="key-X", cache_dir=tmp_path / "B"),
        pytest.raises(kiln.BundleError, match="the bundle is not signed but KILN_SIGNING_KEY "
                      "is set; nothing was imported"),
    ):
        kiln.import_entries(bundle)
    assert _keys(tmp_path / "B") == set()


# -- entries that do not fit ----------------------------------------------------------------------
def _rewrite_part(store_dir: Path, key: str, name: str, value: str) -> None:
    """Give the entry under ``key`` another key part ``name`` (validly re-encoded: as if built
    elsewhere)."""
    store = LocalStore(str(store_dir))
    blob = store.get(key)
    assert blob is not None
    entry = decode(blob, signing_key=None)
    parts = entry.header["key_parts"]
    assert [p[0] for p in parts].count(name) == 1
    header = {**entry.header, "key_parts": [[n, value if n == name else v] for n, v in parts]}
    header.pop("sections")
    store.put(key, encode(header, entry.sections, signing_key=None))


@pytest.mark.parametrize(
    ("part", "value", "reason"),
    [
        ("jaxlib", "0.0.1", f"built for jaxlib 0.0.1 (here {jaxlib.__version__})"),
        ("kiln", "9.9.9", "built for kiln 9.9.9 (here "),
        ("device", "TPU v9 x4", "built for devices TPU v9 x4 (here "),
        ("backend", "tpu 1.0", "built for platform tpu 1.0 (here "),
        # a job of another topology (jax.distributed: processes x local devices)
        ("processes", "4 x2", "built for job topology 4 x2 (here 1 x1)"),
        # a CPU executable of another machine kind (XLA:CPU compiles for the host's
        # instruction set, and its loader rejects a foreign one)
        ("machine", "aarch64 sve2 0badc0de", "built for machine kind aarch64 sve2 0badc0de (here "),
    ],
)
def test_an_entry_built_elsewhere_is_reported_and_not_loaded(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    part: str, value: str, reason: str,
) -> None:
    (double_key,) = _keys_of(store_a, DOUBLE)
    (inc_key,) = _keys_of(store_a, INC)
    _rewrite_part(store_a, double_key, part, value)
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    assert main(["export", str(bundle), "--function", "_double", "--function", "_inc"]) == 0
    capsys.readouterr()
    code, out, err = _run(["import", str(bundle), "--cache-dir", str(store_b)], capsys)
    assert code == 0
    lines = out.splitlines()
    (skipped,) = [ln for ln in lines if ln.startswith("skipped")]
    assert skipped.startswith(f"skipped {double_key[:12]} {DOUBLE}: {reason}")
    assert f"loaded  {inc_key[:12]} {INC}" in lines
    assert lines[-1].endswith("1 loaded, 0 already in the store, 1 skipped; "
                              f"store: {store_b}")
    assert "kiln compiles their functions on first call here" in err
    assert _keys(store_b) == {inc_key}


def test_an_entry_that_does_not_verify_is_reported_and_skipped(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundle is valid (its digest holds) but one entry inside is not: it alone is
    skipped."""
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    kiln.export_entries(bundle, functions=["_double", "_inc"])
    manifest, items = decode_bundle(bundle.read_bytes(), signing_key=None)
    rows, blobs = [], []
    for row, blob in items:
        if row["function"] == DOUBLE:
            blob = blob[:100] + bytes([blob[100] ^ 1]) + blob[101:]
            row = {**row, "sha256": hashlib.sha256(blob).hexdigest()}
        rows.append(row)
        blobs.append(blob)
    bundle.write_bytes(encode_bundle({**manifest, "entries": rows}, blobs, signing_key=None))
    with kiln.config_context(cache_dir=store_b):
        report = kiln.import_entries(bundle)
    assert [(e.function, e.status) for e in report.entries] == [
        (r["function"], "skipped" if r["function"] == DOUBLE else "loaded") for r in rows
    ]
    (bad,) = report.skipped
    assert bad.reason == "does not verify here: entry digest mismatch (corrupt or tampered)"
    assert _keys(store_b) == _keys_of(store_a, INC)


# -- export ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("names", "functions"),
    [
        (["_inc"], [INC]),
        ([DOUBLE], [DOUBLE]),
        (["_inc", DOUBLE], [DOUBLE, INC]),
    ],
)
def test_export_function_filter(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    names: list[str], functions: list[str],
) -> None:
    bundle = tmp_path / "b.kilnbundle"
    argv = ["export", "--json", str(bundle)]
    for name in names:
        argv += ["--function", name]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    data = json.loads(out)
    assert sorted(r["function"] for r in data["entries"]) == functions
    manifest, items = decode_bundle(bundle.read_bytes(), signing_key=None)
    assert sorted(row["function"] for row, _ in items) == functions
    assert manifest["jaxlib"] == jaxlib.__version__
    assert data["bytes"] == bundle.stat().st_size


def test_export_with_no_matching_entry_fails(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "b.kilnbundle"
    code, out, err = _run(["export", str(bundle), "--function", "dou"], capsys)
    assert (code, out) == (1, "")
    assert err == (f"error: no entries of function 'dou' in {store_a}; nothing was written "
                   "('kiln ls' lists the functions in the store)\n")
    assert not bundle.exists()
    code, _, err = _run(["export", str(bundle), "--cache-dir", str(tmp_path / "empty")], capsys)
    assert code == 1 and err.startswith(f"error: no entries in {tmp_path / 'empty'}; ")
    assert not bundle.exists()


def test_export_leaves_out_an_entry_that_does_not_verify(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (double_key,) = _keys_of(store_a, DOUBLE)
    path = store_a / "entries" / double_key[:2] / f"{double_key}.kiln"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(bytes(data))
    bundle = tmp_path / "b.kilnbundle"
    code, out, err = _run(["export", str(bundle), "--function", "_double", "--function", "_inc"],
                          capsys)
    assert code == 0
    assert err == (f"entry {double_key[:12]} not exported: entry digest mismatch (corrupt or "
                   "tampered)\n")
    assert out.startswith("exported 1 entry of 1 function(s)")
    with pytest.warns(kiln.StoreWarning, match=f"entry {double_key[:12]} .* not exported"):
        assert kiln.export_entries(bundle, functions=["_double", "_inc"]) == 1
    with pytest.raises(kiln.BundleError, match=re.escape(
            f"none of the 1 entries of function '_double' in {store_a} can be exported")):
        kiln.export_entries(bundle, functions="_double")


def test_entries_of_every_kind_with_a_key_travel(kiln_store: Path, tmp_path: Path) -> None:
    """Not only executables: a verify-only marker (and any other kind) that names its key."""
    store = LocalStore(str(kiln_store))
    key = "ab" * 32
    store.put(key, encode({"kind": "verify-only", "function": "m.f", "key": key}, {},
                          signing_key=None))
    store.put("cd" * 32, encode({"kind": "other", "function": "m.g"}, {}, signing_key=None))
    bundle = tmp_path / "b.kilnbundle"
    with pytest.warns(kiln.StoreWarning, match="entry header names no key"):
        assert kiln.export_entries(bundle) == 1
    with kiln.config_context(cache_dir=tmp_path / "B"):
        report = kiln.import_entries(bundle)
    assert [(e.key, e.function, e.status) for e in report.entries] == [(key, "m.f", "loaded")]


# -- the Python API -------------------------------------------------------------------------------
def test_python_api(store_a: Path, tmp_path: Path) -> None:
    bundle, store_b = tmp_path / "b.kilnbundle", tmp_path / "B"
    assert kiln.export_entries(bundle, functions="_double") == 1
    assert kiln.export_entries(str(bundle), functions=None) == len(_keys(store_a))
    with kiln.config_context(cache_dir=store_b):
        report = kiln.import_entries(bundle)
    assert isinstance(report, kiln.ImportReport)
    assert report.bundle == str(bundle) and report.store == str(store_b)
    assert {e.key for e in report.loaded} == _keys(store_a) == _keys(store_b)
    assert report.present == () and report.skipped == ()
    assert all(isinstance(e, kiln.ImportedEntry) and e.reason is None for e in report.entries)

    with pytest.raises(kiln.BundleError, match="no entries of function 'nope'"):
        kiln.export_entries(tmp_path / "none.kilnbundle", functions=["nope"])
    bundle.write_bytes(bundle.read_bytes()[:-1] + b"\x00")
    with (
        kiln.config_context(cache_dir=tmp_path / "C"),
        pytest.raises(kiln.BundleError, match="bundle digest does not match"),
    ):
        kiln.import_entries(bundle)
    assert _keys(tmp_path / "C") == set()


def test_import_into_the_null_store_is_refused(store_a: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "b.kilnbundle"
    kiln.export_entries(bundle)
    with kiln.config_context(store="null"), pytest.raises(kiln.BundleError, match="'null'"):
        kiln.import_entries(bundle)


# -- real processes -------------------------------------------------------------------------------
PROG = '''\
import jax.numpy as jnp
import kiln


@kiln.jit
def scaled(x):
    TRACE()
    return jnp.sin(x) * 3 + 1


call("scaled", scaled, jnp.arange(4.0))
report()
'''


def _kiln_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_child([sys.executable, "-m", "kiln", *args],
                     env=child_env(JAX_PLATFORMS="cpu", **env), timeout=180)


@pytest.mark.slow
def test_a_fresh_process_runs_imported_entries_with_no_trace_and_no_compile(
    tmp_path: Path, xp: Any
) -> None:
    key = {"KILN_SIGNING_KEY": "fleet-key"}
    prog = xp.Program(tmp_path, base_env=key)
    prog.write("prog.py", PROG)
    cold = prog.run()
    xp.assert_cold(cold["scaled"])
    expected = (np.sin(np.arange(4.0, dtype=np.float32)) * 3 + 1).tolist()
    np.testing.assert_allclose(xp.value(cold["scaled"]), expected, rtol=1e-6)

    bundle, store_b = tmp_path / "scaled.kilnbundle", tmp_path / "B"
    done = _kiln_cli("export", str(bundle), "--function", "scaled",
                     env={**key, "KILN_CACHE_DIR": str(prog.cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("exported 1 entry of 1 function(s)")

    # another key: refused as a whole, nothing imported
    done = _kiln_cli("import", str(bundle),
                     env={"KILN_SIGNING_KEY": "other-key", "KILN_CACHE_DIR": str(store_b)})
    assert done.returncode == 1 and done.stdout == ""
    assert "bundle digest does not match (changed or signed with another KILN_SIGNING_KEY)" \
        in done.stderr
    assert _keys(store_b) == set()

    done = _kiln_cli("import", str(bundle), env={**key, "KILN_CACHE_DIR": str(store_b)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"1 entry in {bundle}: 1 loaded, ")

    warm = prog.run(env={"KILN_CACHE_DIR": str(store_b)})
    xp.assert_warm(warm["scaled"])
    assert xp.value(warm["scaled"]) == xp.value(cold["scaled"])


def test_export_never_replaces_a_link_or_a_device(
    store_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    real = tmp_path / "real.txt"
    real.write_text("keep me")
    link = tmp_path / "link.kilnbundle"
    link.symlink_to(real)
    for target in (link, tmp_path):  # a symlink, a folder
        capsys.readouterr()
        code, out, err = _run(["export", str(target)], capsys)
        assert code == 1 and out == ""
        assert "exists and is not a regular file" in err, err
    assert link.is_symlink() and real.read_text() == "keep me"


def test_a_manifest_nested_past_the_recursion_limit_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A crafted bundle with a valid digest: refused with exit 1, never a traceback."""
    from kiln._base import digest
    from kiln._travel._bundle import _PREFIX, FORMAT_VERSION, MAGIC

    manifest = b"[" * 200_000 + b"]" * 200_000
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(manifest), 0, 0) + manifest
    bundle = tmp_path / "deep.kilnbundle"
    bundle.write_bytes(body + digest(body, None))
    code, out, err = _run(["import", str(bundle), "--cache-dir", str(tmp_path / "B")], capsys)
    assert (code, out) == (1, "")
    assert "the bundle manifest is malformed" in err and "Traceback" not in err
