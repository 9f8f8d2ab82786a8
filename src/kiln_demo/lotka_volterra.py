"""Fit the Lotka-Volterra predator-prey model to the Hudson's Bay hare/lynx data.

    dx/dt =  a x - b x y      (x: hares, thousands)
    dy/dt = -c y + d x y      (y: lynx,  thousands)

The whole fit -- an ``optimistix.BFGS`` minimisation whose loss solves the ODE
with ``diffrax`` (Tsit5, adaptive steps) -- is a single jitted function.  It runs
in float32 (JAX's default; nothing here touches global config).  The
unknowns are the log of the four rates and of the initial state, and the loss
is the mean squared error of the log populations.

Compiling this program takes seconds; running it takes milliseconds.  With
``--jit kiln`` the compiled executable is stored, so a second process skips
tracing and compiling entirely::

    python -m kiln_demo.lotka_volterra --jit jax    # compiles every time
    python -m kiln_demo.lotka_volterra --jit kiln   # compiles once, then loads

(``python examples/lotka_volterra.py`` in a checkout is the same program.)  The
data file ``hudson_bay.csv`` sits next to this file; ``README.md`` there says
where it comes from.  ``kiln demo`` runs this file in fresh processes; it needs
the ``examples`` extra (equinox, diffrax, optimistix).

The last line printed is one JSON object, e.g.
``{"time_to_first_result_s": ..., "params": {"a": ..., ...}, "loss": ...}``.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent / "hudson_bay.csv"
PARAM_NAMES = ("a", "b", "c", "d")
# Starting point of the optimiser: rough magnitudes, deliberately not the answer.
INITIAL_GUESS = {"a": 0.5, "b": 0.02, "c": 1.0, "d": 0.02}


def load_data(path: str | Path = DEFAULT_DATA) -> tuple[np.ndarray, np.ndarray]:
    """Read ``year,hare,lynx`` CSV; return ``ts`` (years since the first, shape (n,))
    and ``ys`` (hare, lynx populations in thousands, shape (n, 2)), both float32
    (the dtype the fit computes in)."""
    table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    years, ys = table[:, 0], table[:, 1:3]
    return (years - years[0]).astype(np.float32), np.ascontiguousarray(ys, dtype=np.float32)


def _to_jax_jit(jit: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(jit):
        return jit
    if jit == "jax":
        import jax

        return jax.jit
    if jit == "kiln":
        import kiln  # lazily: only this mode needs it

        return kiln.jit
    raise ValueError(f"unknown jit mode {jit!r}; expected 'kiln' or 'jax'")


def _build_fit() -> Callable[[Any, Any], Any]:
    """Return the (un-jitted) ``fit(ts, ys) -> (theta, loss, num_steps)`` function."""
    import diffrax
    import jax.numpy as jnp
    import optimistix as optx

    def vector_field(t, state, rates):
        x, y = state[0], state[1]
        a, b, c, d = rates[0], rates[1], rates[2], rates[3]
        return jnp.stack([a * x - b * x * y, -c * y + d * x * y])

    term = diffrax.ODETerm(vector_field)
    solver = diffrax.Tsit5()
    controller = diffrax.PIDController(rtol=1e-6, atol=1e-6)

    def simulate(log_theta, ts):
        theta = jnp.exp(log_theta)
        rates, y0 = theta[:4], theta[4:]
        sol = diffrax.diffeqsolve(
            term,
            solver,
            t0=ts[0],
            t1=ts[-1],
            dt0=0.1,
            y0=y0,
            args=rates,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=controller,
            max_steps=4096,
        )
        return sol.ys

    def loss_fn(log_theta, data):
        ts, log_ys = data
        pred = simulate(log_theta, ts)
        return jnp.mean((jnp.log(pred) - log_ys) ** 2)

    def fit(ts, ys):
        ts = jnp.asarray(ts)
        log_ys = jnp.log(jnp.asarray(ys))
        guess = jnp.array([INITIAL_GUESS[k] for k in PARAM_NAMES], dtype=log_ys.dtype)
        log_theta0 = jnp.concatenate([jnp.log(guess), log_ys[0]])
        solver = optx.BFGS(rtol=1e-6, atol=1e-6)
        sol = optx.minimise(loss_fn, solver, log_theta0, args=(ts, log_ys), max_steps=512)
        theta = jnp.exp(sol.value)
        return theta, loss_fn(sol.value, (ts, log_ys)), sol.stats["num_steps"]

    return fit


def make_fit(jit: str | Callable[..., Any] = "kiln") -> Callable[[Any, Any], Any]:
    """Return the whole fit, ``fit(ts, ys) -> (theta, loss, num_steps)``, as ONE jitted
    function.

    ``theta`` is ``[a, b, c, d, hare0, lynx0]``; ``num_steps`` counts BFGS iterations.
    ``jit`` is ``"kiln"``, ``"jax"`` or a ``jax.jit``-like callable.
    """
    return _to_jax_jit(jit)(_build_fit())


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{float(x):.{digits}g}")


def compile_timings(ts: np.ndarray, ys: np.ndarray) -> dict[str, Any]:
    """Time ``jax.jit(fit)``'s trace, lower and compile stages (a fresh jit, no caches)."""
    import jax

    fit = jax.jit(_build_fit())
    t = time.perf_counter()
    traced = fit.trace(ts, ys)
    t_trace = time.perf_counter() - t
    t = time.perf_counter()
    lowered = traced.lower()
    t_lower = time.perf_counter() - t
    text = lowered.as_text()
    t = time.perf_counter()
    lowered.compile()
    t_compile = time.perf_counter() - t
    return {
        "trace_s": round(t_trace, 3),
        "lower_s": round(t_lower, 3),
        "compile_s": round(t_compile, 3),
        "hlo_has_callback": "callback" in text,
        "hlo_chars": len(text),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("kiln", "jax"), default="kiln")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=0, help="call the fit N more times")
    parser.add_argument(
        "--timings",
        action="store_true",
        help="also time jax.jit(fit).trace/lower/compile (compiles a second time)",
    )
    args = parser.parse_args(argv)

    import jax

    ts, ys = load_data(args.data)
    fit = make_fit(args.jit)
    theta, loss, num_steps = jax.block_until_ready(fit(ts, ys))
    time_to_first = time.perf_counter() - _T_START

    result: dict[str, Any] = {
        "jit": args.jit,
        "time_to_first_result_s": round(time_to_first, 3),
        "params": {k: _sig(v) for k, v in zip(PARAM_NAMES, np.asarray(theta)[:4], strict=True)},
        "initial_state": {"hare": _sig(theta[4]), "lynx": _sig(theta[5])},
        "loss": _sig(loss),
        "bfgs_steps": int(num_steps),
    }
    if args.repeat > 0:
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            jax.block_until_ready(fit(ts, ys))
            times.append(time.perf_counter() - t)
        result["steady_s"] = round(statistics.median(times), 6)
    if args.timings:
        result.update(compile_timings(ts, ys))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
