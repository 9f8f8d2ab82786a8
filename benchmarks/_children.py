"""The one harness for the processes a benchmark starts: what a child inherits, and how it runs.

A child starts from this process's environment less every ``KILN_*``, ``JAX_*`` and ``XLA_*``
variable: kiln's settings and store, JAX's platform, cache and flags, and XLA's flags change
what is measured, and a cache named there is the user's own. What a benchmark means its
children to have (a store or cache in a ``tempfile.TemporaryDirectory``, ``JAX_PLATFORMS=cpu``,
``XLA_FLAGS`` with a device count) it sets itself, through :func:`child_env`. ``PYTHONPATH`` is
kept (``PYTHONPATH=src`` runs a checkout's kiln in the children too).

``tests/test_children.py`` fails on a benchmark that builds a child's environment or starts a
process on its own.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

SCRUB_PREFIXES = ("KILN_", "JAX_", "XLA_")


def environment(scrub: tuple[str, ...], settings: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment less the variables whose names start with one of ``scrub``,
    then ``settings`` (a setting of ``None`` leaves that variable out). The tests' harness
    (``tests/children.py``) builds its rule on this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(scrub)}
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def child_env(**settings: str | None) -> dict[str, str]:
    """A child's environment: this one's less ``SCRUB_PREFIXES``, then ``settings`` (a setting
    of ``None`` leaves that variable out)."""
    return environment(SCRUB_PREFIXES, settings)


def _shown(argv: Sequence[str]) -> str:
    """``argv`` for an error message, a ``-c`` program of several lines by its first."""
    return shlex.join(a if "\n" not in a else a.lstrip().partition("\n")[0] + " ..."
                      for a in argv)


def run_child(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float = 900, check: bool = True,
              stdin: int | IO[Any] | None = None,
              stdout: int | IO[Any] | None = subprocess.PIPE,
              stderr: int | IO[Any] | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (``env``: a :func:`child_env`; by default ``child_env()``), its
    output kept as text unless ``stdout`` / ``stderr`` say otherwise. ``check``: a non-zero
    exit is ``SystemExit("error: <argv> exited <status>")`` with the tail of its stderr."""
    args = [os.fspath(a) for a in argv]
    proc = subprocess.run(args, env=child_env() if env is None else env, cwd=cwd, stdin=stdin,
                          stdout=stdout, stderr=stderr, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"error: {_shown(args)} exited {proc.returncode}\n"
                         f"{(proc.stderr or '')[-4000:]}")
    return proc


def start_child(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
                cwd: str | Path | None = None, stdin: int | IO[Any] | None = None,
                stdout: int | IO[Any] | None = subprocess.PIPE,
                stderr: int | IO[Any] | None = subprocess.PIPE) -> subprocess.Popen[str]:
    """Start ``argv`` (``env``: a :func:`child_env`; by default ``child_env()``); its output
    piped, as text, unless ``stdout`` / ``stderr`` say otherwise."""
    return subprocess.Popen([os.fspath(a) for a in argv],
                            env=child_env() if env is None else env, cwd=cwd, stdin=stdin,
                            stdout=stdout, stderr=stderr, text=True)
