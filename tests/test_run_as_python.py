"""``kiln run prog.py`` is ``python prog.py`` in all a program can see: the same programs run with
``python`` and with ``kiln run`` give the same stdout, stderr (less kiln's own ``kiln:`` lines),
exit status and death signal. jax is imported when the program imports it, so settings a
program puts in the environment before ``import jax`` hold (``JAX_ENABLE_X64``,
``JAX_DEBUG_NANS``, ``JAX_NUMPY_RANK_PROMOTION``, ``XLA_FLAGS``); ``__main__`` is made as Python
makes it (``__file__``, ``sys.path[0]`` of a symlinked script, the code's file name); an uncaught
error goes to the program's ``sys.excepthook``; a ``SyntaxError`` shows no frames; an uncaught
``KeyboardInterrupt`` ends the process by SIGINT after ``atexit``. Hit and staleness: the
program that sets ``JAX_ENABLE_X64`` runs warm with no trace, and set otherwise it computes
what ``python`` computes. The served runs (``--server``) are in ``tests/test_server.py``."""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, run_child

pytestmark = pytest.mark.slow

PROGRAMS = {
    # settings JAX reads when imported, set by the program before it imports jax
    "env_before_jax.py": """
        import os, sys
        print("jax imported first:", "jax" in sys.modules, "numpy" in sys.modules)
        os.environ["JAX_ENABLE_X64"] = "1"
        os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
        os.environ["JAX_DEBUG_NANS"] = "1"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
        import jax
        import jax.numpy as jnp

        print(jnp.ones(2).dtype, jax.config.jax_numpy_rank_promotion,
              jax.config.jax_debug_nans, jax.device_count())
        f = jax.jit(lambda x: x * 2.5)
        print(f(jnp.arange(3.0)).tolist(), f(jnp.arange(3.0)).dtype)
        try:
            jax.jit(lambda x: jnp.log(x))(-1.0)
            print("no FloatingPointError")
        except FloatingPointError:
            print("FloatingPointError")
        try:
            jnp.ones(2) + jnp.ones((3, 2))
        except ValueError as e:
            print("rank promotion:", type(e).__name__)
    """,
    # the main module, its file and its folder, as Python makes them
    "main_module.py": """
        import os, sys, __main__
        print(__file__, sys.path[0], sys.argv)
        print(sorted(vars(__main__)), __spec__, __package__, __cached__, __builtins__)
        print(type(__loader__).__name__, __loader__.name, sys._getframe().f_code.co_filename)
        here = os.path.dirname(__file__)
        os.chdir("/")
        with open(os.path.join(here, "data.txt")) as f:
            print(f.read())
        print("jax" in sys.modules)
    """,
    "hook.py": """
        import sys
        def hook(kind, value, tb):
            print("hook:", kind.__name__, value, tb.tb_frame.f_code.co_name, file=sys.stderr)
        sys.excepthook = hook
        def f():
            raise ValueError("boom")
        f()
    """,
    "error.py": """
        def f():
            return 1 / 0
        f()
    """,
    "syntax.py": """
        x = (
    """,
    "interrupt.py": """
        import atexit
        atexit.register(lambda: print("atexit ran", flush=True))
        def f():
            raise KeyboardInterrupt
        f()
    """,
    "exit_text.py": """
        import sys
        sys.exit("bye")
    """,
    "hash_seed.py": """
        print(list({"alpha", "beta", "gamma", "delta", "eps", "zeta"}), hash("kiln"))
    """,
}

KILN_LINE = re.compile(r"^kiln: .*\n", re.M)


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("as_python")
    app = root / "app"
    app.mkdir()
    for name, text in PROGRAMS.items():
        (app / name).write_text(textwrap.dedent(text).lstrip())
    (app / "data.txt").write_text("beside the script")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "data.txt").write_text("beside the link")
    os.symlink(app / "main_module.py", root / "elsewhere" / "link.py")
    return root


def _env(place: Path, **extra: str) -> dict[str, str]:
    return child_env(KILN_CACHE_DIR=str(place / "store"), **extra)


def _python(place: Path, script: str, **env: str) -> Any:
    return run_child([sys.executable, script], env=_env(place, **env), cwd=place / "app")


def _kiln(place: Path, script: str, **env: str) -> Any:
    return run_child([sys.executable, "-m", "kiln", "run", "--no-server", script],
                     env=_env(place, **env), cwd=place / "app")


def _seen(proc: Any) -> tuple[int, str, str]:
    return proc.returncode, proc.stdout, KILN_LINE.sub("", proc.stderr)


@pytest.mark.parametrize("script", ["env_before_jax.py", "main_module.py", "./main_module.py",
                                    "../elsewhere/link.py", "hook.py", "error.py",
                                    "syntax.py", "interrupt.py", "exit_text.py"])
def test_kiln_run_is_python(place: Path, script: str) -> None:
    plain = _python(place, script)
    run = _kiln(place, script)
    assert _seen(run) == _seen(plain), run.stderr
    if script == "env_before_jax.py":
        assert plain.stdout.splitlines()[:3] == [
            "jax imported first: False False", "float64 raise True 3", "[0.0, 2.5, 5.0] float64"]
        assert "FloatingPointError\nrank promotion: ValueError\n" in plain.stdout
    if script == "../elsewhere/link.py":  # (sys.path[0]: the target's folder)
        assert f"{place / 'app'}/../elsewhere/link.py {place / 'app'} " in plain.stdout
        assert "beside the link" in plain.stdout
    if script == "main_module.py":
        assert "beside the script" in plain.stdout
    if script == "hook.py":
        assert plain.stderr.startswith("hook: ValueError boom <module>")
    if script == "syntax.py":
        assert "Traceback" not in plain.stderr and "SyntaxError" in plain.stderr
    if script == "interrupt.py":
        assert plain.returncode == -signal.SIGINT
        assert plain.stdout == "atexit ran\n" and "KeyboardInterrupt" in plain.stderr


@pytest.mark.parametrize("seed", ["0", "5"])
def test_a_set_iterates_as_under_python_with_the_hash_seed_set(place: Path, seed: str) -> None:
    assert _seen(_kiln(place, "hash_seed.py", PYTHONHASHSEED=seed)) == \
        _seen(_python(place, "hash_seed.py", PYTHONHASHSEED=seed))


def test_settings_set_before_import_jax_run_warm_and_are_never_stale(place: Path,
                                                                     tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    prog = app / "x64.py"
    prog.write_text(textwrap.dedent("""
        import os
        os.environ["JAX_ENABLE_X64"] = "1"
        import jax, jax.numpy as jnp
        print(jax.jit(lambda x: x / 3)(jnp.arange(3.0)).dtype)
    """))
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"))

    def kiln() -> Any:
        return run_child([sys.executable, "-m", "kiln", "run", "--no-server", "x64.py"],
                         env=env, cwd=app)

    cold, warm = kiln(), kiln()
    assert cold.stdout == warm.stdout == "float64\n"
    assert "traces: 1" in cold.stderr and "traces: 0, compiles: 0" in warm.stderr, warm.stderr
    prog.write_text(prog.read_text().replace('"1"', '"0"'))
    plain = run_child([sys.executable, "x64.py"], env=env, cwd=app)
    changed, again = kiln(), kiln()
    assert changed.stdout == again.stdout == plain.stdout == "float32\n"
    assert "traces: 0, compiles: 0" in again.stderr, again.stderr
