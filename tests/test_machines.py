"""Heterogeneous fleets: an entry is only ever loaded on the kind of machine it was
compiled for.

XLA:CPU compiles for the host's instruction set; the key's ``machine`` part holds the
architecture and the instruction-set features (kiln._keys._machine). Two simulated hosts (the
detection patched in each process: ``HOST_FEATURES``) on one store, local or Redis, get
different keys and never replace each other's entries; processes of one kind share theirs.
A loaded entry the loader rejects is a bad entry with the loader's reason, recompiled.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

import kiln
from kiln._base import _jax_compat
from kiln._cli import main
from kiln._keys import _machine
from kiln._miss import _reader
from kiln.stores import LocalStore

AVX512 = ("fpu vme sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma bmi1 bmi2 avx512f avx512bw "
          "avx512vl hypervisor constant_tsc")
AVX2 = "fpu vme sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma bmi1 bmi2 hypervisor constant_tsc"


@pytest.fixture
def fresh_detection(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """cpu_features / cpu_kind computed again from a patched reading (then restored)."""
    _machine.cpu_features.cache_clear()
    _machine.cpu_kind.cache_clear()

    def read(flags: str) -> None:
        _machine.cpu_features.cache_clear()
        _machine.cpu_kind.cache_clear()
        monkeypatch.setattr(_machine, "_read_cpu_features", lambda: flags.split())

    yield read
    _machine.cpu_features.cache_clear()
    _machine.cpu_kind.cache_clear()


def test_the_machine_kind_holds_instruction_set_features_only(fresh_detection) -> None:
    fresh_detection(AVX512)
    features = _machine.cpu_features()
    # normalised, sorted, and only instruction-set extensions (not the hypervisor, timers)
    assert features == tuple(sorted(features))
    assert {"avx512f", "avx2", "pni", "sse4_2"} <= set(features)
    assert not {"hypervisor", "constant_tsc", "fpu", "vme"} & set(features)
    avx512 = _machine.cpu_kind()
    # the same flags in another order and case: the same kind
    fresh_detection(" ".join(reversed(AVX512.upper().split())))
    assert _machine.cpu_kind() == avx512
    # a flag that is not an instruction-set extension does not split a fleet
    fresh_detection(AVX512 + " md_clear flush_l1d")
    assert _machine.cpu_kind() == avx512
    fresh_detection(AVX2)
    avx2 = _machine.cpu_kind()
    assert avx2 != avx512
    assert " avx2 " in avx2 and " avx512 " in avx512


def test_the_key_of_a_cpu_executable_holds_the_machine_kind() -> None:
    from kiln._keys._key import environment_parts, machine

    parts = dict(environment_parts())
    assert parts["machine"] == machine() == _machine.cpu_kind()
    assert parts["machine"].startswith(_machine.platform.machine().lower())


PROG = '''
import os

import jax
import jax.numpy as jnp

import kiln
from kiln._keys import _machine

if os.environ.get("HOST_FEATURES"):  # this process simulates a host of another kind
    _machine._read_cpu_features = lambda: os.environ["HOST_FEATURES"].split()


@kiln.jit
def step(x):
    TRACE()
    return jnp.tanh(x) * 3.0 + 1.0


call("step", step, jnp.arange(4.0))
eager = jnp.cos(jnp.arange(3.0)) * 2.0  # plain JAX through the kiln:// route
report(machine=_machine.cpu_kind(), eager=eager.tolist())
'''


def _entries(store_dir: Path) -> dict[str, dict[str, Any]]:
    store = LocalStore(str(store_dir))
    return {k: store.header(k) or {} for k in store.iter()}


def _machine_of(header: dict[str, Any]) -> str | None:
    for name, value in header.get("key_parts") or ():
        if name == "machine":
            return str(value)
    return header.get("machine")


def _hosts(prog: Any, xp: Any, env: dict[str, str]) -> None:
    """Host A (AVX-512) and host B (AVX2), cold then warm, alternating, on one store."""
    a = {"HOST_FEATURES": AVX512, "KILN_JAX_CACHE": "1", **env}
    b = {"HOST_FEATURES": AVX2, "KILN_JAX_CACHE": "1", **env}
    a_cold = prog.run(env=a)
    xp.assert_cold(a_cold["step"])
    b_cold = prog.run(env=b)  # the other kind: its own key, compiled there, A's entry kept
    xp.assert_cold(b_cold["step"])
    assert a_cold.extra["machine"] != b_cold.extra["machine"]
    assert b_cold.stats["bad_entries"] == 0  # never loaded A's entry, never replaced it
    a_warm = prog.run(env=a)  # A's entry is still A's
    xp.assert_warm(a_warm["step"])
    b_warm = prog.run(env=b)
    xp.assert_warm(b_warm["step"])
    for run in (a_warm, b_warm):
        assert run.stats["bad_entries"] == 0 and run.stats["jax_cache_misses"] == 0
        assert run.stats["jax_cache_hits"] > 0  # the route's values are per kind too
    values = {json.dumps((r["step"]["leaves"], r.extra["eager"]))
              for r in (a_cold, b_cold, a_warm, b_warm)}
    assert len(values) == 1


@pytest.mark.slow
def test_two_kinds_of_host_on_one_store_keep_their_own_entries(tmp_path: Path, xp: Any) -> None:
    prog = xp.Program(tmp_path)
    prog.write("prog.py", PROG)
    _hosts(prog, xp, {})
    entries = _entries(prog.cache)
    machines = {_machine_of(h) for h in entries.values()}
    assert len(machines) == 2 and None not in machines
    steps = [h for h in entries.values() if h.get("function", "").endswith(".step")]
    assert len(steps) == 2 and {_machine_of(h) for h in steps} == machines
    # JAX's cache values through the route: one per program per kind
    route = [h for h in entries.values() if h.get("kind") == "jax-cache"]
    assert route and {_machine_of(h) for h in route} == machines
    by_kind = {m: sum(_machine_of(h) == m for h in route) for m in machines}
    assert len(set(by_kind.values())) == 1, by_kind


@pytest.mark.slow
def test_two_kinds_of_host_share_redis_each_with_its_own_entries(
    tmp_path: Path, xp: Any, redis_url: str
) -> None:
    prog = xp.Program(tmp_path)
    prog.write("prog.py", PROG)
    env = {"KILN_STORE": redis_url, "KILN_SIGNING_KEY": "fleet-secret"}
    a = {"HOST_FEATURES": AVX512, "KILN_JAX_CACHE": "1", **env}
    b = {"HOST_FEATURES": AVX2, "KILN_JAX_CACHE": "1", **env}
    xp.assert_cold(prog.run(env=a)["step"])
    xp.assert_cold(prog.run(env=b)["step"])
    # a fresh local directory per run: every hit comes from Redis
    for i, host in enumerate((a, b, a)):
        run = prog.run(env={**host, "KILN_CACHE_DIR": str(tmp_path / f"fresh{i}")})
        xp.assert_warm(run["step"])
        assert run.stats["bad_entries"] == 0 and run.stats["remote_hits"] >= 1


def test_ls_and_stats_show_the_machine_kinds_a_store_serves(
    kiln_store: Path, fresh_detection, capsys: pytest.CaptureFixture[str]
) -> None:
    kinds = []
    for flags in (AVX512, AVX2):
        fresh_detection(flags)
        from kiln._keys import _key

        _key._static_environment.cache_clear()
        kinds.append(_machine.cpu_kind())
        f = kiln.jit(lambda x: x * 2.0 + 1.0)
        f.clear_cache()
        f(jnp.ones(3))
    _key._static_environment.cache_clear()
    assert main(["stats", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["machines"] == {kinds[0]: 1, kinds[1]: 1}
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert "machine kinds (entries each):" in out and kinds[0] in out and kinds[1] in out
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "MACHINE" in out.splitlines()[0]  # two kinds in the store: the column is shown
    assert main(["ls", "--json", "--machine", " avx2 "]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["machine"] for r in rows] == [kinds[1]]
    assert main(["ls", "--machine", "aarch64"]) == 0
    assert "no entries in" in capsys.readouterr().err


def test_an_entry_the_loader_rejects_is_a_bad_entry_compiled_again(
    kiln_store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As XLA:CPU's loader does with an executable of another machine type (jax-ml/jax
    #38445): the entry is not used, the reason is said, the function compiles here and the
    entry is replaced; the result is right."""

    def f(x):
        return jnp.sin(x) + 2.0

    cold = kiln.jit(f)
    cold.clear_cache()
    want = cold(jnp.arange(3.0)).tolist()
    reason = ("INVALID_ARGUMENT: Machine type used for XLA:CPU compilation doesn't match the "
              "machine type for execution")

    def reject(*args: Any, **kwargs: Any) -> Any:
        raise _jax_compat.Unserializable(reason)  # any exception the loader raises

    warm = kiln.jit(f)
    warm.clear_cache()
    kiln.reset_stats()
    with monkeypatch.context() as m, kiln.config_context(explain=True), \
            caplog.at_level("WARNING", logger="kiln"):
        m.setattr(_reader._jax_compat, "load_compiled", reject)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = warm(jnp.arange(3.0)).tolist()
    # KILN_EXPLAIN says it too, with the loader's reason
    assert any("could not be loaded" in r.getMessage() and "Machine type used for XLA:CPU"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert got == want
    s = kiln.stats()
    assert (s.bad_entries, s.hits, s.compiles, s.stores_written) == (1, 0, 1, 1)
    texts = [str(w.message) for w in caught]
    assert any("could not be loaded" in t and "Machine type used for XLA:CPU" in t
               for t in texts), texts
    # the replaced entry loads
    again = kiln.jit(f)
    again.clear_cache()
    kiln.reset_stats()
    assert again(jnp.arange(3.0)).tolist() == want
    assert (kiln.stats().hits, kiln.stats().compiles) == (1, 0)
