"""Benchmark: compile time of a recursive function vs recursion depth t: ``kiln.noinline``
(each fib(k) compiled once) vs plain ``jax.jit`` (nested jits, inlined: jax-ml/jax #22385) vs
``equinox.internal.noinline``.

Run from the repository root (about 7 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/noinline_fib.py [--quick] [--reps 5] [--json PATH]

The function is ``fib(x, t) = x if t < 2 else fib(x, t - 1) + fib(x, t - 2)`` on float32[3] with
``t`` static, called from a ``jax.jit`` outer program ``lambda x: fib(x, t=T)``:

- jax: ``fib`` is a ``jax.jit(static_argnames="t")`` calling itself (the #22385 pattern). Jax
  traces each fib(k) once, but XLA inlines every call, so the compiled program has one add per
  call: exponential in t. Timed as ``outer.lower(x)`` (trace + lower) and ``.compile()``
  separately, then the compiled program is run.
- kiln: ``fib`` is ``kiln.noinline(static_argnames="t", tier_up=False)``: each fib(k) is its own
  executable, compiled once (t + 1 compiles), and every call is a host round trip: the runtime is
  exponential in t (2 * fib(t) - 1 round trips per call), the compile time linear. kiln compiles
  lazily, when a sub-function is first called, so its compile time can only be measured
  together with a run: "kiln compile" is ``kiln.stats().compile_seconds`` (trace + lower +
  compile of every fib(k)) after the first call, "first" the first call's wall time, "run" the
  second call's.
- equinox: ``fib = equinox.internal.noinline(_fib)``, ``_fib`` calling ``fib``; equinox treats
  the Python int ``t`` as a static (non-array) argument, so each fib(k) is one jitted callback.

"xla" columns count XLA backend compiles and their seconds (``jax.monitoring`` events), the same
measure for all three. Each measurement runs in a fresh process with an empty kiln store; median
of ``--reps`` (5) processes per point. jax points stop growing t once one takes more than 60 s to
compile.
"""

from __future__ import annotations

import subprocess
import tempfile
import time

import _harness as bench

WORKER = r'''
import json, sys, time
import jax, jax.numpy as jnp
mode, T = sys.argv[1], int(sys.argv[2])

xla = {"n": 0, "s": 0.0}


def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        xla["n"] += 1
        xla["s"] += duration


jax.monitoring.register_event_duration_secs_listener(listener)

if mode == "jax":
    import functools

    @functools.partial(jax.jit, static_argnames="t")
    def fib(x, t):
        if t < 2:
            return x
        return fib(x, t=t - 1) + fib(x, t=t - 2)
elif mode == "kiln":
    import kiln

    @kiln.noinline(static_argnames="t", tier_up=False)
    def fib(x, t):
        if t < 2:
            return x
        return fib(x, t=t - 1) + fib(x, t=t - 2)
else:
    import equinox.internal as eqxi

    def _fib(x, t):
        if t < 2:
            return x
        return fib(x, t=t - 1) + fib(x, t=t - 2)

    fib = eqxi.noinline(_fib)

x = jax.block_until_ready(jnp.arange(1.0, 4.0))
outer = jax.jit(lambda x: fib(x, t=T))
xla.update(n=0, s=0.0)  # from here on: compiles of the outer program and of fib only
rec = {}
if mode == "jax":
    t0 = time.perf_counter(); lowered = outer.lower(x); t1 = time.perf_counter()
    run = lowered.compile(); t2 = time.perf_counter()
    out = jax.block_until_ready(run(x)); t3 = time.perf_counter()
    rec.update(lower_s=t1 - t0, compile_s=t2 - t1, first_s=t3 - t0)
else:
    run = outer
    t0 = time.perf_counter(); out = jax.block_until_ready(run(x)); t1 = time.perf_counter()
    rec["first_s"] = t1 - t0
    if mode == "kiln":
        s = kiln.stats()
        rec.update(compile_s=s.compile_seconds, compiles=s.compiles,
                   round_trips=s.noinline_calls)
rec.update(xla_compiles=xla["n"], xla_s=xla["s"])

t0 = time.perf_counter(); jax.block_until_ready(run(x)); rec["run_s"] = time.perf_counter() - t0
rec["value"] = out.tolist()
print(json.dumps(rec))
'''

MODES = ("jax", "kiln", "equinox")
JAX_LIMIT_S = 60.0


def reference(t: int) -> int:
    """fib(x, t) / x: 1, 1, 2, 3, 5, ..."""
    a, b = 1, 1
    for _ in range(t - 1):
        a, b = b, a + b
    return b


def measure(mode: str, t: int, reps: int) -> dict[str, float] | str:
    """Median of each field over ``reps`` fresh processes, or why there is no figure."""
    recs = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            try:
                out = bench.fresh(["-c", WORKER, mode, str(t)],
                                  env=bench.child_env(KILN_CACHE_DIR=d), timeout=600, check=False)
            except subprocess.TimeoutExpired:
                return "timed out (600 s)"
            if out.returncode != 0:
                last = (out.stderr.strip().splitlines() or ["?"])[-1]
                return f"failed: {last[:120]}"
            rec = out.payload
        want = [reference(t) * v for v in (1.0, 2.0, 3.0)]
        if rec.pop("value") != want:
            return f"wrong value (want {want})"
        recs.append(rec)
        if mode == "jax" and rec["lower_s"] + rec["compile_s"] > JAX_LIMIT_S:
            break  # one such process is figure enough
    return {k: bench.median(r[k] for r in recs) for k in recs[0]}


