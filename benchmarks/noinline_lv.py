"""Benchmark: cold time to first result of the Lotka-Volterra fit with a noinline vector field.

Run from the repository root (about 12 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/noinline_lv.py [--quick] [--reps 5] [--json PATH]

The fit is examples/lotka_volterra.py's (``optimistix.BFGS`` over a ``diffrax`` Tsit5 solve with
adaptive steps, one jitted function), replicated here so the vector field can be wrapped. One
difference: BFGS tolerances are 1e-5, not the example's 1e-6. At 1e-6 the fit sits at float32's
noise floor: any change in rounding (a noinline vector field is compiled on its own, so XLA
fuses it differently; a 1e-4 relative change of the initial guess does the same with plain
``jax.jit``) can leave BFGS at ``max_steps`` and raise.

Modes, each in a fresh process with an empty ``KILN_CACHE_DIR``:

- ``jax``: ``jax.jit(fit)``, vector field inlined (the anchor);
- ``kiln``: ``kiln.jit(fit)``, vector field ``kiln.noinline``. The first result comes from the
  not-inlined program (a host round trip per vector-field call); tier-up compiles the inlined
  program in the background. Also timed: first call until ``kiln.wait_for_tier_up()`` returns,
  and calls after tier-up;
- ``kiln tier_up=0``: the same with ``KILN_TIER_UP=0``: the runtime before tier-up;
- ``jax+noinline``: ``jax.jit(fit)``, vector field ``kiln.noinline`` (never tiers up);
- ``equinox``: ``jax.jit(fit)``, vector field ``equinox.internal.noinline``;
- ``jax stub``: ``jax.jit(fit)`` with the vector field replaced by a 2-equation stub
  (``-y * rates[:2]``): what the fit costs if its vector field cost nothing to trace, lower
  and compile, i.e. the floor for any noinline vector field (its fitted values are another
  model's: only its time is reported).

"first" is the wall time of the first ``fit(ts, ys)`` call until its result is ready (trace +
lower + compile of the program and of the noinline pieces + run); imports are reported apart
("start" is from before ``import jax``). "run" is the median time of later calls (7 for ``jax``,
9 for ``kiln`` after tier-up, 3 for ``kiln tier_up=0``, 1 for the other two). The ``kiln``
process also compiles the plain ``jax.jit`` fit after tier-up and alternates calls of the two,
so the steady-state ratio compares them under the same machine load. Each figure is the median
over ``--reps`` processes.

The last section (``--no-breakdown`` skips it, ``--breakdown-only`` runs only it) times
``jax.jit(...).trace / lower / compile`` of the whole fit and of its pieces, each in a fresh
process: where the cold time goes. One row compiles the fit at XLA's lowest optimization level
(what a quick first tier could save).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent
MODES = ("jax", "kiln", "kiln tier_up=0", "jax+noinline", "equinox", "jax stub")
TARGET_FIRST = 0.5  # kiln first result / jax.jit first result
TARGET_STEADY = 1.05  # kiln run after tier-up / jax.jit run

# Shared by the worker and the breakdown: the example's fit with a wrappable vector field.
FIT_SOURCE = r'''
import time
T_START = time.perf_counter()
import json, statistics, sys
sys.path.insert(0, EXAMPLES)
import jax, jax.numpy as jnp, numpy as np
import diffrax, optimistix as optx
import lotka_volterra as lv

BFGS_TOL = 1e-5


def vector_field(t, state, rates):
    x, y = state[0], state[1]
    a, b, c, d = rates[0], rates[1], rates[2], rates[3]
    return jnp.stack([a * x - b * x * y, -c * y + d * x * y])


def stub_vector_field(t, state, rates):
    return -state * rates[:2]


def make_loss(vf):
    term = diffrax.ODETerm(vf)
    solver = diffrax.Tsit5()
    controller = diffrax.PIDController(rtol=1e-6, atol=1e-6)

    def loss_fn(log_theta, data):
        ts, log_ys = data
        theta = jnp.exp(log_theta)
        rates, y0 = theta[:4], theta[4:]
        sol = diffrax.diffeqsolve(
            term, solver, t0=ts[0], t1=ts[-1], dt0=0.1, y0=y0, args=rates,
            saveat=diffrax.SaveAt(ts=ts), stepsize_controller=controller, max_steps=4096,
        )
        return jnp.mean((jnp.log(sol.ys) - log_ys) ** 2)

    return loss_fn


def make_fit(loss_fn):
    def fit(ts, ys):
        ts = jnp.asarray(ts)
        log_ys = jnp.log(jnp.asarray(ys))
        guess = jnp.array([lv.INITIAL_GUESS[k] for k in lv.PARAM_NAMES], dtype=log_ys.dtype)
        log_theta0 = jnp.concatenate([jnp.log(guess), log_ys[0]])
        solver = optx.BFGS(rtol=BFGS_TOL, atol=BFGS_TOL)
        sol = optx.minimise(loss_fn, solver, log_theta0, args=(ts, log_ys), max_steps=512)
        return jnp.exp(sol.value), loss_fn(sol.value, (ts, log_ys)), sol.stats["num_steps"]

    return fit


def timed(f, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    return out, time.perf_counter() - t
'''

WORKER = FIT_SOURCE + r'''
mode = sys.argv[1]
import kiln
import equinox.internal as eqxi
t_imports = time.perf_counter() - T_START
ts, ys = lv.load_data()
wrap = {"jax": lambda f: f, "jax stub": lambda f: stub_vector_field,
        "equinox": eqxi.noinline}.get(mode, kiln.noinline)
outer = kiln.jit if mode.startswith("kiln") else jax.jit
fit = outer(make_fit(make_loss(wrap(vector_field))))
(theta, loss, steps), first = timed(fit, ts, ys)
rec = {"imports_s": t_imports, "first_s": first, "start_s": time.perf_counter() - T_START,
       "loss": float(loss), "bfgs_steps": int(steps), "theta": np.asarray(theta).tolist(),
       "noinline_calls": kiln.stats().noinline_calls}
if mode == "kiln":
    kiln.wait_for_tier_up()
    rec["tier_up_s"] = first + (time.perf_counter() - T_START - rec["start_s"])
    rec["tier_ups"] = kiln.stats().tier_ups
calls = {"jax": 7, "kiln": 9, "kiln tier_up=0": 3}.get(mode, 1)
runs, anchor_runs = [], []
if mode == "kiln":  # the anchor in this process, calls interleaved: same machine load
    anchor = jax.jit(make_fit(make_loss(vector_field)))
    jax.block_until_ready(anchor(ts, ys))
for _ in range(calls):
    (theta2, loss2, _), t = timed(fit, ts, ys)
    runs.append(t)
    if mode == "kiln":
        anchor_runs.append(timed(anchor, ts, ys)[1])
rec["run_s"] = statistics.median(runs)
if mode == "kiln":
    rec["anchor_run_s"] = statistics.median(anchor_runs)
rec["later_loss"] = float(loss2)
rec["later_noinline_calls"] = kiln.stats().noinline_calls - rec["noinline_calls"]
rec["compiles"] = kiln.stats().compiles
print(json.dumps(rec))
'''

BREAKDOWN = FIT_SOURCE + r'''
import kiln
import jax.extend.core as jex
row = sys.argv[1]
ts, ys = lv.load_data()
log_ys = jnp.log(ys)
theta0, y, r = jnp.zeros(6), jnp.ones(2), jnp.ones(4)
loss = make_loss(vector_field)
ROWS = {
    "vector field": (vector_field, 0.0, y, r),
    "vector field jvp": (lambda t, y, r, dy, dr: jax.jvp(vector_field, (t, y, r), (0.0, dy, dr)),
                         0.0, y, r, y, r),
    "vector field vjp": (lambda t, y, r, c: jax.vjp(vector_field, t, y, r)[1](c), 0.0, y, r, y),
    "loss (one ODE solve)": (loss, theta0, (ts, log_ys)),
    "value_and_grad(loss)": (jax.value_and_grad(loss), theta0, (ts, log_ys)),
    "fit, vector field inlined": (make_fit(loss), ts, ys),
    "fit, vector field inlined, XLA -O0": (make_fit(loss), ts, ys),
    "fit, vector field kiln.noinline":
        (make_fit(make_loss(kiln.noinline(vector_field))), ts, ys),
    "fit, loss kiln.noinline": (make_fit(kiln.noinline(loss)), ts, ys),
}


def equations(jaxpr, counts):
    for eqn in jaxpr.eqns:
        counts["all"] = counts.get("all", 0) + 1
        if eqn.primitive.name == "kiln_noinline":
            counts[eqn.params["fn"].name] = counts.get(eqn.params["fn"].name, 0) + 1
        for sub in jex.jaxprs_in_params(eqn.params):
            equations(getattr(sub, "jaxpr", sub), counts)
    return counts


if row == "equations":
    n_vf = len(jax.make_jaxpr(vector_field)(0.0, y, r).eqns)
    n_fit = equations(jax.make_jaxpr(ROWS["fit, vector field inlined"][0])(ts, ys).jaxpr, {})
    sites = equations(jax.make_jaxpr(ROWS["fit, vector field kiln.noinline"][0])(ts, ys).jaxpr, {})
    sites.pop("all")
    print(f"  equations: vector field {n_vf}; fit (inlined, sub-jaxprs included) {n_fit['all']};"
          f" noinline call sites in the fit: {sites}")
    sys.exit(0)
f, *args = ROWS[row]
try:
    t = time.perf_counter(); traced = jax.jit(f).trace(*args); t_trace = time.perf_counter() - t
except Exception as e:
    print(f"  {row:34s} fails: {type(e).__name__}: {str(e).splitlines()[0]}")
    sys.exit(0)
t = time.perf_counter(); lowered = traced.lower(); t_lower = time.perf_counter() - t
# XLA's lowest optimization level: what a quick first tier could save on compile
options = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
           if row.endswith("XLA -O0") else None)
t = time.perf_counter(); compiled = lowered.compile(options); t_compile = time.perf_counter() - t
s0 = kiln.stats()
_, t_run = timed(compiled, *args)
s1 = kiln.stats()
sub_s = s1.compile_seconds - s0.compile_seconds
calls = s1.noinline_calls - s0.noinline_calls
print(f"  {row:34s} {t_trace:6.2f} {t_lower:6.2f} {t_compile:8.2f} {t_run:7.3f}"
      f" {s1.compiles - s0.compiles:4d} {sub_s:6.2f} {calls:8d}", flush=True)
'''
BREAKDOWN_ROWS = (
    "vector field", "vector field jvp", "vector field vjp", "loss (one ODE solve)",
    "value_and_grad(loss)", "fit, vector field inlined", "fit, vector field inlined, XLA -O0",
    "fit, vector field kiln.noinline",
    "fit, loss kiln.noinline", "equations",
)


def _python(source: str, args: list[str], store: str, **extra: str) -> bench.Fresh:
    code = f"EXAMPLES = {str(REPO / 'examples')!r}\n" + source
    env = bench.child_env(**bench.kiln_store(store), **extra)
    return bench.fresh(["-c", code, *args], env=env, cwd=REPO)


def measure(mode: str, rep: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as store:
        extra = {"KILN_TIER_UP": "0"} if mode == "kiln tier_up=0" else {}
        return {"mode": mode, **_python(WORKER, [mode], store, **extra).record()}


def _shown(mode: str, rec: dict[str, Any]) -> str:
    extra = ""
    if mode == "kiln":
        extra = (f", tier-up done {rec['tier_up_s']:6.2f} s (tier_ups={rec['tier_ups']}),"
                 f" jax.jit run here {rec['anchor_run_s'] * 1e3:.1f} ms")
    trips = "n/a" if mode == "equinox" else (
        f"{rec['noinline_calls']} (later calls: {rec['later_noinline_calls']})")
    return (f"first {rec['first_s']:6.2f} s{extra}, run {rec['run_s'] * 1e3:8.1f} ms, bfgs steps "
            f"{rec['bfgs_steps']}, loss {rec['loss']:.7f}, kiln host round trips {trips}")


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5, quick_reps=1)
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--breakdown-only", action="store_true")
    args = bench.begin(parser, argv)
    reps = 0 if args.breakdown_only else args.reps
    # modes interleaved, so drift in machine load hits all alike
    results = bench.interleave(MODES, reps, measure, rotate=False, label=lambda m: f"{m:15s}",
                               show=lambda r: _shown(r["mode"], r))

    if not args.breakdown_only:
        med = {f: bench.medians(results, f) for f in ("imports_s", "first_s", "run_s",
                                                        "bfgs_steps", "noinline_calls")}
        print(f"\nmedian of {reps} fresh processes per mode (empty store each)")
        print(bench.table(["mode", "imports s", "first s", "tier-up s", "run ms", "steps",
                           "round trips"], [
            [m, med["imports_s"][m], med["first_s"][m],
             bench.median(r["tier_up_s"] for r in results[m]) if m == "kiln" else None,
             f"{med['run_s'][m] * 1e3:.1f}", int(med["bfgs_steps"][m]),
             "n/a" if m == "equinox" else int(med["noinline_calls"][m])] for m in MODES]))
        first = bench.ratios(med["first_s"], "jax")
        kiln = results["kiln"]
        print()
        print(f"kiln first result / jax.jit first result: {first['kiln']:.2f} (target <= "
              f"{TARGET_FIRST})")
        tier_up = bench.median(r["tier_up_s"] for r in kiln) / med["first_s"]["jax"]
        print(f"kiln tier-up done / jax.jit first result: {tier_up:.2f}")
        for mode in ("jax+noinline", "equinox", "jax stub"):
            print(f"{mode} first result / jax.jit first result: {first[mode]:.2f}")
        steady = bench.pair_ratios([r["run_s"] for r in kiln], [r["anchor_run_s"] for r in kiln])
        print(f"kiln run after tier-up / jax.jit run, same process, interleaved: "
              f"{bench.median(steady):.2f} (target <= {TARGET_STEADY}; per process: "
              f"{', '.join(f'{x:.2f}' for x in steady)})")
        run = bench.ratios(med["run_s"], "jax")
        print(f"kiln run after tier-up / jax.jit run, separate processes: {run['kiln']:.2f}")
        print(f"kiln run before tier-up (KILN_TIER_UP=0) / jax.jit run: "
              f"{run['kiln tier_up=0']:.1f}")
        print(f"kiln tier_ups per process: {sorted({r['tier_ups'] for r in kiln})}")

    if not args.no_breakdown:
        print("\nwhere the cold time goes (each row a fresh process, empty store; seconds; "
              "sub: noinline pieces kiln compiled during run1, sub_s: their trace + lower + "
              "compile; calls: kiln host round trips in run1)")
        print(f"  {'jax.jit(...) of':34s} {'trace':>6} {'lower':>6} {'compile':>8} {'run1':>7}"
              f" {'sub':>4} {'sub_s':>6} {'calls':>8}")
        for row in BREAKDOWN_ROWS:
            with tempfile.TemporaryDirectory() as store:
                print(_python(BREAKDOWN, [row], store).stdout, end="", flush=True)

    bench.save(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
