"""Benchmark: what keying the compile settings costs on a miss of the process's table (target:
reused <= ~50 us).

Run from the repository root (a few seconds):

    PYTHONPATH=src python benchmarks/compile_options_digest.py [--reps 7] [--json out.json]

In one process, microseconds per call (median over ``--reps`` repetitions of 2000 calls, the
garbage collector off while they run, as ``timeit`` has it): JAX building the compile options
(``jax._src.compiler.get_compile_options``) and digesting them as its cache key does
(``cache_key._hash_serialized_compile_options``): what kiln's ``compile-options`` part costs
when made; the config values kiln compares to reuse it; kiln's ``compile_options_digest`` with
nothing changed (reused); all of ``environment_parts()``.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable
from typing import Any

import _harness as bench

CALLS = 2000


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=7), argv)

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

    def timed(fn: Callable[[], Any]) -> float:
        gc.disable()
        try:
            return bench.clock(fn, CALLS)
        finally:
            gc.enable()

    holders = jax.config._value_holders  # type: ignore[attr-defined]
    figures = {}
    for name, fn in (
        ("made_us", made),
        ("config_values_us", lambda: tuple([h.value for h in holders.values()])),
        ("reused_us", lambda: _jax_compat.compile_options_digest(backend)),
        ("environment_parts_us", environment_parts),
    ):
        fn()
        figures[name] = round(bench.median(timed(fn) for _ in range(args.reps)) * 1e6, 1)
    print(bench.table(["per call", "us"], figures.items()))
    bench.save(args, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