def describe(mode: str, t: int, r: dict[str, float] | str) -> str:
    if isinstance(r, str):
        return f"  {mode:8s} t={t:2d}: {r}"
    if mode == "jax":
        return (f"  {mode:8s} t={t:2d}: trace+lower {r['lower_s']:7.3f} s, compile "
                f"{r['compile_s']:7.3f} s, run {r['run_s'] * 1e3:8.3f} ms")
    extra = ""
    if mode == "kiln":
        extra = f"kiln compile {r['compile_s']:6.3f} s in {r['compiles']:.0f} compiles, "
    return (f"  {mode:8s} t={t:2d}: {extra}xla {r['xla_s']:6.3f} s in {r['xla_compiles']:.0f}, "
            f"first call {r['first_s']:7.3f} s, run {r['run_s'] * 1e3:9.3f} ms")


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=5, quick_reps=1), argv)
    start = time.perf_counter()
    reps = args.reps
    ts = [4, 8] if args.quick else [4, 8, 12, 16, 20]
    # jax alone goes further: its runtime stays tiny, while kiln's and equinox's (one host
    # round trip per call: 150,049 at t=24) would dominate the run
    jax_ts = ts if args.quick else [*ts, 24]
    results: dict[str, dict[int, dict[str, float] | str]] = {m: {} for m in MODES}
    for mode in MODES:
        stop = None
        for t in jax_ts if mode == "jax" else ts:
            if stop is not None:
                results[mode][t] = f"skipped ({stop})"
            else:
                results[mode][t] = r = measure(mode, t, reps)
                if isinstance(r, str):
                    stop = f"t={t} {r.split(' ')[0]}"
                elif mode == "jax" and r["lower_s"] + r["compile_s"] > JAX_LIMIT_S:
                    stop = f"t={t} took over {JAX_LIMIT_S:.0f} s"
            print(describe(mode, t, results[mode][t]), flush=True)

    def cell(mode: str, t: int, key: str, fmt: str) -> str:
        r = results[mode].get(t)
        if r is None:
            return "-"
        if isinstance(r, str):
            return "skipped" if r.startswith("skipped") else "failed"
        return fmt.format(r[key])

    print(f"\nmedian of {reps} fresh processes per point; seconds; comp: compile, n: compiles, "
          "1st: first call, run: second call, trips: host round trips per call")
    cols = [("jax lower", "jax", "lower_s"), ("jax comp", "jax", "compile_s"),
            ("kiln comp", "kiln", "compile_s"), ("kiln n", "kiln", "compiles"),
            ("kiln xla", "kiln", "xla_s"), ("kiln 1st", "kiln", "first_s"),
            ("kiln run", "kiln", "run_s"), ("eqx xla", "equinox", "xla_s"),
            ("eqx n", "equinox", "xla_compiles"), ("eqx 1st", "equinox", "first_s"),
            ("eqx run", "equinox", "run_s")]
    print(bench.table(["t", *(name for name, _, _ in cols), "trips"], [
        [t, *(cell(mode, t, key, fmt="{:.0f}" if key.endswith("compiles") else "{:.3f}")
              for _, mode, key in cols), 2 * reference(t) - 1] for t in jax_ts]))

    kiln_ok = {t: r for t, r in results["kiln"].items() if not isinstance(r, str)}
    if kiln_ok:
        per = {t: r["compile_s"] / r["compiles"] for t, r in kiln_ok.items()}
        counts_ok = all(r["compiles"] == t + 1 for t, r in kiln_ok.items())
        spread = max(per.values()) / min(per.values())
        linear = counts_ok and spread <= 2.0
        print("\nkiln compile seconds per fib(k): "
              + ", ".join(f"t={t}: {s:.3f}" for t, s in per.items()))
        print(f"kiln compile count = t + 1 at every t: {'yes' if counts_ok else 'NO'}; "
              f"compile time linear in t (seconds per fib(k) within 2x across t, "
              f"max/min {spread:.2f}x): {'yes' if linear else 'NO'}")
        for mode in ("kiln", "equinox"):
            trips = {t: r["run_s"] / (2 * reference(t) - 1) for t, r in results[mode].items()
                     if not isinstance(r, str)}
            if trips:
                top = max(trips)
                print(f"{mode} runtime per host round trip at t={top}: "
                      f"{trips[top] * 1e6:.1f} us (runtime exponential in t)")
    jax_ok = {t: r["compile_s"] for t, r in results["jax"].items() if not isinstance(r, str)}
    if len(jax_ok) >= 2:
        steps = sorted(jax_ok)
        print("jax.jit compile growth: " + ", ".join(
            f"t={a}->{b}: {jax_ok[b] / jax_ok[a]:.1f}x"
            for a, b in zip(steps, steps[1:], strict=False)))
        both = [t for t in steps if t in kiln_ok]
        if both:
            top = both[-1]
            print(f"at t={top}: jax.jit compile {jax_ok[top]:.2f} s vs kiln compile "
                  f"{kiln_ok[top]['compile_s']:.2f} s (kiln first call, with its exponential "
                  f"run: {kiln_ok[top]['first_s']:.2f} s)")
    print(f"\ntotal wall time of this benchmark: {time.perf_counter() - start:.0f} s")
    bench.save(args, {m: {str(t): v for t, v in r.items()} for m, r in results.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
