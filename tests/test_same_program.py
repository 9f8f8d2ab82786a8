"""Under ``kiln run --jit``, a function whose fingerprint changes while its program does not
is loaded, not compiled (the mode is never slower than JAX's cache, keyed by the module).

numpyro's ``MCMC`` keys its cache by ``id()`` of the model's arguments, and kiln's fingerprint
of ``numpyro.util._fori_collect_loop`` walks that cache: its fingerprint differs in every
process although the program it traces is the same. On a fingerprint miss kiln reads the call's
alias entry (``CallKeys.alias_key``: which entry this function and signature compiled last, from
which lowered module), and when this process's lowering is that module, loads the executable
instead of compiling it. A ``kiln.jit`` the user wrote keeps one entry per compile and no
alias. Real processes sharing one store (``Program`` in ``conftest.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.slow

PROG = '''\
import os
import warnings

import jax
import jax.numpy as jnp

import kiln
import kiln._miss._compile as _compile

# the manifests this process made (only what stores an entry under a fingerprint needs one)
MANIFESTS = []
_manifest_for = _compile.manifest_for


def _counted(*args, **kwargs):
    MANIFESTS.append(1)
    return _manifest_for(*args, **kwargs)


_compile.manifest_for = _counted

if os.environ.get("KILN_TEST_WARN"):  # a bad entry's StoreWarning shown, not raised
    warnings.simplefilter("always", kiln.StoreWarning)

# read by Python code only: a new value changes the fingerprint, not the program
TOKEN = {"run": os.environ["KILN_TEST_TOKEN"]}
SCALE = float(os.environ.get("KILN_TEST_SCALE", "2.0"))  # in the program (a constant)


@(kiln.jit if os.environ.get("KILN_TEST_DECORATED") else jax.jit)
def f(x):
    TRACE()
    if TOKEN["run"]:
        return jnp.sin(x) * SCALE + 1.0
    return x


x = jnp.arange(4.0)
call("f", f, x)
report(manifests=len(MANIFESTS))
'''


def _aliases(store: Any) -> list[Any]:
    """The alias entries' files in the local store (``kiln ls`` does not list them)."""
    return [path for path in store.rglob("*") if path.is_file()
            and b'"kind": "alias"' in path.read_bytes()[:4096]]


def _entries(store: Any) -> dict[str, int]:
    """Entries of ``f`` in the store by kind (``kiln ls --json``), and its aliases."""
    import sys

    from kiln_test_children import run_child

    out = run_child([sys.executable, "-m", "kiln", "ls", "--json", "--store", str(store)],
                    check=True).stdout
    kinds: dict[str, int] = {}
    for row in json.loads(out):
        if row["function"].endswith(".f"):
            kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    if _aliases(store):
        kinds["alias"] = len(_aliases(store))
    return kinds


def _close(rec: dict[str, Any], scale: float) -> list[float]:
    """The result of ``f`` in ``rec``, checked against NumPy's for ``SCALE = scale``."""
    import numpy as np

    assert "error" not in rec, rec["error"]
    got = rec["leaves"][0]
    want = np.sin(np.arange(4.0, dtype=np.float32)) * np.float32(scale) + 1
    np.testing.assert_allclose(got, want, rtol=1e-6)
    return got  # type: ignore[no-any-return]


MODE = ("-m", "kiln", "run", "--jit", "prog.py")


def _loaded_after_trace(rec: dict[str, Any]) -> None:
    """Traced and lowered (the fingerprint missed), then loaded: no compile."""
    assert "error" not in rec, rec["error"]
    assert rec["hits"] == 1 and rec["misses"] == 0, rec
    assert rec["py_traces"] == 1 and rec["jax_lowerings"] >= 1, rec
    assert rec["compiles"] == 0 and rec["xla_compiles"] == 0, rec


