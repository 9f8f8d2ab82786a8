"""Benchmark kiln._keys._hashing.static_digest.

Run from the repository root:

    PYTHONPATH=src python benchmarks/hashing.py [--reps 7] [--json PATH]

Prints the throughput (GB/s) of hashing a 64 MiB float32 NumPy array (re-hashed on every call,
because NumPy arrays are mutable), and the per-call cost (microseconds) of a repeated 64 MiB
``jax.Array`` (memoised after the first call) next to a Python int. Every figure is the median of
``--reps`` runs. Takes a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _harness as bench
import jax
import jax.numpy as jnp
import numpy as np

from kiln._keys._hashing import static_digest

NBYTES = 64 * 2**20  # 64 MiB
CALLS = 20_000  # calls per timed run for the cheap (microsecond) cases


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=7), argv, dists=("jax", "jaxlib", "numpy"))
    host = np.random.default_rng(0).standard_normal(NBYTES // 4, dtype=np.float32)
    dev = jax.block_until_ready(jnp.asarray(host))

    def per_call(fn: Callable[[], Any], calls: int) -> float:
        """Median over --reps runs of the seconds of one call (after one call to warm up)."""
        fn()
        return bench.median(bench.clock(fn, calls) for _ in range(args.reps))

    def first_jax() -> float:
        """The first static_digest of a fresh jax.Array (host copy + hash)."""
        array = jax.block_until_ready(jnp.asarray(host))
        start = time.perf_counter()
        static_digest(array, argname="a")
        return time.perf_counter() - start

    numpy_s = per_call(lambda: static_digest(host, argname="a"), 1)
    first_jax_s = bench.median(first_jax() for _ in range(args.reps))
    jax_s = per_call(lambda: static_digest(dev, argname="a"), CALLS)
    int_s = per_call(lambda: static_digest(12345, argname="n"), CALLS)

    print(f"backend {jax.default_backend()}; median of {args.reps} runs; 64 MiB = {NBYTES} bytes")
    rows = [
        ("numpy float32 64 MiB (re-hashed each call)", numpy_s, f"{NBYTES / numpy_s / 1e9:.2f}"),
        ("jax.Array float32 64 MiB, first call", first_jax_s, ""),
        ("jax.Array float32 64 MiB, repeated (memo)", jax_s, ""),
        ("Python int", int_s, ""),
    ]
    print(bench.table(["case", "per call us", "vs int", "GB/s"],
                      [[name, f"{s * 1e6:.2f}", f"{s / int_s:.1f}x", gbps]
                       for name, s, gbps in rows]))
    bench.save(args, {"backend": jax.default_backend(), "nbytes": NBYTES,
                      "per_call_s": {name: seconds for name, seconds, _ in rows},
                      "numpy_gb_per_s": NBYTES / numpy_s / 1e9})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
