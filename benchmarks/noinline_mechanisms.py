"""Benchmark: the per-call price of each mechanism for calling a separately compiled function.

Run from the repository root (about a minute):

    python benchmarks/noinline_mechanisms.py [--reps 7] [--json PATH]

A tiny sub-function (``tanh(x * 1.01 + 0.1)`` on float32[64]) is called at N = 16 sites in
sequence, by each mechanism; the price per call is ``(time - time of the inlined program) / 16``
(median of ``--reps`` (7) repetitions of 200 calls each, one process). Mechanisms:

- ``inlined``: plain ``jax.jit`` (XLA inlines the sub-function: the anchor, price 0);
- ``kiln host callback``: ``kiln.noinline`` under ``jax.jit`` (``mlir.emit_python_callback``
  into the sub-function's executable), which kiln uses before tier-up and under plain jax.jit;
- ``pure_callback``: ``jax.pure_callback`` into the same executable (kiln's first version);
- ``equinox noinline``: ``equinox.internal.noinline`` (also a host callback);
- ``segmented``: what segmented execution of top-level calls would cost: each call one
  dispatch of the sub-function's executable from Python with the buffers left on the device
  (the pieces of the caller in between are not counted, so this is a lower bound);
- ``kiln tier-up``: ``kiln.jit`` caller after tier-up (the inlined program swapped in).
"""

from __future__ import annotations

import os
import tempfile

import _harness as bench


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=7), argv)
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    import equinox.internal as eqxi
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kiln

    n = 16

    def sub(x):
        return jnp.tanh(x * 1.01 + 0.1)

    sub_exec = jax.jit(sub)
    ki = kiln.noinline(sub)
    eq = eqxi.noinline(sub)

    def via_pure_callback(x):
        return jax.pure_callback(lambda v: np.asarray(sub_exec(v)),
                                 jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def chain(f):
        def outer(x):
            for _ in range(n):
                x = f(x)
            return x
        return outer

    def segmented(x):
        for _ in range(n):
            x = sub_exec(x)
        return x

    tier = kiln.jit(chain(ki))
    programs = {
        "inlined": jax.jit(chain(sub)),
        "kiln host callback": jax.jit(chain(ki)),
        "pure_callback": jax.jit(chain(via_pure_callback)),
        "equinox noinline": jax.jit(chain(eq)),
        "segmented": segmented,
        "kiln tier-up": tier,
    }
    x = jnp.ones(64)
    for f in programs.values():
        jax.block_until_ready(f(x))
    kiln.wait_for_tier_up()
    assert kiln.stats().tier_ups == 1

    def calls(f):  # 200 calls in a row, then their last result ready
        def run():
            for _ in range(200):
                y = f(x)
            jax.block_until_ready(y)
        return run

    times = {name: bench.median(bench.clock(calls(f)) / 200 for _ in range(args.reps))
             for name, f in programs.items()}
    base = times["inlined"]
    out = {name: {"program_s": t, "per_call_s": (t - base) / n} for name, t in times.items()}
    print()
    print(bench.table(["mechanism", "program (16 calls) us", "price per call us"],
                      [[name, f"{r['program_s'] * 1e6:.1f}", f"{r['per_call_s'] * 1e6:.1f}"]
                       for name, r in out.items()]))
    bench.save(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
