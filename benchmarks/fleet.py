"""Benchmark: a fleet of workers sharing one Redis store (single-flight), remote vs local hits,
and the local store's put / get at 10,000 entries against JAX's own cache directory.

Run from the repository root (about 8-10 minutes on a 2-core machine; needs ``redis-server`` on
PATH, redis-py and the ``examples`` extra; ``--quick`` is an end-to-end smoke test, ~3 minutes,
too few repetitions to quote):

    python benchmarks/fleet.py [--rounds 3] [--quick] [--json PATH]

One ``redis-server`` is started for the run (loopback, free port, no persistence) and stopped at
the end, also on Ctrl-C / SIGTERM; every store and cache lives in a temporary directory that is
removed; ``KILN_*``, ``JAX_*`` and ``XLA_*`` variables of the calling environment are dropped
(``_harness.py``). Workers run
``kiln_demo.lotka_volterra --jit kiln`` (the Lotka-Volterra fit) via ``runpy`` in fresh
processes with ``KILN_SIGNING_KEY`` set; each worker has its own empty local directory
(``KILN_CACHE_DIR``: a separate "host").

1. Fleet cold start (``--rounds`` rounds, default 3: each round is ~20 fresh cold processes, so
   fewer than the usual 5; the figures are medians over rounds). A round is, in this order:

   - lone: ONE cold worker (empty Redis db after ``FLUSHDB``, empty local dir);
   - shared: ``--workers`` (8) workers started together against ONE empty Redis db
     (``FLUSHDB`` first), each with its own empty local dir. Each imports jax / diffrax /
     optimistix / equinox / kiln, then touches a file in a barrier directory and waits until all
     8 are there, then runs the fit: the 8 misses of the same keys happen together;
   - no store: the same 8 workers without ``KILN_STORE`` (their own empty local dirs only),
     for reference: 8 compiles contending for the CPUs.

   Per worker: ``fit_s``, seconds from the barrier's release to the fit's first result (the
   example's own ``time_to_first_result_s``, measured from when runpy starts the module, so the
   imports done before the barrier are not in it), CPU seconds from the barrier on
   (``time.process_time()``, all threads), jax's own trace / lower / backend-compile seconds and
   counts (``jax.monitoring`` events; backend-compile also times JAX-cache loads of the eager
   operations), and ``kiln.stats()``. Reported per fleet: totals of ``compiles``, ``traces``,
   jax's backend-compile events, ``hits``, ``lease_waits``, ``remote_hits``, JAX-cache writes,
   trace and CPU seconds (all counters and per-worker figures in the JSON), and the slowest
   worker's ``fit_s``; ratios slowest-of-8 / lone cold (shared and no store). Target:
   total kiln compiles across the shared fleet == the lone worker's compiles, i.e. one
   compile per key. The fitted parameters must be identical in every worker.

2. Remote hit vs local hit. One cold worker fills the (flushed) Redis db; the fit's entry (the
   largest key in Redis, ~1.7 MB) is copied into a ``LocalStore``. In this process,
   ``store.get(key)`` + ``kiln._base.decode(blob, signing_key=...)`` from the ``LocalStore`` vs
   from the ``RedisStore`` (``open_store(config, layered=False)``), ``--reads`` (25) reads each,
   interleaved (order alternating), medians; ratio remote / local. End to end: a fresh worker
   with the Redis store warm and an EMPTY local dir (a remote hit, copied to its local dir) vs a
   fresh worker with the same layered settings whose local dir is warm (a local hit; Redis not
   read), ``--e2e-reps`` (5) each, interleaved; ``fit_s`` medians and ratio.

3. Store put / get at ``--entries`` (10,000) entries of ~4 KiB: kiln's ``LocalStore`` (blobs made
   with ``kiln._base.encode``, unsigned, 64-hex keys) vs JAX's persistent-cache directory class
   ``jax._src.lru_cache.LRUCache(path, max_size=-1)`` (no eviction) and ``max_size=1 GiB``
   (eviction bookkeeping: an atime file per entry, a file lock, and on every put a scan of the
   whole directory, stat + atime read per entry; nothing is evicted at 40 MB), keys like JAX's
   (``jit_f-<64 hex>``), values bytes of the same size. Each is filled to ``entries - ops``
   (9,000) entries once (the evicting JAX cache is filled with its scan switched off, which
   leaves the same files), then ``--blocks`` (5) blocks, the stores taking turns in rotating
   order. A block times ``--ops`` (1,000) puts of new keys, one by one (the store goes from 9,000
   to 10,000 entries), then ``--ops`` gets of keys drawn at random from the 10,000 (same draws
   for every store), then deletes the block's keys (untimed) to return to 9,000. The evicting
   JAX cache times only ``--evict-puts`` (10) puts per block: each put scans ~10,000 files,
   ~0.5-1 s. Reported: microseconds per put and per get (median over blocks of each block's
   mean; per-op medians in the JSON); ratios kiln / JAX. kiln's put writes a temp file, fsyncs
   it (durability), renames it and commits its SQLite index; JAX's writes the file (no fsync).
   Reported as is.

No target besides 1 per key (part 1): the rest are figures. ``--json PATH`` writes every raw
number. ``--parts 1,3`` runs some parts only; ``--no-reference`` skips the fleet without a
store (the longest step, ~1 minute a round); every count has its own option (``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness as bench

SIGNING_KEY = "fleet-benchmark-secret"
STAT_FIELDS = ("hits", "misses", "traces", "compiles", "remote_hits", "remote_misses",
               "remote_timeouts", "remote_errors", "lease_waits", "lease_takeovers",
               "jax_cache_hits", "jax_cache_misses", "jax_cache_writes", "store_errors",
               "bad_entries", "stores_written")
FLEET_TOTALS = ("compiles", "traces", "hits", "lease_waits", "lease_takeovers", "remote_hits",
                "remote_misses", "jax_cache_hits", "jax_cache_writes", "remote_errors",
                "remote_timeouts")

# A worker: imports first, then a file barrier (all N workers ready), then the fit.
CHILD = r'''
import time
T0 = time.perf_counter()
import contextlib, io, json, os, runpy, sys
from pathlib import Path
import numpy, jax, jax.numpy, equinox, diffrax, optimistix
import kiln

seconds, counts = {}, {}


def listener(event, duration, **kwargs):  # jax's own trace / lower / XLA compile events
    seconds[event] = seconds.get(event, 0.0) + duration
    counts[event] = counts.get(event, 0) + 1


jax.monitoring.register_event_duration_secs_listener(listener)

barrier, n = Path(sys.argv[1]), int(sys.argv[2])
(barrier / str(os.getpid())).touch()
deadline = time.monotonic() + 900
while len(os.listdir(barrier)) < n:
    if time.monotonic() > deadline:
        sys.exit("barrier: the other workers never arrived")
    time.sleep(0.01)
imports_s = time.perf_counter() - T0
released = time.time()
cpu0 = time.process_time()
sys.argv = ["lotka_volterra", "--jit", "kiln"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("kiln_demo.lotka_volterra", run_name="__main__")
    except SystemExit:
        pass
done = time.time()
cpu_s = time.process_time() - cpu0  # CPU seconds of all threads from the barrier to the result
result = json.loads(out.getvalue().strip().splitlines()[-1])
s = kiln.stats().as_dict()
phases = {}
for name, event in (("trace", "jaxpr_trace_duration"), ("lower", "jaxpr_to_mlir_module_duration"),
                    ("xla_compile", "backend_compile_duration")):
    phases[name + "_s"] = seconds.get("/jax/core/compile/" + event, 0.0)
    phases[name + "_n"] = counts.get("/jax/core/compile/" + event, 0)
print(json.dumps({"fit_s": result["time_to_first_result_s"], "imports_s": imports_s,
                  "released": released, "done": done, "cpu_s": cpu_s, "phases": phases,
                  "params": result["params"],
                  "stats": {k: v for k, v in s.items() if k != "reasons"},
                  "reasons": s["reasons"]}))
'''


# -- redis-server (as tests/servers.py starts it) -------------------------------------------------
def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port (no RDB, no AOF); yields
    ``redis://127.0.0.1:<port>/0``; stopped on exit (also on an exception or Ctrl-C)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("error: redis-server is not on PATH; this benchmark needs it")
    tmp.mkdir(parents=True, exist_ok=True)
    port = bench.free_port()
    log = tmp / "redis.log"
    with open(log, "wb") as out:
        proc = bench.start_child([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(tmp)],
                                 stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _pings(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: redis-server did not start:\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)


def flushdb(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# -- workers --------------------------------------------------------------------------------
def worker_env(cache_dir: Path, store: str | None) -> dict[str, str]:
    return bench.child_env(**bench.kiln_store(cache_dir), KILN_SIGNING_KEY=SIGNING_KEY,
                           JAX_PLATFORMS="cpu", KILN_STORE=store)


_live: list[subprocess.Popen[Any]] = []  # workers running now (killed on the way out)


def run_workers(n: int, root: Path, store: str | None,
                dirs: list[Path] | None = None) -> list[dict[str, Any]]:
    """``n`` workers released together by a barrier, each with its own local dir (fresh, empty
    ones under ``root`` unless ``dirs`` is given); their results in order."""
    root.mkdir(parents=True)
    barrier = root / "barrier"
    barrier.mkdir()
    if dirs is None:
        dirs = [root / f"host-{i}" for i in range(n)]
    procs = []
    try:
        for i in range(n):
            with open(root / f"out-{i}", "wb") as out_f, open(root / f"err-{i}", "wb") as err_f:
                p = bench.start_child([sys.executable, "-c", CHILD, str(barrier), str(n)],
                                      env=worker_env(dirs[i], store), stdin=subprocess.DEVNULL,
                                      stdout=out_f, stderr=err_f)
            procs.append(p)
            _live.append(p)
        results = []
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=1800)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"error: worker {i} ran past 1800 s") from None
            if rc != 0:
                err = (root / f"err-{i}").read_text(errors="replace")[-4000:]
                raise SystemExit(f"error: worker {i} exited {rc}\n{err}")
            lines = (root / f"out-{i}").read_text().strip().splitlines()
            r = json.loads(lines[-1])
            r["stderr_tail"] = (root / f"err-{i}").read_text(errors="replace")[-1000:]
            results.append(r)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            with contextlib.suppress(ValueError):
                _live.remove(p)


def fleet_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    totals = {k: sum(r["stats"][k] for r in results) for k in FLEET_TOTALS}
    fit = [r["fit_s"] for r in results]
    return {
        "workers": len(results),
        **{f"total_{k}": v for k, v in totals.items()},
        "slowest_fit_s": max(fit),
        "total_cpu_s": sum(r["cpu_s"] for r in results),
        "fastest_fit_s": min(fit),
        "makespan_s": max(r["done"] for r in results) - min(r["released"] for r in results),
        "per_worker_compiles": [r["stats"]["compiles"] for r in results],
        "per_worker_fit_s": fit,
        "per_worker_cpu_s": [r["cpu_s"] for r in results],
        "per_worker_stats": [r["stats"] for r in results],
        "per_worker_phases": [r["phases"] for r in results],
        **{f"total_{k}": sum(r["phases"][k] for r in results) for k in results[0]["phases"]},
    }


# -- part 1 ---------------------------------------------------------------------------------
def part_fleet(args: argparse.Namespace, tmp: Path, url: str) -> dict[str, Any]:
    def fleet(kind: str, i: int) -> dict[str, Any]:
        """One round's lone cold worker, shared fleet or fleet without a store."""
        root = tmp / f"r{i}-{kind}"
        try:
            if kind == "lone":
                flushdb(url)
                lone = run_workers(1, root, url)[0]
                return {"lone": {k: lone[k] for k in ("fit_s", "cpu_s", "imports_s", "stats",
                                                      "params", "reasons", "phases")}}
            if kind == "shared":
                flushdb(url)
            workers = run_workers(args.workers, root, url if kind == "shared" else None)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return {kind: fleet_summary(workers), f"{kind}_params": [r["params"] for r in workers],
                **({"shared_reasons": [r["reasons"] for r in workers]} if kind == "shared"
                   else {})}

    def shown(r: dict[str, Any]) -> str:
        if "lone" in r:
            lone = r["lone"]
            return (f"fit {lone['fit_s']:.2f} s, compiles {lone['stats']['compiles']}, "
                    f"JAX-cache writes {lone['stats']['jax_cache_writes']}")
        s = r.get("shared", r.get("no_store"))
        return (f"slowest {s['slowest_fit_s']:.2f} s, compiles {s['total_compiles']} "
                f"{s['per_worker_compiles']}, hits {s['total_hits']}, lease waits "
                f"{s['total_lease_waits']}, remote hits {s['total_remote_hits']}")

    kinds = ("lone", "shared") if args.no_reference else ("lone", "shared", "no_store")
    labels = {"lone": "lone cold worker", "shared": f"{args.workers} workers, one Redis",
              "no_store": f"{args.workers} workers, no shared store"}
    runs = bench.interleave(kinds, args.reps, fleet, rotate=False, show=shown,
                            label=labels.__getitem__)
    return {"rounds": [{k: v for kind in kinds for k, v in runs[kind][i].items()}
                       for i in range(args.reps)]}


