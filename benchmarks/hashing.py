"""Benchmark kiln._keys._hashing.static_digest.

Run from the repository root:

    PYTHONPATH=src python benchmarks/hashing.py [--json PATH]

Prints the throughput (GB/s) of hashing a 64 MiB float32 NumPy array (re-hashed on every call,
because NumPy arrays are mutable), and the per-call cost (microseconds) of a repeated 64 MiB
``jax.Array`` (memoised after the first call) next to a Python int. Every figure is the median of
REPEATS runs. Takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kiln._keys._hashing import static_digest

REPEATS = 7
NBYTES = 64 * 2**20  # 64 MiB
CALLS = 20_000  # calls per timed run for the cheap (microsecond) cases


def median_seconds(fn: Callable[[], Any], calls: int) -> float:
    """Median over REPEATS runs of the wall time of one call, in seconds."""
    fn()  # warm up
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    host = np.random.default_rng(0).standard_normal(NBYTES // 4, dtype=np.float32)
    dev = jax.block_until_ready(jnp.asarray(host))

    numpy_s = median_seconds(lambda: static_digest(host, argname="a"), calls=1)
    first_jax_s = _first_call_seconds(host)
    jax_s = median_seconds(lambda: static_digest(dev, argname="a"), calls=CALLS)
    int_s = median_seconds(lambda: static_digest(12345, argname="n"), calls=CALLS)

    print(f"jax {jax.__version__}, numpy {np.__version__}, backend {jax.default_backend()}")
    print(f"median of {REPEATS} runs; 64 MiB = {NBYTES} bytes")
    print()
    print(f"{'case':<44}{'per call':>14}{'vs int':>12}{'GB/s':>10}")
    rows = [
        ("numpy float32 64 MiB (re-hashed each call)", numpy_s, f"{NBYTES / numpy_s / 1e9:.2f}"),
        ("jax.Array float32 64 MiB, first call", first_jax_s, ""),
        ("jax.Array float32 64 MiB, repeated (memo)", jax_s, ""),
        ("Python int", int_s, ""),
    ]
    for name, seconds, gbps in rows:
        print(f"{name:<44}{seconds * 1e6:>11.2f} us{seconds / int_s:>11.1f}x{gbps:>10}")
    if args.json:
        args.json.write_text(json.dumps({
            "jax": jax.__version__, "numpy": np.__version__, "backend": jax.default_backend(),
            "repeats": REPEATS, "nbytes": NBYTES,
            "per_call_s": {name: seconds for name, seconds, _ in rows},
            "numpy_gb_per_s": NBYTES / numpy_s / 1e9}, indent=2))
    return 0


def _first_call_seconds(host: np.ndarray) -> float:
    """Median cost of the first static_digest of a fresh jax.Array (host copy + hash)."""
    samples = []
    for _ in range(REPEATS):
        fresh = jax.block_until_ready(jnp.asarray(host))
        start = time.perf_counter()
        static_digest(fresh, argname="a")
        samples.append(time.perf_counter() - start)
        del fresh
    return statistics.median(samples)


if __name__ == "__main__":
    raise SystemExit(main())
