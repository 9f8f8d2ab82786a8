"""Benchmark: compile time vs number of call sites, and per-call runtime, of a noinline
sub-function: ``kiln.noinline`` vs plain ``jax.jit`` (inlined) vs ``equinox.internal.noinline``.

Run from the repository root (about 12 minutes; ``--quick`` for a noisy smoke test):

    python benchmarks/noinline.py [--quick] [--reps 7] [--json PATH]
    python benchmarks/noinline.py --per-site   # where the extra time per call site goes

The sub-function is a 20-layer tanh MLP step on float32[64]; the outer program calls it N times
in sequence (N = 1, 4, 16, 64). Each measurement runs in a fresh process with an empty kiln store
(so kiln's figure includes compiling the sub-function once); "compile" is the wall time of the
first call (trace + lower + compile + run), "run" the median per-call time of the compiled
outer program afterwards. Median of ``--reps`` (7) processes per point; each round runs every
mode and N once, so drift in machine load hits all points alike, and the N=64 / N=1 ratio is
also given per round (paired).
"""

from __future__ import annotations

import tempfile

import _harness as bench

WORKER = r'''
import json, sys, time
import jax, jax.numpy as jnp
mode, n = sys.argv[1], int(sys.argv[2])
import kiln
import equinox.internal as eqxi

def layer_stack(x, w):
    for i in range(20):
        x = jnp.tanh(x * w[i] + 0.1 * i)
    return x

if mode in ("kiln", "kiln-tier"):
    sub = kiln.noinline(layer_stack)
elif mode == "equinox":
    sub = eqxi.noinline(layer_stack)
else:
    sub = layer_stack

def outer(x, w):
    for _ in range(n):
        x = sub(x, w)
    return x

# kiln-tier: kiln.jit outer, so the inlined program compiles in the background (tier-up)
outer = kiln.jit(outer) if mode == "kiln-tier" else jax.jit(outer)


def median_run():
    runs = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(outer(x, w))
        runs.append(time.perf_counter() - t0)
    runs.sort()
    return runs[len(runs) // 2]


x, w = jnp.ones(64), jnp.full((20, 64), 0.5)
t_start = time.perf_counter()
jax.block_until_ready(outer(x, w))
first = time.perf_counter() - t_start
rec = {"first_s": first}
if mode == "kiln-tier":
    rec["before_s"] = median_run()  # runtime before tier-up (may race with it: see below)
    kiln.wait_for_tier_up()
    rec["tier_up_s"] = time.perf_counter() - t_start
    rec["tier_ups"] = kiln.stats().tier_ups
    # steady state against plain jax.jit in this same process, interleaved (runtimes of
    # separate processes differ by more than the effect measured)
    kiln_outer = outer

    def plain(x, w):
        for _ in range(n):
            x = layer_stack(x, w)
        return x

    jax_outer = jax.jit(plain)
    jax.block_until_ready(jax_outer(x, w))
    # one call of each in turn, the order swapped every pair, so drift and warm-up hit both
    kiln_runs, jax_runs = [], []
    for i in range(1000):
        pair = ((kiln_outer, kiln_runs), (jax_outer, jax_runs))
        for f, runs in pair if i % 2 else pair[::-1]:
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w))
            runs.append(time.perf_counter() - t0)
    kiln_runs.sort()
    jax_runs.sort()
    rec["jax_here_s"] = jax_runs[len(jax_runs) // 2]
    rec["run_s"] = kiln_runs[len(kiln_runs) // 2]
else:
    rec["run_s"] = median_run()
print(json.dumps(rec))
'''


PER_SITE = r'''
import json, statistics, sys, time
import jax, jax.numpy as jnp
import kiln

def layer_stack(x, w):
    for i in range(20):
        x = jnp.tanh(x * w[i] + 0.1 * i)
    return x

sub = kiln.noinline(layer_stack)

def program(n):
    def outer(x, w):
        for _ in range(n):
            x = sub(x, w)
        return x
    return jax.jit(outer)

x, w = jnp.ones(64), jnp.full((20, 64), 0.5)
program(1)(x, w).block_until_ready()  # the sub-function compiled: what is left is per site
times = {1: [], 64: []}
for _ in range(7):
    for n in (1, 64):
        f = program(n)
        t0 = time.perf_counter(); traced = f.trace(x, w)
        t1 = time.perf_counter(); lowered = traced.lower()
        t2 = time.perf_counter(); compiled = lowered.compile()
        t3 = time.perf_counter(); compiled(x, w).block_until_ready()
        t4 = time.perf_counter()
        times[n].append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
print(json.dumps({n: [statistics.median(c) for c in zip(*t)] for n, t in times.items()}))
'''


