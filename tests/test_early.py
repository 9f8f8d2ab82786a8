"""kiln's early start (``src/kiln_early``): a program that imports kiln after a library that
compiles while it is imported gets its route on before that library's first compile, from its
second run on, as if it imported kiln first. Real processes; JAX finds ``kiln_early`` through
the ``jax_plugins`` entry point of the installed kiln."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, run_child

pytestmark = pytest.mark.slow

# a library that compiles at import: an eager matmul, an eager sin, a jax.jit call
EAGERLIB = '''\
import jax
import jax.numpy as jnp

TABLE = jnp.arange(16.0).reshape(4, 4) @ jnp.ones((4, 4))
SQUARED = jax.jit(lambda x: jnp.sin(x) ** 2 + 1)(TABLE)
'''

MAIN = '''\
import json
import sys

import eagerlib  # compiles before kiln is imported
import jax.numpy as jnp

import kiln

if "--kiln" in sys.argv:
    @kiln.jit
    def f(x):
        return jnp.tanh(x) * 3
else:
    def f(x):
        return jnp.tanh(x) * 3

out = f(eagerlib.SQUARED)
s = kiln.stats()
print("KILN-PROBE " + json.dumps({"value": float(out.sum()), "hits": s.hits,
      "route_hits": s.jax_cache_hits, "route_misses": s.jax_cache_misses}))
'''


@pytest.fixture
def program(tmp_path: Path) -> Any:
    prog = tmp_path / "prog"
    prog.mkdir()
    (prog / "eagerlib.py").write_text(EAGERLIB)
    (prog / "main.py").write_text(MAIN)
    cache = tmp_path / "cache"

    def run(*args: str, main: tuple[str, ...] = ("main.py",), **env: str) -> dict[str, Any]:
        proc = run_child([sys.executable, *main, *args], cwd=prog, timeout=180,
                         env=child_env(KILN_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu",
                                       PYTHONDONTWRITEBYTECODE="1", **env))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KILN-PROBE ")]
        assert proc.returncode == 0 and lines, proc.stderr[-6000:]
        return dict(json.loads(lines[-1][len("KILN-PROBE "):]))

    run.markers = lambda: sorted(p.name for p in (cache / "early").glob("*"))  # type: ignore
    return run


def test_library_compiling_at_import_is_routed_from_the_second_run(program: Any) -> None:
    first = program("--kiln")
    assert first["route_hits"] == 0 and first["route_misses"] == 0  # (kiln not imported yet)
    assert len(program.markers()) == 1  # the program made a kiln function
    second = program("--kiln")  # kiln imported as JAX's backend starts: eagerlib's compiles
    assert second["route_misses"] >= 3 and second["route_hits"] == 0  # are routed, stored
    assert second["hits"] == 1
    third = program("--kiln")
    assert third["route_hits"] == second["route_misses"] and third["route_misses"] == 0
    assert third["hits"] == 1
    assert first["value"] == second["value"] == third["value"]
    off = program("--kiln", KILN_EARLY="0")  # the late import: eagerlib compiles unrouted
    assert off["route_hits"] == 0 and off["route_misses"] == 0 and off["hits"] == 1
    assert off["value"] == first["value"]
    assert program("--kiln", KILN_JAX_CACHE="0")["route_hits"] == 0  # JAX left alone


def test_a_program_that_stops_using_kiln_is_forgotten(program: Any) -> None:
    program("--kiln")
    assert len(program.markers()) == 1
    without = program()  # no kiln function: imported early this time, the marker goes
    assert without["route_misses"] >= 3 and without["hits"] == 0
    assert program.markers() == []
    after = program()  # imported late again: only what runs after import kiln is routed
    assert after["route_misses"] == 0
    assert 0 < after["route_hits"] <= without["route_misses"] - 3


def test_kiln_run_and_jax_cache_users_leave_no_marker(program: Any) -> None:
    run = program("--kiln", main=("-m", "kiln", "run", "main.py"))
    assert run["hits"] == 0 and program.markers() == []  # kiln run imports kiln first anyway
    own = program("--kiln", KILN_JAX_CACHE="0")
    assert own["hits"] == 1 and program.markers() == []


def test_import_kiln_starts_no_backend_and_kiln_early_imports_only_the_stdlib() -> None:
    # kiln_early imports kiln inside JAX's plugin discovery, under JAX's plugin lock: a backend
    # started by import kiln would wait on that lock forever
    code = ("import sys, kiln_early; assert 'jax' not in sys.modules and 'kiln' not in "
            "sys.modules; import jax, jax._src.xla_bridge as xb, kiln; assert not xb._backends;"
            " print('ok')")
    proc = run_child([sys.executable, "-c", code], timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-4000:]


def test_kiln_early_is_kiln_s_code_not_the_program_s() -> None:
    # its marker check can run inside a trace (a kiln.noinline function made while tracing):
    # a stat of kiln's own, never an input of the program (Python 3.12 keyed it and missed)
    import kiln_early
    import kiln_jax_plugin
    from kiln._keys._libraries import is_user_file

    assert not is_user_file(kiln_early.__file__)
    assert not is_user_file(kiln_jax_plugin.__file__)


def test_jax_finds_kiln_s_plugin_through_its_entry_point() -> None:
    """The installed ``jax_plugins`` entry point ``kiln`` names the module whose initialize
    JAX calls (``kiln_jax_plugin``, apart from ``kiln_early`` so that no package of kiln's
    imports one that imports it back)."""
    from importlib.metadata import entry_points

    import kiln_jax_plugin

    found = [e for e in entry_points(group="jax_plugins") if e.name == "kiln"]
    assert [e.value for e in found] == ["kiln_jax_plugin"]
    assert callable(kiln_jax_plugin.initialize)
