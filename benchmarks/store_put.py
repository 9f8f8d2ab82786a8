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

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


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


def _kiln_puts(root: Path, puts: int, blob: bytes) -> tuple[float, float]:
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
    return statistics.median(times), time.perf_counter() - t0


def _jax_puts(root: Path, n: int, puts: int, blob: bytes) -> float:
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
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--puts", type=int, default=200)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    blob = os.urandom(args.size)
    kiln_t, jax_t, flush_t = [], [], []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            _fill_kiln(Path(tmp) / "kiln", args.entries)
            k, f = _kiln_puts(Path(tmp) / "kiln", args.puts, blob)
            j = _jax_puts(Path(tmp) / "jax", args.entries, args.puts, blob)
        kiln_t.append(k)
        jax_t.append(j)
        flush_t.append(f)
        print(f"rep {rep}: kiln put {k * 1e3:.3f} ms, JAX cache put {j * 1e3:.3f} ms, "
              f"kiln index flush of {args.puts} rows {f * 1e3:.1f} ms", flush=True)
    k, j = statistics.median(kiln_t), statistics.median(jax_t)
    print(f"median put at {args.entries} entries, {args.size} bytes: kiln {k * 1e3:.3f} ms, "
          f"JAX's cache {j * 1e3:.3f} ms ({k / j:.2f}x); index flush "
          f"{statistics.median(flush_t) * 1e3:.1f} ms per {args.puts} puts")
    if args.json:
        args.json.write_text(json.dumps({
            "entries": args.entries, "puts": args.puts, "size_bytes": args.size,
            "reps": args.reps, "median_put_s": {"kiln": k, "jax_cache": j},
            "median_flush_s": statistics.median(flush_t),
            "per_rep": {"kiln_put_s": kiln_t, "jax_cache_put_s": jax_t, "flush_s": flush_t}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
