"""The server's imports: kiln's command line, then the modules the program's last runs imported,
in their order, stopping before the first one that makes a fork unsafe or whose import a plain
run would show (output on stdout or stderr): that one and the rest are imported by each run."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import threading
from typing import Any

__all__ = ["preload"]


def _sidecar(spec: dict[str, Any]) -> str:
    """What earlier servers of this key found unsafe to preload (name -> why)."""
    return os.path.join(os.path.dirname(spec["record"]), spec["key"][:20] + ".unsafe.json")


def _read_unsafe(spec: dict[str, Any]) -> dict[str, str]:
    try:
        with open(_sidecar(spec), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _why_unsafe(written: bool) -> str | None:
    if written:
        return "wrote to stdout or stderr while imported (a plain run shows it)"
    if threading.active_count() > 1:
        return "started a thread while imported"
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "started a JAX backend while imported (a device, XLA's threads)"
    return None


def preload(spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Import what ``spec`` lists; (the names imported, {name: why} of those left to each run).
    A module found unsafe here is remembered for the key and the server starts again by
    ``execv`` without it (what it did to this process cannot be undone)."""
    import kiln_cli

    kiln_cli.importing = True
    try:
        importlib.import_module("kiln._cli")
    finally:
        kiln_cli.importing = False
    # what kiln run turns on before the script (the route, the jax.jit swap): before the
    # program's libraries are imported, as in a plain run
    from kiln._cli._main import prepare

    prepare(list(spec["argv"]))
    unsafe = _read_unsafe(spec)
    done: list[str] = []
    capture = tempfile.TemporaryFile()
    saved = (os.dup(1), os.dup(2))
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(capture.fileno(), 1)
    os.dup2(capture.fileno(), 2)
    try:
        for name in spec["modules"]:
            if name in unsafe:
                break  # this one and the rest: each run imports them
            if name in sys.modules:
                done.append(name)
                continue
            size = os.fstat(capture.fileno()).st_size
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - a module that fails here: the run's
                sys.stderr.flush()
                capture.truncate(size)
                capture.seek(size)
                os.write(saved[1], f"could not preload {name}: {type(e).__name__}: {e}\n"
                         .encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            why = _why_unsafe(os.fstat(capture.fileno()).st_size > size)
            if why is not None:
                unsafe[name] = why
                _restart(spec, unsafe, saved)
            done.append(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        capture.close()
    return done, unsafe


def _restart(spec: dict[str, Any], unsafe: dict[str, str], saved: tuple[int, int]) -> None:
    """Remember ``unsafe`` for the key and start the server again (execv: a fresh process)."""
    from kiln_server._common import interpreter_flags, write_json

    write_json(_sidecar(spec), unsafe)
    spec_path = os.path.join(spec["dir"], f"{spec['key'][:20]}.{os.getpid()}.spec")
    write_json(spec_path, spec)
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    if len(unsafe) > 20:  # a loop of surprises: give up serving this key
        os._exit(0)
    os.execv(sys.executable, [sys.executable, *interpreter_flags(), "-c",
                              "import kiln_warm._serve as s; s.main()", spec_path])