# -- part 2 ---------------------------------------------------------------------------------
def part_remote(args: argparse.Namespace, tmp: Path, url: str) -> dict[str, Any]:
    import kiln
    from kiln._base import decode
    from kiln.stores import LocalStore, open_store

    flushdb(url)
    fill = run_workers(1, tmp / "p2-fill", url)[0]
    print(f"  filled Redis with one cold worker: fit {fill['fit_s']:.2f} s, compiles "
          f"{fill['stats']['compiles']}", flush=True)
    with kiln.config_context(store=url, signing_key=SIGNING_KEY):
        remote = open_store(kiln.get_config(), layered=False)
    keys = list(remote.iter())
    sizes = {k: len(remote.get(k) or b"") for k in keys}
    key = max(sizes, key=lambda k: sizes[k])
    blob = remote.get(key)
    assert blob is not None
    header = decode(blob, signing_key=SIGNING_KEY).header
    local = LocalStore(tmp / "p2-local", shared=True)
    local.put(key, blob)
    print(f"  entry {key[:12]} ({header.get('function')}, {len(blob)} bytes; {len(keys)} keys "
          f"in Redis)", flush=True)

    stores = {"local": local, "remote": remote}

    def read(name: str, _: int) -> dict[str, float]:
        t0 = time.perf_counter()
        got = stores[name].get(key)
        t1 = time.perf_counter()
        assert got is not None
        decode(got, signing_key=SIGNING_KEY)
        t2 = time.perf_counter()
        return {"get_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}

    # the first round is a warm-up, not kept
    reads = {n: rs[1:] for n, rs in bench.interleave(tuple(stores), args.reads + 1, read).items()}
    read_med = {n: {f: bench.median(r[f] for r in rows) for f in rows[0]}
                for n, rows in reads.items()}
    print(f"  in process, get + decode: local {read_med['local']['total_s'] * 1e3:.2f} ms, "
          f"Redis {read_med['remote']['total_s'] * 1e3:.2f} ms", flush=True)

    # end to end: a warm local dir (filled by one remote hit, untimed)
    warm_dir = tmp / "p2-warm-host"
    run_workers(1, tmp / "p2-warmup", url, dirs=[warm_dir])

    def e2e_run(mode: str, i: int) -> dict[str, Any]:
        root = tmp / f"p2-e2e-{i}-{mode.split()[0]}"
        r = run_workers(1, root, url, dirs=None if mode == "remote hit" else [warm_dir])[0]
        shutil.rmtree(root, ignore_errors=True)
        return {"fit_s": r["fit_s"], "stats": r["stats"], "params": r["params"]}

    e2e = bench.interleave(("remote hit", "local hit"), args.e2e_reps, e2e_run,
                           label=lambda m: f"e2e {m}",
                           show=lambda r: f"fit {r['fit_s']:.3f} s (compiles "
                                          f"{r['stats']['compiles']}, hits {r['stats']['hits']}, "
                                          f"remote hits {r['stats']['remote_hits']})")
    return {
        "key": key, "entry_bytes": len(blob), "function": header.get("function"),
        "redis_keys": len(keys), "reads": reads, "read_medians": read_med, "e2e": e2e,
        "fill": {"fit_s": fill["fit_s"], "stats": fill["stats"], "params": fill["params"]},
    }


# -- part 3 ---------------------------------------------------------------------------------
class _Kiln:
    name = "kiln LocalStore"

    def __init__(self, root: Path) -> None:
        from kiln.stores import LocalStore

        self.store = LocalStore(root)

    def key(self, i: int) -> str:
        return hashlib.sha256(f"entry-{i}".encode()).hexdigest()

    def value(self, key: str, size: int) -> bytes:
        from kiln._base import encode

        header = {"key": key, "function": "bench", "signature": "-"}
        probe = encode(header, {"exe": b""}, signing_key=None)
        return encode(header, {"exe": os.urandom(max(0, size - len(probe)))}, signing_key=None)

    def put(self, key: str, value: bytes) -> None:
        self.store.put(key, value)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    def delete(self, key: str) -> None:
        self.store.delete(key)


class _Jax:
    def __init__(self, root: Path, max_size: int) -> None:
        from jax._src.lru_cache import LRUCache

        self.root = root
        self.cache = LRUCache(str(root), max_size=max_size)
        self.name = ("JAX LRUCache max_size=-1" if max_size == -1 else
                     f"JAX LRUCache max_size={max_size / 2**30:g} GiB")

    def key(self, i: int) -> str:
        return "jit_f-" + hashlib.sha256(f"entry-{i}".encode()).hexdigest()

    def value(self, key: str, size: int) -> bytes:
        return os.urandom(size)

    def put(self, key: str, value: bytes) -> None:
        self.cache.put(key, value)

    def get(self, key: str) -> bytes | None:
        return self.cache.get(key)

    def delete(self, key: str) -> None:
        for suffix in ("-cache", "-atime"):
            with contextlib.suppress(FileNotFoundError):
                (self.root / f"{key}{suffix}").unlink()


def part_stores(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    n, ops, size = args.entries, args.ops, args.entry_size
    base = n - ops
    impls: list[Any] = [_Kiln(tmp / "p3-kiln"), _Jax(tmp / "p3-jax", -1),
                        _Jax(tmp / "p3-jax-evict", 2**30)]
    puts_per = {impl.name: (args.evict_puts if i == 2 else ops) for i, impl in enumerate(impls)}
    sizes = {}
    for impl in impls:
        t0 = time.perf_counter()
        fill = getattr(impl, "cache", None)
        if fill is not None and fill.eviction_enabled:
            fill._evict_if_needed = lambda **kw: None  # the same files, without the O(n) scans
        for i in range(base):
            k = impl.key(i)
            impl.put(k, impl.value(k, size))
        if fill is not None:
            fill.__dict__.pop("_evict_if_needed", None)
        sizes[impl.name] = len(impl.value(impl.key(0), size))
        print(f"  filled {impl.name} with {base} entries of {sizes[impl.name]} B in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)

    rng = random.Random(20240611)
    news = [range(base + b * ops, base + (b + 1) * ops) for b in range(args.blocks)]  # fresh keys
    draws = [[rng.choice([*range(base), *new]) for _ in range(ops)] for new in news]
    by_name = {impl.name: impl for impl in impls}

    def block(name: str, b: int) -> dict[str, Any]:
        impl, m = by_name[name], puts_per[name]
        keys = [impl.key(i) for i in news[b]]
        values = [impl.value(k, size) for k in keys]  # made before timing
        # the evicting cache times only m puts; the rest are put without the scan
        put_t = []
        for k, v in zip(keys[:m], values[:m], strict=True):
            t0 = time.perf_counter()
            impl.put(k, v)
            put_t.append(time.perf_counter() - t0)
        cache = getattr(impl, "cache", None)
        if m < ops and cache is not None:
            cache._evict_if_needed = lambda **kw: None
            for k, v in zip(keys[m:], values[m:], strict=True):
                impl.put(k, v)
            cache.__dict__.pop("_evict_if_needed", None)
        get_t = []
        for i in draws[b]:
            k = impl.key(i)
            t0 = time.perf_counter()
            got = impl.get(k)
            get_t.append(time.perf_counter() - t0)
            if got is None:
                raise SystemExit(f"error: {impl.name} lost key {k}")
        for k in keys:
            impl.delete(k)
        return {"puts": len(put_t), "put_us_mean": statistics.fmean(put_t) * 1e6,
                "put_us_median": bench.median(put_t) * 1e6,
                "gets": len(get_t), "get_us_mean": statistics.fmean(get_t) * 1e6,
                "get_us_median": bench.median(get_t) * 1e6}

    blocks = bench.interleave(list(by_name), args.blocks, block, label=lambda n: f"{n:<28}",
                              show=lambda r: f"put {r['put_us_mean']:>10.1f} us ({r['puts']}), "
                                             f"get {r['get_us_mean']:>8.1f} us ({r['gets']})")
    summary = {name: {f: bench.median(r[f] for r in rows) for f in rows[0]}
               for name, rows in blocks.items()}
    return {"entries": n, "ops": ops, "entry_bytes": sizes, "blocks": blocks,
            "summary": summary, "names": [impl.name for impl in impls]}


# -- report ---------------------------------------------------------------------------------
def report(res: dict[str, Any], args: argparse.Namespace) -> tuple[list[str], bool]:
    notes: list[str] = []
    ok = True
    out: dict[str, Any] = {}
    res["ratios"] = out
    fl = res.get("fleet")
    params: list[Any] = []
    if fl:
        rounds = fl["rounds"]
        med = bench.median
        lone = med(r["lone"]["fit_s"] for r in rounds)
        print()
        print(f"1. Fleet cold start, Lotka-Volterra fit, {args.workers} workers, medians of "
              f"{len(rounds)} round(s) (fit = barrier release to first result)")
        cols = (("compiles", "compiles", "{:>9g}"), ("traces", "traces", "{:>7g}"),
                ("xla_compile_n", "jax comp.", "{:>10g}"), ("hits", "hits", "{:>5g}"),
                ("lease_waits", "lease w.", "{:>9g}"), ("remote_hits", "rem. hits", "{:>10g}"),
                ("jax_cache_writes", "JAXc wr.", "{:>9g}"), ("trace_s", "trace s", "{:>8.1f}"),
                ("cpu_s", "CPU s", "{:>7.1f}"))

        def lone_val(r: dict[str, Any], k: str) -> float:
            lo = r["lone"]
            return float(lo["cpu_s"] if k == "cpu_s" else lo["phases"][k]
                         if k in lo["phases"] else lo["stats"][k])

        print(f"{'(sums over workers)':<30}{'slowest fit':>12}"
              + "".join(f"{h:>{len(fmt.format(0))}}" for _, h, fmt in cols))
        print(f"{'lone cold worker':<30}{lone:>10.2f} s" + "".join(
            fmt.format(med(lone_val(r, k) for r in rounds)) for k, _, fmt in cols))
        kinds = [("shared", f"{args.workers} workers, one Redis")]
        if all("no_store" in r for r in rounds):
            kinds.append(("no_store", f"{args.workers} workers, no shared store"))
        for kind, label in kinds:
            print(f"{label:<30}{med(r[kind]['slowest_fit_s'] for r in rounds):>10.2f} s" + "".join(
                fmt.format(med(r[kind][f"total_{k}"] for r in rounds)) for k, _, fmt in cols))
        print("(fit: barrier release to first result; jax comp.: jax's backend_compile events, "
              "which also time JAX-cache loads of the eager operations; trace s: jax's trace "
              "seconds; CPU s: from the barrier)")
        per_round = [(r["shared"]["total_compiles"], r["lone"]["stats"]["compiles"])
                     for r in rounds]
        met = all(c == lc for c, lc in per_round)
        ok &= met
        out["shared_slowest_over_lone"] = med(r["shared"]["slowest_fit_s"] for r in rounds) / lone
        print(f"slowest of {args.workers} (one Redis) / lone cold: "
              f"{out['shared_slowest_over_lone']:.2f}x")
        if len(kinds) > 1:
            out["no_store_slowest_over_lone"] = med(
                r["no_store"]["slowest_fit_s"] for r in rounds) / lone
            out["shared_slowest_over_no_store_slowest"] = (
                out["shared_slowest_over_lone"] / out["no_store_slowest_over_lone"])
            print(f"slowest of {args.workers} (no shared store) / lone cold: "
                  f"{out['no_store_slowest_over_lone']:.2f}x; one Redis / no shared store "
                  f"(slowest): {out['shared_slowest_over_no_store_slowest']:.2f}x")
        print(f"target: total compiles across the {args.workers} == the lone worker's (1 per "
              f"key): {'met' if met else 'NOT met'} in every round (shared fleet, lone) = "
              + ", ".join(f"({c}, {lc})" for c, lc in per_round))
        for i, r in enumerate(rounds):
            s = r["shared"]
            if s["total_compiles"] != r["lone"]["stats"]["compiles"]:
                notes.append(f"round {i + 1}: the shared fleet compiled {s['total_compiles']} "
                             f"times (per worker {s['per_worker_compiles']}), the lone worker "
                             f"{r['lone']['stats']['compiles']}; lease waits "
                             f"{s['total_lease_waits']}, takeovers {s['total_lease_takeovers']}"
                             f", remote errors {s['total_remote_errors']}, timeouts "
                             f"{s['total_remote_timeouts']}; miss reasons "
                             f"{r['shared_reasons']}")
            if s["total_traces"] > r["lone"]["stats"]["traces"]:
                trace_s = [round(p["trace_s"], 1) for p in s["per_worker_phases"]]
                notes.append(f"round {i + 1}: the shared fleet traced {s['total_traces']} times "
                             f"for {s['total_compiles']} compile(s) (lone worker: "
                             f"{r['lone']['stats']['traces']}); jax's trace seconds per worker "
                             f"{trace_s}, compiles per worker {s['per_worker_compiles']}")
            if s["total_remote_errors"] or s["total_remote_timeouts"]:
                notes.append(f"round {i + 1}: remote errors {s['total_remote_errors']}, "
                             f"timeouts {s['total_remote_timeouts']} in the shared fleet")
            params += [r["lone"]["params"], *r["shared_params"], *r.get("no_store_params", [])]
    rm = res.get("remote")
    if rm:
        rmed = rm["read_medians"]
        out["read_remote_over_local"] = rmed["remote"]["total_s"] / rmed["local"]["total_s"]
        print()
        print(f"2. Remote hit vs local hit, the fit's entry ({rm['entry_bytes']} bytes), "
              f"medians of {len(rm['reads']['local'])} reads / {len(rm['e2e']['local hit'])} "
              "processes")
        print(f"{'':<34}{'get':>10}{'decode':>10}{'total':>10}")
        for name, label in (("local", "LocalStore.get + decode"),
                            ("remote", "RedisStore.get + decode")):
            m = rmed[name]
            print(f"{label:<34}{m['get_s'] * 1e3:>7.2f} ms{m['decode_s'] * 1e3:>7.2f} ms"
                  f"{m['total_s'] * 1e3:>7.2f} ms")
        print(f"remote / local (get + decode): {out['read_remote_over_local']:.2f}x")
        e2e = {m: bench.median(r["fit_s"] for r in rows) for m, rows in rm["e2e"].items()}
        out["e2e_remote_over_local"] = e2e["remote hit"] / e2e["local hit"]
        print(f"fresh process, fit to first result: remote hit (empty local dir) "
              f"{e2e['remote hit']:.3f} s, local hit {e2e['local hit']:.3f} s; remote / local "
              f"{out['e2e_remote_over_local']:.2f}x")
        for mode, rows in rm["e2e"].items():
            for r in rows:
                s = r["stats"]
                pure = s["compiles"] == 0 and s["hits"] >= 1 and (
                    s["remote_hits"] >= 1 if mode == "remote hit" else s["remote_hits"] == 0)
                if not pure:
                    notes.append(f"e2e {mode}: not a pure {mode}: compiles {s['compiles']}, "
                                 f"hits {s['hits']}, remote hits {s['remote_hits']}")
            params += [r["params"] for r in rows]
        params.append(rm["fill"]["params"])
    st = res.get("stores")
    if st:
        sm = st["summary"]
        kname, *jnames = st["names"]
        print()
        print(f"3. Store put / get at {st['entries']} entries (~{args.entry_size} B each), "
              f"median of {args.blocks} blocks (each block: mean over its ops)")
        print(f"{'':<30}{'puts/block':>11}{'us per put':>12}{'gets/block':>11}{'us per get':>12}")
        for name in st["names"]:
            m = sm[name]
            print(f"{name:<30}{int(m['puts']):>11}{m['put_us_mean']:>12.1f}{int(m['gets']):>11}"
                  f"{m['get_us_mean']:>12.1f}")
        for j in jnames:
            r_put = sm[kname]["put_us_mean"] / sm[j]["put_us_mean"]
            r_get = sm[kname]["get_us_mean"] / sm[j]["get_us_mean"]
            out[f"kiln / {j}"] = {"put": r_put, "get": r_get}
            print(f"kiln / {j}: put {r_put:.3g}x, get {r_get:.3g}x")
        print("(kiln's put writes the entry's file and records its index row with the next "
              "batch; JAX's writes the file. The evicting JAX cache scans the whole "
              "directory on every put.)")
    if params:
        same = len({json.dumps(p, sort_keys=True) for p in params}) == 1
        res["params_identical"] = same
        print(f"\nfitted parameters identical in all {len(params)} workers: {same}")
        if not same:
            ok = False
            notes.append("PARAMS DIFFER: " + "; ".join(
                sorted({json.dumps(p, sort_keys=True) for p in params})))
    return notes, ok


def main(argv: list[str] | None = None) -> int:
    # --rounds: fleet rounds, each ~2 minutes on 2 cores; --quick: 1 round, 1,000 entries, few
    # reads
    parser = bench.options(__doc__, reps=3, quick_reps=1, aliases=("--rounds",))
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the fleet without a shared store")
    parser.add_argument("--reads", type=int, default=None, help="in-process reads (default 25)")
    parser.add_argument("--e2e-reps", type=int, default=None,
                        help="fresh processes per hit kind (default 5)")
    parser.add_argument("--entries", type=int, default=None, help="store size (default 10000)")
    parser.add_argument("--ops", type=int, default=None,
                        help="timed puts and gets per block (default 1000)")
    parser.add_argument("--evict-puts", type=int, default=None,
                        help="timed puts per block for JAX's evicting cache (default 10)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks (default 5)")
    parser.add_argument("--entry-size", type=int, default=4096)
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    args = bench.begin(parser, argv, dists=("jax", "jaxlib", "jax-kiln", "diffrax", "equinox",
                                            "redis"))
    q = args.quick
    for name, full, quick in (("reads", 25, 5), ("e2e_reps", 5, 1),
                              ("entries", 10_000, 1_000), ("ops", 1_000, 100),
                              ("evict_puts", 10, 3), ("blocks", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"1", "2", "3"}:
        parser.error("--parts: a comma-separated subset of 1,2,3")
    if min(args.workers, args.reads, args.e2e_reps, args.blocks,
           args.evict_puts) < 1 or not 1 <= args.ops < args.entries:
        parser.error("counts must be >= 1 and --ops < --entries")
    args.evict_puts = min(args.evict_puts, args.ops)

    print(f"rounds {args.reps} x (1 lone + {args.workers} shared"
          + ("" if args.no_reference else f" + {args.workers} without a store")
          + f" workers); reads {args.reads}; e2e reps {args.e2e_reps}; entries {args.entries}, "
          f"ops {args.ops}, evicting puts {args.evict_puts}, blocks {args.blocks}", flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    res: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                    for k, v in vars(args).items()}}
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-fleet-") as tmp_name:
            tmp = Path(tmp_name)
            if parts & {"1", "2"}:
                with redis_server(tmp / "redis") as url:
                    print(f"redis-server at {url}", flush=True)
                    if "1" in parts:
                        print("\n1. fleet cold start", flush=True)
                        res["fleet"] = part_fleet(args, tmp, url)
                    if "2" in parts:
                        print("\n2. remote hit vs local hit", flush=True)
                        res["remote"] = part_remote(args, tmp, url)
            if "3" in parts:
                print("\n3. store put / get", flush=True)
                res["stores"] = part_stores(args, tmp)
    except KeyboardInterrupt:
        print("\ninterrupted: workers, redis-server and temporary directories cleaned up",
              file=sys.stderr)
        return 130
    finally:
        for p in list(_live):
            if p.poll() is None:
                p.kill()
                p.wait()
    res["seconds"] = time.perf_counter() - t_start
    notes, ok = report(res, args)
    for note in notes:
        print(f"note: {note}")
    print(f"total time {res['seconds']:.0f} s")
    res["notes"] = notes
    bench.save(args, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