def test_a_fingerprint_that_changes_every_run_loads_the_same_program(
        tmp_path: Any, xp: Any) -> None:
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    first = p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"]
    xp.assert_cold(first)
    want = _close(first, 2.0)  # every later run: the very same values
    assert _entries(p.cache) == {"executable": 1, "alias": 1}

    # new fingerprints, the same program: loaded; stored under the new fingerprint twice
    for i, token in enumerate("bc", start=2):
        run = p.run(main=MODE, env={"KILN_TEST_TOKEN": token})
        rec = run["f"]
        _loaded_after_trace(rec)
        assert rec["leaves"] == [want]
        assert rec["stores_written"] == 1, rec  # the copy (the alias is not counted)
        assert run.extra["manifests"] == 1  # (stored with its manifest)
        assert _entries(p.cache) == {"executable": i, "alias": 1}
    # a fingerprint that changes in every process: loaded, and the store no longer grows;
    # nothing is stored under the fingerprint, so no manifest is made (keyed by the module)
    for token in "de":
        run = p.run(main=MODE, env={"KILN_TEST_TOKEN": token})
        rec = run["f"]
        _loaded_after_trace(rec)
        assert rec["leaves"] == [want]
        assert rec["stores_written"] == 0, rec
        assert run.extra["manifests"] == 0
    assert _entries(p.cache) == {"executable": 3, "alias": 1}

    # a fingerprint seen before hits its entry without tracing (the copy is a real entry)
    again = p.run(main=MODE, env={"KILN_TEST_TOKEN": "c"})["f"]
    xp.assert_warm(again)
    assert again["leaves"] == [want]
    # a fingerprint that comes again after it was loaded only is stable after all: stored now,
    # and warm from the next run
    rec = p.run(main=MODE, env={"KILN_TEST_TOKEN": "e"})["f"]
    _loaded_after_trace(rec)
    assert rec["stores_written"] == 1, rec
    xp.assert_warm(p.run(main=MODE, env={"KILN_TEST_TOKEN": "e"})["f"])
    assert _entries(p.cache) == {"executable": 4, "alias": 1}


