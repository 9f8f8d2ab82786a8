"""Run a program (``SCRIPT ARGS`` or ``-m MODULE ARGS``) with a listener on JAX's own trace and
lowering events, and write what it heard as JSON to ``EVENTS`` at exit::

    python benchmarks/_jax_events.py EVENTS SCRIPT [ARGS ...]
    python benchmarks/_jax_events.py EVENTS -m kiln run --jit SCRIPT [ARGS ...]

The program itself is not changed: the listener is registered
(``jax.monitoring.register_event_duration_secs_listener``) before it runs, which imports jax
first. Two events, both fired only for a jit traced or lowered outside any other trace:
``/jax/core/compile/jaxpr_trace_duration`` (Python tracing a function to a jaxpr) and
``/jax/core/compile/jaxpr_to_mlir_module_duration`` (lowering that jaxpr to a StableHLO module).
XLA's compile is left out (it is what every persistent cache skips).

Each event is counted in one of two kinds, by the function the jit traces (``fun`` of jax's
``pjit._trace_for_jit`` frame, found on the stack when the trace event fires):

- ``eager``: the function is JAX's own (its ``__module__`` is under ``jax`` or ``jaxlib``): a
  primitive applied outside any jit (``jnp.zeros(3) + 1``: jax jits ``prim_fun`` of
  ``jax._src.dispatch``), or a function JAX jits itself called outside any jit
  (``jnp.where``, ``jax.random.normal``);
- ``jit``: anything else, the program's jits and its libraries' (a ``functools.partial`` counts
  as JAX's own only when its function and every callable it binds are: blackjax's
  ``jax.jit(partial(lax.scan, one_step))`` is the library's), and kiln's traces of them.

A lowering is counted the same way when it comes from a call of a jit (the function of jax's
``pjit.cache_miss`` frame); one from ``Traced.lower`` (kiln's, or a program's ``.lower()``)
with the trace it follows: the last trace of the function of that name (its event names the
module ``jit(<name>)``). The output: ``{"jit": {"trace_s", "lower_s",
"traces", "lowerings"}, "eager": {...}}``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
from typing import Any

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_JAX = ("jax", "jaxlib")


def _jax_own(fun: Any) -> bool:
    """Whether the function a jit traces is JAX's own code (see the module docstring)."""
    if isinstance(fun, functools.partial):
        bound = [*fun.args, *fun.keywords.values()]
        return _jax_own(fun.func) and all(_jax_own(b) for b in bound if callable(b))
    module = getattr(fun, "__module__", None) or type(fun).__module__ or ""
    return str(module).partition(".")[0] in _JAX


def _function_on_stack(code_name: str) -> Any:
    """``fun`` of the innermost frame of jax's ``pjit.<code_name>`` on the stack, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == code_name and code.co_filename.endswith("pjit.py"):
            return frame.f_locals.get("fun")
        frame = frame.f_back
    return None


def _kind(code_name: str) -> str | None:
    try:
        fun = _function_on_stack(code_name)
    except Exception:  # noqa: BLE001 - never break the program
        return None
    return None if fun is None else "eager" if _jax_own(fun) else "jit"


def install(path: str) -> dict[str, dict[str, float]]:
    """Register the listener; write its counts to ``path`` at exit. Returns the counts."""
    import jax

    counts = {kind: {"trace_s": 0.0, "lower_s": 0.0, "traces": 0, "lowerings": 0}
              for kind in ("jit", "eager")}
    last_kind: dict[str, str] = {}  # function name -> kind of its last trace

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == _TRACE:
            kind = _kind("_trace_for_jit") or "jit"
            last_kind[str(kwargs.get("fun_name"))] = kind
            counts[kind]["trace_s"] += duration
            counts[kind]["traces"] += 1
        elif event == _LOWER:
            name = str(kwargs.get("fun_name", ""))
            name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
            kind = _kind("cache_miss") or last_kind.get(name, "jit")
            counts[kind]["lower_s"] += duration
            counts[kind]["lowerings"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)

    def write() -> None:
        with open(path, "w") as f:
            json.dump(counts, f)

    atexit.register(write)
    return counts


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    install(path)
    if argv[:1] == ["-m"]:
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        sys.path[0] = os.getcwd()  # as python -m
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python SCRIPT
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
