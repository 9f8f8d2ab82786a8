"""Benchmark: one local-store write (``LocalStore.put``) against JAX's cache writing a file
(target: <= 1 ms at 10,000 entries).

Run from the repository root (about 30 seconds):

    python benchmarks/store_put.py [--entries 10000] [--puts 200] [--size 100000] [--reps 5]
                                   [--json PATH]

A store is filled with ``--entries`` entries first (files written directly, then the index
rebuilt, so filling is quick), then ``--puts`` new entries of ``--size`` bytes are written one
by one and each put is timed; the same for JAX's own persistent-cache backend
(``jax._src.lru_cache.LRUCache`` with no size limit: what ``jax_compilation_cache_dir`` writes),
in a directory holding as many files. Per repetition the median put; printed: the median over
``--reps`` repetitions of each, and their ratio. Target: kiln <= 1 ms at 10,000
entries. The index rows of those puts are written at the end of the batch (and at exit), as
the store does, and that flush is timed and printed apart.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as bench


def _fill_kiln(root: Path, n: int) -> None:
    from kiln.stores import LocalStore

    entries = root / "entries"
    for i in range(n):
        key = f"{i:064x}"
        d = entries / key[:2]
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        (d / f"{key}.kiln").write_bytes(b"x" * 64)
    os.chmod(root, 0o700)
    os.chmod(entries, 0o700)
    LocalStore(root).rebuild_index()


def _kiln_puts(root: Path, puts: int, blob: bytes) -> dict[str, float]:
    from kiln.stores import LocalStore

    store = LocalStore(root, max_size=1 << 40)
    store.get(f"{0:064x}")  # open it (the index, the checks) as a process's first read would
    times = []
    for i in range(puts):
        key = f"{(1 << 200) + i:064x}"
        t0 = time.perf_counter()
        store.put(key, blob)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    store.flush()
    return {"put_s": bench.median(times), "flush_s": time.perf_counter() - t0}


def _jax_puts(root: Path, n: int, puts: int, blob: bytes) -> dict[str, float]:
    from jax._src.lru_cache import LRUCache

    root.mkdir(parents=True)
    for i in range(n):
        (root / f"jit_f-{i:064x}-cache").write_bytes(b"x" * 64)
    cache = LRUCache(str(root), max_size=-1)
    times = []
    for i in range(puts):
        t0 = time.perf_counter()
        cache.put(f"jit_f-{(1 << 200) + i:064x}", blob)
        times.append(time.perf_counter() - t0)
    return {"put_s": bench.median(times)}


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--puts", type=int, default=200)
    parser.add_argument("--size", type=int, default=100_000)
    args = bench.begin(parser, argv)
    blob = os.urandom(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        def run(impl: str, rep: int) -> dict[str, float]:
            root = Path(tmp) / f"{impl}{rep}"
            try:
                if impl == "kiln":
                    _fill_kiln(root, args.entries)
                    return _kiln_puts(root, args.puts, blob)
                return _jax_puts(root, args.entries, args.puts, blob)
            finally:
                shutil.rmtree(root, ignore_errors=True)

        def shown(r: dict[str, Any]) -> str:
            flush = r.get("flush_s")
            return f"put {r['put_s'] * 1e3:.3f} ms" + (
                "" if flush is None else f", index flush of {args.puts} rows {flush * 1e3:.1f} ms")

        runs = bench.interleave(("kiln", "jax"), args.reps, run, rotate=False, show=shown)
    med = bench.medians(runs, "put_s")
    flush = bench.median(r["flush_s"] for r in runs["kiln"])
    print(f"median put at {args.entries} entries, {args.size} bytes: kiln {med['kiln'] * 1e3:.3f} "
          f"ms, JAX's cache {med['jax'] * 1e3:.3f} ms ({med['kiln'] / med['jax']:.2f}x); index "
          f"flush {flush * 1e3:.1f} ms per {args.puts} puts")
    bench.save(args, {
        "entries": args.entries, "puts": args.puts, "size_bytes": args.size,
        "median_put_s": {"kiln": med["kiln"], "jax_cache": med["jax"]}, "median_flush_s": flush,
        "per_rep": {"kiln_put_s": [r["put_s"] for r in runs["kiln"]],
                    "jax_cache_put_s": [r["put_s"] for r in runs["jax"]],
                    "flush_s": [r["flush_s"] for r in runs["kiln"]]}})
    return 0

if __name__ == "__main__":
    sys.exit(main())
