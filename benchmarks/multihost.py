"""Benchmark: a data-parallel training step in a multi-process job (targets:
kiln cold, one compile per job; kiln warm <= 0.3x JAX's cache warm).

Run from the repository root (about 4 minutes):

    python benchmarks/multihost.py [--reps 5] [--procs 2] [--devices 2] [--json PATH]

A ``jax.distributed`` job on loopback (gloo CPU collectives), ``--procs`` processes with
``--devices`` host devices each, trains a 64-256-256-10 MLP on scikit-learn's digits with
optax adam, the batch sharded over a global 1-D mesh. Per mode, the job's time to its first
step is the *slowest* process's (from interpreter start to the first loss on the host), and
the job's compile count is summed over its processes. The first call's own seconds (trace,
lower, compile or load, run) are reported beside it: the job's start (imports, the
distributed runtime, data) is the same in every mode and dominates on 2 CPU cores:

- ``jax``: plain ``jax.jit`` (compiles in every process);
- ``jax_cache_warm``: JAX's persistent cache, one directory shared by the job, filled first;
- ``share_binary`` (only with ``--share-binary``): ``jax_share_binary_between_hosts`` (one
  process compiles, the binary goes to the others through JAX's distributed key-value store).
  On CPU with jax 0.10.2 this job hung (no first step after 300 s), so it is off by default;
- ``kiln_cold``: ``kiln.jit`` on an empty store shared by the job (one compile per job);
- ``kiln_warm``: ``kiln.jit`` again on that store.

Medians of ``--reps`` jobs per mode, modes interleaved. Targets: kiln cold, one
compile per job; kiln warm <= 0.3x JAX's cache warm (the first call's seconds).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as bench

REPO = Path(__file__).resolve().parent.parent

JOB = r'''
import time
T0 = time.perf_counter()
import json, os, sys
pid, nproc, port, ndev, mode = sys.argv[1:6]
pid, nproc, ndev = int(pid), int(nproc), int(ndev)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if mode == "share_binary":
    jax.config.update("jax_share_binary_between_hosts", True)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from sklearn.datasets import load_digits

if mode.startswith("kiln"):
    import kiln
    jit = kiln.jit
else:
    jit = jax.jit

digits = load_digits()
n = nproc * ndev
per = (len(digits.target) // n // 8) * 8 * ndev  # this process's rows
xs = (digits.data / 16.0).astype(np.float32)[pid * per:(pid + 1) * per]
ys = digits.target.astype(np.int32)[pid * per:(pid + 1) * per]
mesh = jax.make_mesh((n,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("batch"))
x = jax.make_array_from_process_local_data(rows, xs)
y = jax.make_array_from_process_local_data(rows, ys)
sizes = (64, 256, 256, 10)
keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
params = [{"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
opt = optax.adam(1e-3)
state = opt.init(params)


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jit
def train_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


compiles, cache_hits = [], []
COMPILE = "/jax/core/compile/backend_compile_duration"
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **k: compiles.append(d) if e == COMPILE else None)
jax.monitoring.register_event_listener(
    lambda e, **k: cache_hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
T1 = time.perf_counter()
n_compiles, n_hits = len(compiles), len(cache_hits)
params, state, loss = train_step(params, state, x, y)
loss = float(loss)
first = time.perf_counter() - T0
# the step's XLA compiles (JAX reports a compile event for a persistent-cache hit too)
out = {"pid": pid, "first_step_s": first, "step_s": time.perf_counter() - T1, "loss": loss,
       "xla_compiles": (len(compiles) - n_compiles) - (len(cache_hits) - n_hits)}
if mode.startswith("kiln"):
    s = kiln.stats()
    out.update(kiln_compiles=s.compiles, hits=s.hits, traces=s.traces)
print("JOB " + json.dumps(out), flush=True)
jax.distributed.shutdown()
'''

MODES = ("jax", "jax_cache_warm", "share_binary", "kiln_cold", "kiln_warm")


def run_job(script: Path, mode: str, procs: int, devices: int,
            env: dict[str, str]) -> dict[str, Any]:
    port = str(bench.free_port())
    ps = [bench.start_child([sys.executable, script, str(i), str(procs), port, str(devices), mode],
                            env=env) for i in range(procs)]
    reports = []
    for p in ps:
        stdout, stderr = p.communicate(timeout=600)
        report = bench.last_json(stdout, "JOB ")
        if p.returncode != 0 or report is None:
            raise SystemExit(f"error: {mode} job exited {p.returncode}\n{stderr[-3000:]}")
        reports.append(report)
    losses = {r["loss"] for r in reports}
    return {
        "first_step_s": max(r["first_step_s"] for r in reports),
        "step_s": max(r["step_s"] for r in reports),
        "loss": reports[0]["loss"],
        "losses_agree": len(losses) == 1,
        "compiles": sum(r.get("kiln_compiles", r["xla_compiles"]) for r in reports),
        "xla_compiles": sum(r["xla_compiles"] for r in reports),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=5)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--share-binary", action="store_true",
                        help="also time jax_share_binary_between_hosts (hung on CPU, jax 0.10.2)")
    args = bench.begin(parser, argv)
    modes = [m for m in MODES if args.share_binary or m != "share_binary"]
    base = bench.child_env(JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        jax_env = base | bench.jax_cache(Path(tmp) / "jax-cache") | {"KILN_JAX_CACHE": "0"}
        plain_env = base | {"KILN_JAX_CACHE": "0"}

        def job(mode: str, rep: int) -> dict[str, Any]:
            # kiln as installed: its kiln:// route keeps the job's other programs (eager
            # operations after the first kiln.jit) in the same store, one per repetition
            kiln_env = base | bench.kiln_store(Path(tmp) / f"store{rep}")
            env = {"jax": plain_env, "jax_cache_warm": jax_env, "share_binary": plain_env}
            return run_job(script, mode, args.procs, args.devices, env.get(mode, kiln_env))

        run_job(script, "jax", args.procs, args.devices, jax_env)  # fill JAX's cache (untimed)
        # (in order: kiln_warm reads the store kiln_cold filled)
        rows = bench.interleave(modes, args.reps, job, rotate=False,
                                show=lambda r: f"first step {r['first_step_s']:.2f} s, "
                                               f"compiles {r['compiles']}")
    med = bench.medians(rows, "first_step_s")
    step = bench.medians(rows, "step_s")
    out = {"median_first_step_s": med, "median_step_s": step, "runs": rows,
           "kiln_warm_over_jax_cache_warm": med["kiln_warm"] / med["jax_cache_warm"],
           "step_kiln_warm_over_jax_cache_warm": step["kiln_warm"] / step["jax_cache_warm"]}
    print(bench.table(
        ["mode", "first step s (slowest, from start)", "first call s", "compiles per job",
         "losses agree", "loss"],
        [[m, med[m], step[m], [r["compiles"] for r in rows[m]],
          all(r["losses_agree"] for r in rows[m]), f"{rows[m][0]['loss']:.6f}"] for m in modes]))
    print(f"kiln warm / JAX cache warm: {out['kiln_warm_over_jax_cache_warm']:.3f}x from start, "
          f"{out['step_kiln_warm_over_jax_cache_warm']:.3f}x for the first call; kiln cold / "
          f"jax.jit: {med['kiln_cold'] / med['jax']:.3f}x", flush=True)
    bench.save(args, out)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
