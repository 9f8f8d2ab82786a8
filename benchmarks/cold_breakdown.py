"""Benchmark: where kiln's cold path spends time that ``jax.jit``'s does not, measured inside
fresh processes on the Lotka-Volterra fit (the in-process figures behind
``benchmarks/cold_tax.py``, whose target is <= 1.05x of ``jax.jit``).

Run from the repository root (about 2 minutes; needs the ``examples`` extra):

    python benchmarks/cold_breakdown.py [--reps 5] [--json PATH]

Per repetition, fresh processes measure:

- ``gc``: seconds Python's garbage collector runs (``gc.callbacks``) during ``jax.jit(fit)``'s
  trace and lowering, and the objects it frees, under CPython's default thresholds and under
  kiln's relaxed one (``kiln._base._gc.THRESHOLD``);
- ``fingerprint``: kiln's static walk of the fit, the first in the process (``fingerprint``);
- ``serialize``: XLA serializing the fit's compiled executable (``serialize_compiled``);
- ``jax_put``: what JAX's persistent cache spends serializing and compressing a small program
  (``jax_put``: ``compilation_cache.put_executable_and_time``), the work kiln's own compiles
  no longer cause (``kiln._base._jax_compat.no_persistent_cache_writes``).

Printed: the median of each over the repetitions.
"""

from __future__ import annotations

from typing import Any

import _harness as bench

CHILD = r'''
import gc, json, sys, time
import jax, jax.numpy as jnp
from kiln._base import _gc, _jax_compat
from kiln._keys._fingerprint import fingerprint
from kiln_demo.lotka_volterra import _build_fit, load_data

what = sys.argv[1]
ts, ys = load_data()
fit = _build_fit()
out = {}
if what.startswith("gc"):
    seconds, freed, t0 = [0.0], [0], [0.0]

    def watch(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            seconds[0] += time.perf_counter() - t0[0]
            freed[0] += info["collected"]

    if what == "gc-relaxed":
        gc.set_threshold(_gc.THRESHOLD, *gc.get_threshold()[1:])
    gc.callbacks.append(watch)
    jax.jit(fit).trace(ts, ys).lower()
    gc.callbacks.remove(watch)
    out = {"seconds": seconds[0], "freed": freed[0]}
elif what == "fingerprint":
    t = time.perf_counter()
    fingerprint(fit)
    out = {"seconds": time.perf_counter() - t}
elif what == "serialize":
    compiled = jax.jit(fit).lower(ts, ys).compile()
    t = time.perf_counter()
    sections, _ = _jax_compat.serialize_compiled(compiled)
    out = {"seconds": time.perf_counter() - t, "bytes": len(sections["exec"])}
elif what == "jax_put":
    import tempfile
    from jax._src import compilation_cache
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    spent, real = [0.0], compilation_cache.put_executable_and_time

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    compilation_cache.put_executable_and_time = timed

    @jax.jit
    def small(x):
        for i in range(30):
            x = jnp.tanh(x @ x.T + i)
        return x

    x = jnp.ones((64, 64))
    spent[0] = 0.0  # (the eager ones above are not the program)
    small(x).block_until_ready()
    out = {"seconds": spent[0]}
print(json.dumps(out))
'''

MEASURES = ("gc-default", "gc-relaxed", "fingerprint", "serialize", "jax_put")


def run(what: str, rep: int) -> dict[str, Any]:
    env = bench.child_env(JAX_PLATFORMS="cpu", KILN_JAX_CACHE="0")
    return bench.fresh(["-c", CHILD, what], env=env, timeout=600).record()


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=5), argv, installed=True)
    samples = bench.interleave(MEASURES, args.reps, run, rotate=False,
                               show=lambda r: f"{r['seconds']:.3f} s")
    med = bench.medians(samples, "seconds")
    freed = {w: bench.median(s["freed"] for s in samples[w]) for w in ("gc-default", "gc-relaxed")}
    print()
    ranges = {w: bench.spread(s["seconds"] for s in rs) for w, rs in samples.items()}
    print(bench.table(["measure", "median s", "(min-max)"],
                      [[w, med[w], f"{r['min']:.3f}-{r['max']:.3f}"] for w, r in ranges.items()]))
    print(f"garbage collection in the fit's trace + lowering: {med['gc-default']:.3f} s with "
          f"CPython's thresholds (freed {freed['gc-default']:.0f} objects), "
          f"{med['gc-relaxed']:.3f} s with kiln's (freed {freed['gc-relaxed']:.0f})")
    print(f"fingerprint of the fit, first in the process: {med['fingerprint']:.3f} s")
    print(f"XLA serializing the fit's executable ({samples['serialize'][0]['bytes']} bytes): "
          f"{med['serialize']:.3f} s")
    print(f"JAX's cache serializing + compressing a small program for a write: "
          f"{med['jax_put']:.3f} s (what kiln's own compiles no longer cause)")
    bench.save(args, {"samples": samples, "medians_s": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
