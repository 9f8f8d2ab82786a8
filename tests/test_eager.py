"""JAX's eager work under the jax.jit swap (kiln._travel._eager): its own jitted functions and
primitives applied outside a trace load from the store with no trace and no lowering, and give
what a plain run gives whatever changed between runs.

Each case runs real processes: the program under ``kiln run`` (the swap on by default) on one
store, and the same program under plain ``python`` (no kiln) for the values to compare with.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from kiln_test_children import child_env, run_child

pytestmark = pytest.mark.slow

# An eager program: jnp functions, jax.random, primitives applied, linalg, an update.
PROGRAM = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    {prelude}
    x = jnp.linspace(0.0, 1.0, 4)
    key = jax.random.key(0)
    out = {{
        "sum": jnp.sum(x * 2.0, axis=0),
        "normal": jax.random.normal(key, (3,)),
        "uniform": jax.random.uniform(jax.random.key(1), (2, 2)),
        "sin": jnp.sin(x) + jnp.arange(4),
        "lax": jax.lax.cos(x),
        "relu": jax.nn.relu(x - 0.5),
        "at": x.at[0].set(5.0),
        "svd": jnp.linalg.svd(jnp.eye(3) * 2.0)[1],
        "dot": jnp.ones((3, 3)) @ jnp.arange(9.0).reshape(3, 3),
    }}
    values = {{k: [str(np.asarray(v).dtype), np.asarray(v).tolist()] for k, v in out.items()}}
    devices = {{k: sorted(str(d) for d in v.devices()) for k, v in out.items()}}
    {epilogue}
    try:
        import kiln
        s = kiln.stats()
        stats = {{k: getattr(s, k) for k in ("eager_hits", "eager_misses", "eager_writes",
                                             "eager_left", "jax_lowerings", "eager_seconds",
                                             "load_seconds")}}
    except ImportError:
        stats = {{}}
    print("RESULT " + json.dumps({{"values": values, "devices": devices, "stats": stats}}))
""")