def test_a_fingerprint_that_changed_once_warm_starts_from_the_next_run(
        tmp_path: Any, xp: Any) -> None:
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    xp.assert_cold(p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"])
    _loaded_after_trace(p.run(main=MODE, env={"KILN_TEST_TOKEN": "b"})["f"])
    warm = p.run(main=MODE, env={"KILN_TEST_TOKEN": "b"})["f"]
    xp.assert_warm(warm)
    _close(warm, 2.0)


def test_a_changed_program_under_a_changed_fingerprint_is_compiled(
        tmp_path: Any, xp: Any) -> None:
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    xp.assert_cold(p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"])
    # SCALE is a constant of the program: another lowered module, never the stored executable
    changed = p.run(main=MODE, env={"KILN_TEST_TOKEN": "a", "KILN_TEST_SCALE": "3.0"})["f"]
    xp.assert_cold(changed)
    _close(changed, 3.0)
    # and the first program's entry is still there, and right
    back = p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"]
    xp.assert_warm(back)
    _close(back, 2.0)
    # a new fingerprint of the changed program: the alias now names the changed program
    again = p.run(main=MODE, env={"KILN_TEST_TOKEN": "z", "KILN_TEST_SCALE": "3.0"})["f"]
    _loaded_after_trace(again)
    assert again["leaves"] == changed["leaves"]


def test_a_bad_alias_entry_is_warned_about_and_the_call_compiles(
        tmp_path: Any, xp: Any) -> None:
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    xp.assert_cold(p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"])
    aliases = _aliases(p.cache)
    assert len(aliases) == 1, aliases
    blob = aliases[0].read_bytes()
    aliases[0].write_bytes(blob[:-8] + bytes(8))  # the digest no longer verifies
    run = p.run(main=MODE, env={"KILN_TEST_TOKEN": "b", "KILN_TEST_WARN": "1"})
    rec = run["f"]
    xp.assert_cold(rec)
    assert rec["bad_entries"] == 1, rec
    assert "is unusable" in run.stderr
    _close(rec, 2.0)
    # the alias was replaced: the next new fingerprint loads without compiling
    _loaded_after_trace(p.run(main=MODE, env={"KILN_TEST_TOKEN": "c", "KILN_TEST_WARN": "1"})["f"])


def test_a_kiln_jit_function_keeps_one_entry_per_compile(tmp_path: Any, xp: Any) -> None:
    """No alias for the user's own ``kiln.jit``: its fingerprint is the user's to fix
    (``KILN_EXPLAIN=1`` names what changed), and a changed fingerprint compiles once."""
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    for token in "ab":
        xp.assert_cold(p.run(env={"KILN_TEST_TOKEN": token, "KILN_TEST_DECORATED": "1"})["f"])
    assert _entries(p.cache) == {"executable": 2}
    xp.assert_warm(p.run(env={"KILN_TEST_TOKEN": "b", "KILN_TEST_DECORATED": "1"})["f"])


def test_the_alias_works_through_a_shared_redis_store(tmp_path: Any, xp: Any,
                                                       redis_url: str) -> None:
    """Each run a fresh host (its own local store) with one signed Redis store behind all: the
    alias and the copies travel through Redis (its put keeps what it holds; an alias is
    replaced), and a host that holds nothing loads the program another host compiled."""
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)

    def host(i: int, token: str) -> dict[str, Any]:
        return p.run(main=MODE, env={"KILN_TEST_TOKEN": token, "KILN_STORE": redis_url,
                                     "KILN_SIGNING_KEY": "fleet-secret",
                                     "KILN_CACHE_DIR": str(tmp_path / f"host-{i}")})["f"]

    first = host(0, "a")
    xp.assert_cold(first)
    want = _close(first, 2.0)
    for i, token in enumerate("bcd", start=1):
        rec = host(i, token)
        _loaded_after_trace(rec)
        assert rec["leaves"] == [want]
        # copies under the first two new fingerprints, then loaded only
        assert rec["stores_written"] == (1 if i <= 2 else 0), rec
    warm = host(4, "c")  # a fingerprint a copy was stored under, on a host holding nothing
    xp.assert_warm(warm)
    assert warm["leaves"] == [want]


def _entry_file(store: Any, key: str) -> Any:
    """The local store's file of the entry ``key``."""
    found = [path for path in store.rglob(f"{key}*") if path.is_file()]
    assert len(found) == 1, found
    return found[0]


def _keys_of_f(store: Any) -> set[str]:
    import sys

    from kiln_test_children import run_child

    out = run_child([sys.executable, "-m", "kiln", "ls", "--json", "--store", str(store)],
                    check=True).stdout
    return {row["key"] for row in json.loads(out) if row["function"].endswith(".f")}


def test_a_bad_entry_under_a_fingerprint_seen_before_is_replaced_by_the_same_program(
        tmp_path: Any, xp: Any) -> None:
    """Its own entry truncated, after the copies in a row ran out: loaded through the alias,
    and the bad entry replaced (warm again from the next run), as the warning says."""
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    xp.assert_cold(p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"])
    (key_a,) = _keys_of_f(p.cache)
    for token in "bc":
        _loaded_after_trace(p.run(main=MODE, env={"KILN_TEST_TOKEN": token})["f"])
    path = _entry_file(p.cache, key_a)
    path.write_bytes(path.read_bytes()[:100])
    run = p.run(main=MODE, env={"KILN_TEST_TOKEN": "a", "KILN_TEST_WARN": "1"})
    rec = run["f"]
    _loaded_after_trace(rec)
    assert rec["bad_entries"] == 1 and rec["stores_written"] == 1, rec
    assert "recompiling and replacing it" in run.stderr
    warm = p.run(main=MODE, env={"KILN_TEST_TOKEN": "a"})["f"]
    xp.assert_warm(warm)
    _close(warm, 2.0)


def test_a_process_without_the_signing_key_leaves_a_signed_alias_alone(
        tmp_path: Any, xp: Any) -> None:
    p = xp.Program(tmp_path)
    p.write("prog.py", PROG)
    signed = {"KILN_SIGNING_KEY": "fleet-secret"}
    xp.assert_cold(p.run(main=MODE, env={"KILN_TEST_TOKEN": "a", **signed})["f"])
    (alias,) = _aliases(p.cache)
    before = alias.read_bytes()
    # no key: the signed entries are not loaded (warned), it compiles, and writes no alias
    run = p.run(main=MODE, env={"KILN_TEST_TOKEN": "b", "KILN_TEST_WARN": "1"})
    xp.assert_cold(run["f"])
    assert "leaving the entry as it is" in run.stderr
    assert alias.read_bytes() == before
    # a process with the key still loads the signed program through it
    _loaded_after_trace(p.run(main=MODE, env={"KILN_TEST_TOKEN": "c", **signed})["f"])
