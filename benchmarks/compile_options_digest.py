"""Benchmark: what keying the compile settings costs on a miss of the process's table (target:
reused <= ~50 us).

Run from the repository root (a few seconds):

    PYTHONPATH=src python benchmarks/compile_options_digest.py [--reps 7] [--json out.json]

In one process, microseconds per call (median over ``--reps`` repetitions of 2000 calls):
JAX building the compile options (``jax._src.compiler.get_compile_options``) and digesting them
as its cache key does (``cache_key._hash_serialized_compile_options``): what kiln's
``compile-options`` part costs when made; the config values kiln compares to reuse it; kiln's
``compile_options_digest`` with nothing changed (reused); all of ``environment_parts()``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
import timeit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)

    import jax
    from jax._src import cache_key, compiler

    from kiln._base import _jax_compat
    from kiln._keys import environment_parts

    backend = jax.devices()[0].client

    def made() -> str:
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                               detailed_logging=True, backend=backend)
        h = hashlib.sha256()
        cache_key._hash_serialized_compile_options(h, options, strip_device_assignment=True)
        return h.hexdigest()

    holders = jax.config._value_holders  # type: ignore[attr-defined]
    figures = {}
    for name, fn in (
        ("made_us", made),
        ("config_values_us", lambda: tuple([h.value for h in holders.values()])),
        ("reused_us", lambda: _jax_compat.compile_options_digest(backend)),
        ("environment_parts_us", environment_parts),
    ):
        fn()
        times = timeit.repeat(fn, number=2000, repeat=args.reps)
        figures[name] = round(statistics.median(times) / 2000 * 1e6, 1)
        print(f"{name:>22}: {figures[name]} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