def _write(tmp_path: Path, prelude: str = "", epilogue: str = "", name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(PROGRAM.format(prelude=prelude, epilogue=epilogue))
    return path


def _result(proc: object) -> dict:
    out = proc.stdout  # type: ignore[attr-defined]
    assert proc.returncode == 0, proc.stderr[-4000:]  # type: ignore[attr-defined]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def _kiln_run(prog: Path, store: Path, *args: str, **env: str) -> dict:
    return _result(run_child([sys.executable, "-m", "kiln", "run", *args, prog],
                             env=child_env(KILN_CACHE_DIR=str(store), **env), cwd=prog.parent))


def _plain(prog: Path, **env: str) -> dict:
    return _result(run_child([sys.executable, prog], env=child_env(**env), cwd=prog.parent))


def test_eager_work_loads_warm_with_no_trace_or_lowering(tmp_path: Path) -> None:
    prog = _write(tmp_path)
    store = tmp_path / "store"
    plain = _plain(prog)
    cold = _kiln_run(prog, store)
    warm = _kiln_run(prog, store)
    assert cold["values"] == plain["values"] == warm["values"]
    assert cold["devices"] == plain["devices"] == warm["devices"]
    written = cold["stats"]["eager_writes"]
    assert written >= 10 and cold["stats"]["eager_hits"] == 0
    # the warm run loads every eager program it stored: nothing traced, lowered or compiled
    assert warm["stats"]["eager_hits"] == written
    assert warm["stats"]["eager_misses"] == 0
    assert warm["stats"]["jax_lowerings"] == 0
    # kiln's own seconds on them are counted (keying, reading, loading), apart from kiln.jit's
    assert warm["stats"]["eager_seconds"] > 0 and warm["stats"]["load_seconds"] == 0


def test_eager_is_off_without_the_swap_and_with_kiln_eager_0(tmp_path: Path) -> None:
    prog = _write(tmp_path)
    for args, env in ((("--no-jit",), {}), ((), {"KILN_EAGER": "0"})):
        store = tmp_path / f"store{len(args)}"
        for _ in range(2):
            run = _kiln_run(prog, store, *args, **env)
            assert run["stats"]["eager_writes"] == run["stats"]["eager_hits"] == 0
            assert run["stats"]["jax_lowerings"] > 0


def test_kiln_replace_jit_alone_stores_eager_work(tmp_path: Path) -> None:
    # KILN_REPLACE_JIT=1 in a plain python process: `import kiln` turns the swap (and eager) on
    prog = _write(tmp_path, prelude="import kiln")
    store = tmp_path / "store"
    env = child_env(KILN_CACHE_DIR=str(store), KILN_REPLACE_JIT="1")
    cold = _result(run_child([sys.executable, prog], env=env, cwd=tmp_path))
    warm = _result(run_child([sys.executable, prog], env=env, cwd=tmp_path))
    assert cold["stats"]["eager_writes"] >= 10
    assert warm["stats"]["eager_hits"] == cold["stats"]["eager_writes"]
    assert warm["stats"]["jax_lowerings"] == 0
    assert warm["values"] == cold["values"]


@pytest.mark.parametrize("setting", [
    {"JAX_ENABLE_X64": "1"},
    {"JAX_DEFAULT_PRNG_IMPL": "rbg"},
    {"JAX_THREEFRY_PARTITIONABLE": "0"},
    {"JAX_DEFAULT_MATMUL_PRECISION": "highest"},
])
def test_a_jax_config_change_between_runs_is_never_stale(tmp_path: Path,
                                                         setting: dict[str, str]) -> None:
    prog = _write(tmp_path)
    store = tmp_path / "store"
    _kiln_run(prog, store)
    changed = _kiln_run(prog, store, **setting)
    assert changed["values"] == _plain(prog, **setting)["values"]
    # the setting is in the key: the changed run stored programs of its own
    assert changed["stats"]["eager_misses"] > 0


def test_a_lowering_rule_the_program_registers_and_edits_is_never_stale(tmp_path: Path) -> None:
    # the program overrides the lowering of one of JAX's own primitives (sin) with a rule
    # of its own, then edits the rule between runs
    rule = textwrap.dedent("""
        from jax.interpreters import mlir
        def _my_sin(x, **params):
            return jnp.cos(x) * {factor}
        mlir.register_lowering(jax.lax.sin_p, mlir.lower_fun(_my_sin, multiple_results=False))
    """)
    store = tmp_path / "store"
    runs = []
    for factor in ("2.0", "3.0"):
        prog = _write(tmp_path, prelude=rule.format(factor=factor))
        runs.append((_kiln_run(prog, store), _plain(prog)))
    for run, plain in runs:
        assert run["values"] == plain["values"]
    assert runs[0][0]["values"]["sin"] != runs[1][0]["values"]["sin"]


def test_a_primitive_of_the_program_goes_to_jax_s_path(tmp_path: Path) -> None:
    prelude = textwrap.dedent("""
        from jax.extend.core import Primitive
        from jax.interpreters import mlir
        double_p = Primitive("double")
        double_p.def_abstract_eval(lambda x: x)
        mlir.register_lowering(double_p, mlir.lower_fun(lambda x: x * 2,
                                                        multiple_results=False))
        import functools
        from jax._src import dispatch
        double_p.def_impl(functools.partial(dispatch.apply_primitive, double_p))
        print("DOUBLE", double_p.bind(jnp.arange(3.0)).tolist())
    """)
    prog = _write(tmp_path, prelude=prelude)
    store = tmp_path / "store"
    for _ in range(2):
        proc = run_child([sys.executable, "-m", "kiln", "run", prog], cwd=tmp_path,
                         env=child_env(KILN_CACHE_DIR=str(store), KILN_EXPLAIN="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "DOUBLE [0.0, 2.0, 4.0]" in proc.stdout
        assert "eager primitive double: left to JAX" in proc.stderr
        assert "lowered by a rule from outside JAX" in proc.stderr


def test_a_monkeypatched_jax_function_is_never_stale(tmp_path: Path) -> None:
    # run 2 patches a function JAX's own jnp.sinc calls while it traces (lax.sin): the
    # stored sinc of run 1 must not be loaded
    epilogue = "values['sinc'] = np.asarray(jnp.sinc(x)).tolist()"
    patch = textwrap.dedent("""
        import jax._src.lax.lax as _lax
        _lax.sin = lambda v: jax.lax.cos(v)
    """)
    store = tmp_path / "store"
    _kiln_run(_write(tmp_path, epilogue=epilogue), store)
    prog = _write(tmp_path, prelude=patch, epilogue=epilogue)
    patched = _kiln_run(prog, store)
    assert patched["values"] == _plain(prog)["values"]
    assert patched["stats"]["eager_left"] > 0


def test_an_eager_op_on_another_device_is_never_stale(tmp_path: Path) -> None:
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    on = "x = jax.device_put(x, jax.devices()[{i}])"
    store = tmp_path / "store"
    moved = []
    for i in (0, 1):
        epilogue = "\n".join([
            on.format(i=i), "values['moved'] = np.asarray(jnp.sin(x) * 3).tolist()",
            "devices['moved'] = sorted(str(d) for d in (jnp.sin(x) * 3).devices())"])
        prog = _write(tmp_path, epilogue=epilogue)
        run = _kiln_run(prog, store, **flags)
        plain = _plain(prog, **flags)
        assert run["values"] == plain["values"]
        assert run["devices"] == plain["devices"]
        moved.append(run["devices"]["moved"])
    assert moved[0] != moved[1]  # (the second run's op ran on the other device)


def test_a_reinstalled_jax_with_other_files_is_never_stale(tmp_path: Path) -> None:
    # the same version with other files: the digest of JAX's RECORD differs (simulated in the
    # second run by the digest kiln reads; a real reinstall changes the file it digests)
    prelude = textwrap.dedent("""
        if os.environ.get("OTHER_FILES"):
            import kiln._keys._libraries as _libraries
            _libraries._top_level_version.cache_clear()
            _real = _libraries._record_digest
            _libraries._record_digest = lambda dist: _real(dist) + "-other"
    """)
    prog = _write(tmp_path, prelude=prelude)
    store = tmp_path / "store"
    cold = _kiln_run(prog, store)
    again = _kiln_run(prog, store, OTHER_FILES="1")
    assert again["stats"]["eager_hits"] == 0
    assert again["stats"]["eager_writes"] == cold["stats"]["eager_writes"]
    assert again["values"] == cold["values"]


def test_a_broken_eager_entry_is_replaced_and_the_result_is_right(tmp_path: Path) -> None:
    prog = _write(tmp_path)
    store = tmp_path / "store"
    cold = _kiln_run(prog, store)
    entries = sorted((store / "entries").glob("*/*.kiln"))
    assert entries
    for path in entries:  # flip a byte in every entry's body
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    proc = run_child([sys.executable, "-m", "kiln", "run", prog], cwd=tmp_path,
                     env=child_env(KILN_CACHE_DIR=str(store)))
    again = _result(proc)
    assert again["values"] == cold["values"]
    assert "is unusable" in proc.stderr
    healed = _kiln_run(prog, store)
    assert healed["stats"]["eager_hits"] == cold["stats"]["eager_writes"]
    assert healed["values"] == cold["values"]


def test_pytest_kiln_loads_a_suite_s_eager_work_on_its_second_run(tmp_path: Path) -> None:
    suite = tmp_path / "test_eager_suite.py"
    suite.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp

        def test_numbers():
            x = jnp.linspace(0.0, 1.0, 5)
            assert float(jnp.sum(jnp.sin(x) ** 2 + jnp.cos(x) ** 2)) == 5.0

        def test_random():
            assert jax.random.normal(jax.random.key(3), (4,)).shape == (4,)
    """))
    store = tmp_path / "store"
    lines = []
    for _ in range(2):
        proc = run_child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--kiln", suite.name], cwd=tmp_path,
                         env=child_env(KILN_CACHE_DIR=str(store)))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines.append(next(ln for ln in proc.stdout.splitlines() if "eager work loaded" in ln))
    assert "eager work loaded 0," in lines[0]
    assert ", compiled 0," in lines[1] and "eager work loaded 0," not in lines[1]


def test_the_eager_prep_example_gives_the_plain_result_warm_with_no_lowering(
        tmp_path: Path) -> None:
    # examples/eager_prep.py: scikit-learn's digits prepared and classified in jax.numpy
    # outside any jit (~265 eager programs)
    prog = Path(__file__).resolve().parent.parent / "examples" / "eager_prep.py"
    store = tmp_path / "store"

    def result(proc: object) -> tuple[dict, str]:
        assert proc.returncode == 0, proc.stderr[-3000:]  # type: ignore[attr-defined]
        line = proc.stdout.strip().splitlines()[-1]  # type: ignore[attr-defined]
        got = json.loads(line)
        got.pop("time_to_first_result_s")
        summary = next(ln for ln in proc.stderr.splitlines()  # type: ignore[attr-defined]
                       if ln.startswith("kiln:")) if "kiln" in proc.args[1:3] else ""  # type: ignore[attr-defined]
        return got, summary

    plain, _ = result(run_child([sys.executable, prog], cwd=tmp_path))
    runs = [result(run_child([sys.executable, "-m", "kiln", "run", prog], cwd=tmp_path,
                             env=child_env(KILN_CACHE_DIR=str(store)))) for _ in range(2)]
    assert runs[0][0] == plain == runs[1][0]
    assert "eager loaded: 0," in runs[0][1]
    assert ", compiled: 0," in runs[1][1] and "eager loaded: 0," not in runs[1][1]
