"""The benchmarks' harness (``benchmarks/_harness.py``): the order of its rounds, its figures,
its command line and its JSON. What it times is never asserted (timings live in
``benchmarks/``); its counts, orders and records are."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load() -> ModuleType:
    """The harness, by path, as ``tests/children.py`` loads it (benchmarks are no package)."""
    spec = importlib.util.spec_from_file_location("kiln_bench_harness_under_test",
                                                  BENCHMARKS / "_harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_order_rotates_each_round_and_two_variants_alternate():
    assert [bench.rotation("abc", i) for i in range(4)] == [
        list("abc"), list("bca"), list("cab"), list("abc")]
    assert [bench.rotation(("kiln", "jax"), i) for i in range(3)] == [
        ["kiln", "jax"], ["jax", "kiln"], ["kiln", "jax"]]


def test_interleave_runs_every_variant_once_a_round_and_keeps_results_in_round_order():
    calls = []

    def run(variant, rnd):
        calls.append((rnd, variant))
        return f"{variant}{rnd}"

    out = bench.interleave(("a", "b", "c"), 3, run)
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b")]
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}


def test_interleave_keeps_the_order_given_when_a_variant_needs_the_one_before(capsys):
    calls = []
    out = bench.interleave(["cold", "warm"], 2, lambda v, i: calls.append(v) or len(calls),
                           rotate=False, show=lambda r: f"run {r}")
    assert calls == ["cold", "warm", "cold", "warm"]
    assert out == {"cold": [1, 3], "warm": [2, 4]}
    assert capsys.readouterr().out.splitlines() == [
        "  [1/2] cold: run 1", "  [1/2] warm: run 2", "  [2/2] cold: run 3",
        "  [2/2] warm: run 4"]


def test_medians_spread_and_ratios_against_an_anchor():
    assert bench.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    s = bench.spread([5.0, 1.0, 3.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 3)
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"]
    assert bench.spread([2.0])["p90"] == 2.0
    samples = {"jax": [{"t": 4.0}, {"t": 2.0}, {"t": 3.0}],
               "kiln": [{"t": 1.0}, {"t": 1.5}, {"t": 0.5}],
               "other": [{"t": 1.0}, {"t": None}]}
    med = bench.medians(samples, "t")
    assert med == {"jax": 3.0, "kiln": 1.0, "other": None}
    assert bench.ratios(med, "jax") == {"jax": 1.0, "kiln": 1 / 3, "other": None}
    assert bench.ratios({"a": 1.0, "zero": 0.0}, "zero") == {"a": None, "zero": None}


def test_pair_ratios_take_the_runs_of_one_round_together():
    assert bench.pair_ratios([2.0, 3.0], [1.0, 6.0]) == [2.0, 0.5]
    with pytest.raises(ValueError):
        bench.pair_ratios([1.0], [1.0, 2.0])


def test_last_json_is_the_last_line_of_json_after_its_marker():
    text = 'noise\n{"a": 1}\nmore noise {"b": 2}\nRESULT {"c": 3}\n{broken\n'
    assert bench.last_json(text) == {"a": 1}
    assert bench.last_json(text, "RESULT ") == {"c": 3}
    assert bench.last_json("nothing here") is None


def test_the_options_every_script_takes(tmp_path, capsys):
    parser = bench.options("Benchmark: a thing.\n\nMore.", reps=5, quick_reps=2,
                           aliases=("--pairs",))
    assert parser.description == "Benchmark: a thing."
    args = bench.begin(parser, [])
    assert (args.reps, args.quick, args.json) == (5, False, None)
    assert bench.begin(parser, ["--quick"]).reps == 2
    assert bench.begin(parser, ["--quick", "--reps", "4"]).reps == 4
    assert bench.begin(parser, ["--pairs", "3", "--json", str(tmp_path / "o.json")]).reps == 3
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("$ ") and "CPUs" in out[1]
    assert any("[QUICK" in line for line in out)
    with pytest.raises(SystemExit):
        bench.begin(parser, ["--reps", "0"])
    plain = bench.begin(bench.options(None, reps=None), [])
    assert not hasattr(plain, "reps") and plain.quick is False


def test_save_writes_the_figures_with_the_command_and_versions(tmp_path, capsys):
    path = tmp_path / "out.json"
    args = bench.begin(bench.options("x", reps=7), ["--json", str(path)],
                       dists=("surely-not-installed-dist",))
    bench.save(args, {"figure": 1.5, "where": tmp_path})
    got = json.loads(path.read_text())
    assert got["figure"] == 1.5 and got["where"] == str(tmp_path)
    assert got["reps"] == 7 and got["quick"] is False and got["command"] == args.command
    assert got["versions"]["surely-not-installed-dist"] == "not installed"
    assert {"benchmark", "cpus"} <= set(got)
    assert f"wrote {path}" in capsys.readouterr().out
    bench.save(bench.begin(bench.options("x"), []), {"figure": 2})  # no --json: nothing written


def test_table_aligns_its_columns():
    text = bench.table(["mode", "s"], [["kiln", 1.23456], ["jax.jit", None], ["x", "7 s"]])
    assert text.splitlines() == ["mode         s", "kiln     1.235", "jax.jit      -",
                                 "x          7 s"]


def test_a_fresh_child_gives_back_its_payload_and_times(monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", "/the/user/s/own")
    code = ("import json, os; print('hello'); "
            "print(json.dumps({'seen': os.environ.get('KILN_CACHE_DIR'), 'n': 3}))")
    run = bench.fresh(["-c", code], env=bench.child_env(**bench.kiln_store("/tmp/x")))
    assert run.payload == {"seen": "/tmp/x", "n": 3}
    assert run.record()["n"] == 3 and run.record()["wall_s"] == run.wall_s
    assert run.returncode == 0 and run.wall_s > 0 and run.cpu_s >= 0
    assert bench.fresh(["-c", "print(1)"]).payload is None
    with pytest.raises(SystemExit, match="exited 3"):
        bench.fresh(["-c", "import sys; sys.exit(3)"])
    assert bench.fresh(["-c", "import sys; sys.exit(3)"], check=False).returncode == 3


def test_a_child_inherits_no_kiln_jax_or_xla_setting(monkeypatch):
    for name in ("KILN_STORE", "JAX_PLATFORMS", "XLA_FLAGS"):
        monkeypatch.setenv(name, "parent")
    env = bench.child_env(JAX_PLATFORMS="cpu", **bench.jax_cache("/c"))
    assert env["JAX_PLATFORMS"] == "cpu" and "KILN_STORE" not in env and "XLA_FLAGS" not in env
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/c"
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


def test_the_harness_imports_nothing_outside_the_standard_library():
    """``tests/children.py`` loads it in every test process."""
    tree = (BENCHMARKS / "_harness.py").read_text()
    import ast

    names = {a.name.partition(".")[0] for n in ast.walk(ast.parse(tree))
             if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.partition(".")[0] for n in ast.walk(ast.parse(tree))
              if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}