def per_site() -> None:
    """Where the extra time at 64 call sites goes: in one warm process (the sub-function
    already compiled), trace / lower / compile / first run of the N=1 and N=64 programs,
    median of 7, and the difference per extra call site."""
    with tempfile.TemporaryDirectory() as d:
        env = bench.child_env(KILN_CACHE_DIR=d)
        med = bench.fresh(["-c", PER_SITE], env=env, timeout=600).payload
    print("\nper call site, one warm process (sub-function compiled; median of 7), ms:")
    extra = [(b - a) / 63 for a, b in zip(med["1"], med["64"], strict=True)]
    rows = [["N=1", *med["1"]], ["N=64", *med["64"]], ["per extra site", *extra]]
    print(bench.table(["", "trace", "lower", "compile", "run 1"],
                      [[name, *(v * 1e3 for v in row)] for name, *row in rows]))
    print(f"all 63 extra sites: {sum(extra) * 63 * 1e3:.1f} ms")


def run_once(point: tuple[str, int], rep: int) -> dict[str, float]:
    """One fresh process with an empty store: the worker's record."""
    mode, n = point
    with tempfile.TemporaryDirectory() as d:
        return bench.fresh(["-c", WORKER, mode, str(n)], env=bench.child_env(KILN_CACHE_DIR=d),
                           timeout=600).record()


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=7, quick_reps=1)
    parser.add_argument("--per-site", action="store_true",
                        help="only the per-call-site breakdown (one warm process)")
    args = bench.begin(parser, argv)
    if args.per_site:
        per_site()
        return 0
    reps = args.reps
    sites = [1, 4, 16] if args.quick else [1, 4, 16, 64]
    modes = ("jax", "kiln", "equinox")
    # every mode and N in each round, so drift in machine load hits them all alike (a ratio
    # of two points measured minutes apart swung by 0.15 on this machine)
    points = [(m, n) for m in (*modes, "kiln-tier") for n in sites]
    runs = bench.interleave(points, reps, run_once, rotate=False,
                            label=lambda p: f"{p[0]:9s} N={p[1]:3d}",
                            show=lambda r: f"first call {r['first_s']:7.3f} s, "
                                           f"run {r['run_s'] * 1e6:9.1f} us")
    recs = {m: {n: runs[(m, n)] for n in sites} for m in (*modes, "kiln-tier")}
    results = {m: {n: (bench.median(r["first_s"] for r in recs[m][n]),
                       bench.median(r["run_s"] for r in recs[m][n])) for n in sites} for m in modes}
    print(f"\nmedian of {reps} fresh processes per point")
    print(bench.table(["N", "jax.jit first s", "kiln first s", "eqx first s", "jax run us",
                       "kiln run us", "eqx run us"],
                      [[n, *(results[m][n][0] for m in modes),
                        *(f"{results[m][n][1] * 1e6:.1f}" for m in modes)] for n in sites]))
    top = sites[-1]
    for mode in ("kiln", "equinox", "jax"):
        paired = bench.pair_ratios([r["first_s"] for r in recs[mode][top]],
                                   [r["first_s"] for r in recs[mode][1]])
        target = " (target <= 1.2x)" if mode == "kiln" else ""
        print(f"{mode} first call N={top} / N=1: "
              f"{results[mode][top][0] / results[mode][1][0]:.2f}x of medians{target};"
              f" per round {', '.join(f'{r:.2f}' for r in paired)}"
              f" (median {bench.median(paired):.2f}x)")
    kiln_rt = results["kiln"][top][1] / results["jax"][top][1]
    eqx_rt = results["equinox"][top][1] / results["jax"][top][1]
    print(f"runtime at N={top}: kiln / jax.jit {kiln_rt:.1f}x, equinox / jax.jit {eqx_rt:.1f}x")
    print("\ntier-up (kiln.jit outer calling the noinline function; first result not inlined,")
    print("inlined program compiled in the background, then swapped in; jax run, after: medians")
    print("in the kiln process after tier-up, interleaved):")
    tier: dict[int, dict[str, float]] = {}
    for n in sites:
        rs = recs["kiln-tier"][n]
        tier[n] = {f: bench.median(r[f] for r in rs)
                   for f in ("first_s", "tier_up_s", "before_s", "jax_here_s")}
        tier[n]["after_s"] = bench.median(r["run_s"] for r in rs)
        tier[n]["after_over_jax"] = bench.median(bench.pair_ratios(
            [r["run_s"] for r in rs], [r["jax_here_s"] for r in rs]))
    print(bench.table(["N", "first s", "ready s", "jax run us", "before us", "after us",
                       "before/jax", "after/jax"],
                      [[n, t["first_s"], t["tier_up_s"], f"{t['jax_here_s'] * 1e6:.1f}",
                        f"{t['before_s'] * 1e6:.1f}", f"{t['after_s'] * 1e6:.1f}",
                        f"{t['before_s'] / t['jax_here_s']:.1f}x", f"{t['after_over_jax']:.2f}x"]
                       for n, t in tier.items()]))
    print(f"steady state after tier-up at N={top}: {tier[top]['after_over_jax']:.2f}x jax.jit"
          " (median of per-process ratios; target <= 1.05x)")
    print("(N=1: kiln compiles the inlined program directly, with no callback tier: 'before'"
          " is already inlined)")
    bench.save(args, {"records": {m: {str(n): v for n, v in r.items()} for m, r in recs.items()},
                      "kiln-tier": {str(n): v for n, v in tier.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
