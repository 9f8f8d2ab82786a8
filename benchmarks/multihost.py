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

import argparse
import json
import shlex
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _children import child_env, start_child

REPO = Path(__file__).resolve().parent.parent

JOB = r'''
import time
T0 = time.perf_counter()
import json, os, sys
pid, nproc, port, ndev, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
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
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **k: compiles.append(d) if e == "/jax/core/compile/backend_compile_duration" else None)
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



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: Path, mode: str, procs: int, devices: int, env: dict[str, str]) -> dict[str, Any]:
    port = str(_free_port())
    ps = [start_child([sys.executable, script, str(i), str(procs), port, str(devices), mode],
                      env=env) for i in range(procs)]
    reports = []
    for p in ps:
        stdout, stderr = p.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("JOB ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"error: {mode} job exited {p.returncode}\n{stderr[-3000:]}")
        reports.append(json.loads(lines[-1][4:]))
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--share-binary", action="store_true",
                        help="also time jax_share_binary_between_hosts (hung on CPU, jax 0.10.2)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    modes = [m for m in MODES if args.share_binary or m != "share_binary"]
    base = child_env(JAX_PLATFORMS="cpu")
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        jax_cache = Path(tmp) / "jax-cache"
        jax_env = base | {"JAX_COMPILATION_CACHE_DIR": str(jax_cache),
                          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                          "KILN_JAX_CACHE": "0"}
        run_job(script, "jax", args.procs, args.devices, jax_env)  # fill JAX's cache (untimed)
        for rep in range(args.reps):
            store = Path(tmp) / f"store{rep}"
            # kiln as installed: its kiln:// route keeps the job's other programs (eager
            # operations after the first kiln.jit) in the same store
            kiln_env = base | {"KILN_CACHE_DIR": str(store), "KILN_PROGRESS": "0"}
            plain_env = base | {"KILN_JAX_CACHE": "0"}
            for mode, env in (("jax", plain_env), ("jax_cache_warm", jax_env),
                              ("share_binary", plain_env), ("kiln_cold", kiln_env),
                              ("kiln_warm", kiln_env)):
                if mode not in rows:
                    continue
                rows[mode].append(run_job(script, mode, args.procs, args.devices, env))
    med = {m: statistics.median(r["first_step_s"] for r in rows[m]) for m in modes}
    step = {m: statistics.median(r["step_s"] for r in rows[m]) for m in modes}
    out = {"median_first_step_s": med, "median_step_s": step, "runs": rows,
           "kiln_warm_over_jax_cache_warm": med["kiln_warm"] / med["jax_cache_warm"],
           "step_kiln_warm_over_jax_cache_warm": step["kiln_warm"] / step["jax_cache_warm"]}
    for m in modes:
        compiles = [r["compiles"] for r in rows[m]]
        agree = all(r["losses_agree"] for r in rows[m])
        print(f"{m:15s} first step (slowest process) {med[m]:.2f} s from start, "
              f"{step[m]:.3f} s for the call; compiles per job {compiles}; losses agree across "
              f"processes: {agree}; loss {rows[m][0]['loss']:.6f}", flush=True)
    print(f"kiln warm / JAX cache warm: {out['kiln_warm_over_jax_cache_warm']:.3f}x from start, "
          f"{out['step_kiln_warm_over_jax_cache_warm']:.3f}x for the first call; kiln cold / "
          f"jax.jit: {med['kiln_cold'] / med['jax']:.3f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
