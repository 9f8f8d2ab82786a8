"""The one harness for the processes the tests start: what a child inherits, and how it runs.

A child starts from this process's environment less every variable that changes what kiln,
jax, XLA, equinox or pytest do (``KILN_*``, ``JAX_*``, ``XLA_*``, ``EQX_*``, ``PYTEST_*``: equinox
reads ``EQX_ON_ERROR`` and ``EQX_GETKEY_SEED`` from it, and a child pytest took the
parent's ``PYTEST_XDIST_WORKER``, and pytest-benchmark, where installed, warned there that
xdist was active, an INTERNALERROR under ``filterwarnings = error``) and less ``PYTHONPATH``;
the folder of the kiln under test comes first on its ``PYTHONPATH`` (a run with
``PYTHONPATH=<worktree>/src`` tests that worktree's kiln in its children too); then what the
test sets. A variable a test means its child to see, ``XLA_FLAGS`` with a device count say,
the test passes itself.

``tests/conftest.py`` loads this file as the module ``kiln_test_children`` (test modules
cannot import each other under ``--import-mode=importlib``)::

    from kiln_test_children import child_env, run_child

    proc = run_child([sys.executable, "-c", PROG], env=child_env(KILN_CACHE_DIR=str(store)))

``tests/test_children.py`` fails on a test file that builds a child's environment or starts a
process on its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import kiln

SCRUB_PREFIXES = ("KILN_", "JAX_", "XLA_", "EQX_", "PYTEST_")

# The folder the kiln under test was imported from, when it is a source checkout.
KILN_SRC: str | None = str(Path(kiln.__file__).resolve().parents[1])
if KILN_SRC.endswith(("site-packages", "dist-packages")):
    KILN_SRC = None


def _benchmarks_harness() -> ModuleType:
    """``benchmarks/_harness.py``, whose ``environment`` (this process's environment less some
    prefixes, then the settings) the tests' rule is built on; loaded by path."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "_harness.py"
    spec = importlib.util.spec_from_file_location("kiln_benchmark_harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_environment = _benchmarks_harness().environment


def child_env(**settings: str | None) -> dict[str, str]:
    """A child's environment: this one's less ``SCRUB_PREFIXES`` and ``PYTHONPATH``, the kiln
    under test first on ``PYTHONPATH``, then ``settings``. A ``PYTHONPATH`` given is put after
    kiln's folder; a setting of ``None`` leaves the variable out (``PYTHONPATH=None``: no
    ``PYTHONPATH`` at all, for a child that must import an installed kiln)."""
    path = settings.pop("PYTHONPATH", "")
    if path is not None:
        path = os.pathsep.join(p for p in (KILN_SRC, path) if p) or None
    env: dict[str, str] = _environment(SCRUB_PREFIXES, {**settings, "PYTHONPATH": path})
    return env


def run_child(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float = 300,
              check: bool = False, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (``env``: a :func:`child_env`; by default ``child_env()``), its
    stdout and stderr kept as text; ``check``: raise ``CalledProcessError`` on a non-zero exit;
    ``input``: its stdin (a pipe), else it reads nothing (``/dev/null``)."""
    return subprocess.run([os.fspath(a) for a in argv], env=child_env() if env is None else env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, check=check,
                          input=input, stdin=subprocess.DEVNULL if input is None else None)


def start_child(argv: Sequence[str | os.PathLike[str]], *,
                env: dict[str, str] | None = None, cwd: str | Path | None = None,
                stdout: int | IO[Any] | None = subprocess.PIPE,
                stderr: int | IO[Any] | None = subprocess.PIPE,
                stdin: int | IO[Any] | None = None) -> subprocess.Popen[str]:
    """Start ``argv`` (``env``: a :func:`child_env`; by default ``child_env()``); its output
    piped, as text, unless ``stdout`` / ``stderr`` say otherwise; ``stdin`` as given (a pty's
    end, a pipe), else this process's."""
    return subprocess.Popen([os.fspath(a) for a in argv],
                            env=child_env() if env is None else env, cwd=cwd, stdout=stdout,
                            stderr=stderr, stdin=stdin, text=True)


def finish_child(proc: subprocess.Popen[str], what: str,
                 timeout: float = 600) -> tuple[str, str]:
    """Wait for a started child (killed if it is still running when the wait ends) and return
    its stdout and stderr; fail, with ``what`` and its stderr's tail, unless it exited 0."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{what} failed:\n{err[-6000:]}"
    return out, err
