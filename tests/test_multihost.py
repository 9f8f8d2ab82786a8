"""Multi-process jobs (``jax.distributed`` on loopback, gloo CPU collectives), cold and warm.

Every process of a job runs the same program on its own devices (as on TPU pods and multi-node
GPU clusters). With one store shared by the job (a directory here; Redis and S3 share the same
single-flight code), the job compiles each program once: one process takes the key's lease and
compiles, the others wait and load the entry, each onto its own local devices. Warm, no process
traces or compiles. Values and output shardings equal ``jax.jit``'s in every process.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kiln_test_children import child_env, start_child

pytestmark = pytest.mark.slow

JOB = r'''
import json, os, sys
pid, nproc, port, ndev = (int(a) for a in sys.argv[1:5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=120)
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import kiln

# eager work on this process's own device before any kiln.jit (drawing data): programs of this
# process alone, under keys of their own (JAX's cache writes process 0's only)
s0 = kiln.stats()
noise = jax.random.normal(jax.random.key(pid), (4,)) * 0.1 + pid
eager = {"misses": kiln.stats().jax_cache_misses - s0.jax_cache_misses,
         "hits": kiln.stats().jax_cache_hits - s0.jax_cache_hits, "value": noise.tolist()}

n = nproc * ndev
mesh = jax.make_mesh((n,), ("d",))
row = NamedSharding(mesh, P("d"))
local = (np.arange(2 * ndev, dtype=np.float32) + pid * 2 * ndev)
x = jax.make_array_from_process_local_data(row, local)


def tanh_sum(x):
    return jnp.tanh(x * 2.0).sum()


def psum_map(x):
    return jax.shard_map(lambda b: jax.lax.psum(b.sum(), "d") * jnp.ones_like(b),
                         mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)


def gather(x):
    return jax.shard_map(lambda b: jax.lax.all_gather(b, "d", tiled=True)[:2] + b[:1],
                         mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)


def shift(x):
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.shard_map(lambda b: jax.lax.ppermute(b, "d", perm),
                         mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)


def constrained(x):
    return jax.lax.with_sharding_constraint(x * 3.0, NamedSharding(mesh, P()))


w = jnp.full((2 * n,), 0.5)  # uncommitted: on this process's default device


def mixed(x, w):
    return x * w + 1.0


CASES = {
    "tanh_sum": (tanh_sum, {}),
    "psum_map": (psum_map, {}),
    "gather": (gather, {}),
    "shift": (shift, {}),
    "constrained": (constrained, {}),
    "out_shardings": (lambda x: x + 1.0, {"out_shardings": NamedSharding(mesh, P())}),
    "donated": (lambda x: x * 2.0, {"donate_argnums": 0}),
}
out = {}
def callback(x):
    s = x.sum()
    return jax.pure_callback(lambda v: np.asarray(v * 2, np.float32),
                             jax.ShapeDtypeStruct((), jnp.float32), s)


sub = kiln.noinline(lambda b: jnp.sin(b) * 2.0)


def noinline_in_shard_map(x):
    return jax.shard_map(lambda b: jax.lax.psum(sub(b), "d"), mesh=mesh, in_specs=P("d"),
                         out_specs=P("d"))(x)


amesh = jax.make_mesh((n,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))


def with_mesh(x):
    with amesh:
        return jax.lax.with_sharding_constraint(x * 3.0, P())


emesh = jax.make_mesh((n,), ("e",), axis_types=(jax.sharding.AxisType.Explicit,))


def set_mesh_explicit(x):  # (called with an array on emesh; jax.set_mesh around the call)
    return (x * 2.0).sum()


CASES["in_shardings"] = (lambda x: x * 4.0, {"in_shardings": row})
CASES["callback"] = (callback, {"out_shardings": NamedSharding(mesh, P())})
CASES["noinline_in_shard_map"] = (noinline_in_shard_map, {})
CASES["with_mesh"] = (with_mesh, {})
try:
    from jax.experimental.shard_map import shard_map as old_shard_map

    CASES["old_shard_map"] = (lambda x: old_shard_map(
        lambda b: jax.lax.psum(b, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x), {})
except ImportError:  # (removed in newer jax)
    pass
CASES["mixed"] = (mixed, {})  # a sharded argument and an uncommitted one: one program
CASES["local_only"] = (lambda a: a * 2.0 + 1.0, {})  # no committed argument: per process


def args_of(name):
    if name == "donated":
        return (jax.make_array_from_process_local_data(row, local),)
    if name == "mixed":
        return (x, w)
    if name == "local_only":
        return (jnp.arange(3.0),)
    if name == "set_mesh_explicit":
        return (jax.make_array_from_process_local_data(NamedSharding(emesh, P("e")), local),)
    if name == "with_mesh":
        return (jax.make_array_from_process_local_data(NamedSharding(amesh, P("a")), local),)
    return (x,)


def host(a):
    if a.is_fully_addressable:
        return np.asarray(a).tolist()
    return multihost_utils.process_allgather(a, tiled=True).tolist()


if hasattr(jax, "set_mesh"):
    CASES["set_mesh_explicit"] = (set_mesh_explicit, {})


def in_context(name, thunk):
    if name != "set_mesh_explicit":
        return thunk()
    with jax.set_mesh(emesh):
        return thunk()


for name, (fn, opts) in CASES.items():
    ref = in_context(name, lambda: jax.jit(fn, **opts)(*args_of(name)))
    s0 = kiln.stats()
    got = in_context(name, lambda: kiln.jit(fn, **opts)(*args_of(name)))
    s1 = kiln.stats()
    out[name] = {
        "value": host(got), "ref": host(ref),
        "spec": str(getattr(got.sharding, "spec", got.sharding)),
        "ref_spec": str(getattr(ref.sharding, "spec", ref.sharding)),
        **{k: getattr(s1, k) - getattr(s0, k) for k in ("hits", "traces", "compiles")},
    }
# a kiln function pickled (cloudpickle, by value) carries its entries: no trace, no compile
import cloudpickle

carried = cloudpickle.loads(cloudpickle.dumps(kiln.jit(tanh_sum)))
s0 = kiln.stats()
value = host(carried(x))
s1 = kiln.stats()
pickled = {"value": value, "ref": out["tanh_sum"]["ref"],
           **{k: getattr(s1, k) - getattr(s0, k) for k in ("traces", "compiles")}}
route = jax.config.jax_compilation_cache_dir
print("JOB " + json.dumps({"pid": pid, "cases": out, "pickled": pickled, "route": route,
                          "eager": eager}),
      flush=True)
jax.distributed.shutdown()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path: Path, nproc: int, ndev: int, stores: list[Path],
            env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start ``nproc`` processes of one job (process i on store ``stores[i % len(stores)]``,
    with ``env`` set) and return each one's report, in process order."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = _free_port()
    procs = []
    for pid in range(nproc):
        # (KILN_JAX_CACHE unset: kiln's default, the kiln:// route on in a job too)
        child = child_env(KILN_CACHE_DIR=str(stores[pid % len(stores)]), JAX_PLATFORMS="cpu",
                          **(env or {}))
        procs.append(start_child(
            [sys.executable, script, str(pid), str(nproc), str(port), str(ndev)],
            env=child, cwd=tmp_path))
    reports = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [ln for ln in stdout.splitlines() if ln.startswith("JOB ")]
        assert p.returncode == 0 and lines, f"exit {p.returncode}\n{stderr[-3000:]}"
        reports.append(json.loads(lines[-1][4:]))
    return reports


def _check_values(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        # the kiln:// route is on by default in a job too: JAX's own jits and eager operations
        # go through the store (this once hung or crashed a job: "Function
        # broadcast_add_fusion not found", an executable JAX's cache loaded, stored by kiln)
        assert r["route"] == "kiln://store", r["route"]
        for name, c in r["cases"].items():
            assert c["value"] == c["ref"], (r["pid"], name, c)
            assert c["spec"] == c["ref_spec"], (r["pid"], name, c)


@pytest.mark.parametrize(("nproc", "ndev"), [(2, 2), (4, 1), (1, 8)])
def test_a_job_on_one_shared_store_compiles_each_program_once(
    tmp_path: Path, nproc: int, ndev: int
) -> None:
    store = tmp_path / "shared"
    cold = run_job(tmp_path, nproc, ndev, [store])
    _check_values(cold)
    for name in cold[0]["cases"]:
        compiles = [r["cases"][name]["compiles"] for r in cold]
        if name == "noinline_in_shard_map":
            continue  # the outer program and the noinline function's own executables
        if name == "local_only":
            # no committed argument: each process runs it on its own default device, so each
            # compiles its own program (as jax.jit does), under its own key
            assert compiles == [1] * nproc, compiles
            continue
        assert sum(compiles) == 1, (name, compiles)  # one compile per job; the others load
        assert sum(r["cases"][name]["hits"] for r in cold) == nproc - 1, name
    warm = run_job(tmp_path, nproc, ndev, [store])
    _check_values(warm)
    for c, w in zip(cold, warm, strict=True):
        # each process's own eager programs: written by that process cold (JAX writes its cache
        # from process 0 only; the route takes every process's), read warm, none compiled
        assert c["eager"]["misses"] > 0 and c["eager"]["hits"] == 0, c["eager"]
        assert w["eager"]["misses"] == 0 and w["eager"]["hits"] > 0, w["eager"]
        assert w["eager"]["value"] == c["eager"]["value"]
    for r in warm:
        for name, c in r["cases"].items():
            if name == "noinline_in_shard_map":
                assert c["compiles"] == 0, (r["pid"], name, c)
                continue
            assert (c["hits"], c["traces"], c["compiles"]) == (1, 0, 0), (r["pid"], name, c)
    for r in cold + warm:
        p = r["pickled"]
        assert p["value"] == p["ref"] and (p["traces"], p["compiles"]) == (0, 0), p


def test_a_job_on_per_host_stores_compiles_per_host_and_warm_starts(tmp_path: Path) -> None:
    stores = [tmp_path / "host0", tmp_path / "host1"]
    cold = run_job(tmp_path, 2, 2, stores)
    _check_values(cold)
    for r in cold:
        assert all(c["compiles"] == 1 for name, c in r["cases"].items()
                   if name != "noinline_in_shard_map"), r
    warm = run_job(tmp_path, 2, 2, stores)
    _check_values(warm)
    for r in warm:
        assert all((c["hits"], c["traces"], c["compiles"]) == (1, 0, 0)
                   for name, c in r["cases"].items() if name != "noinline_in_shard_map"), r


def test_a_job_of_hosts_with_their_own_directories_shares_redis(
    tmp_path: Path, redis_url: str
) -> None:
    """Each host its own local directory, one Redis for the job: one compile per program."""
    env = {"KILN_STORE": redis_url, "KILN_SIGNING_KEY": "job-secret"}
    stores = [tmp_path / "host0", tmp_path / "host1"]
    cold = run_job(tmp_path, 2, 2, stores, env)
    _check_values(cold)
    for name in cold[0]["cases"]:
        if name in ("noinline_in_shard_map", "local_only"):
            continue
        assert sum(r["cases"][name]["compiles"] for r in cold) == 1, name
    warm = run_job(tmp_path, 2, 2, [tmp_path / "fresh0", tmp_path / "fresh1"], env)
    _check_values(warm)  # new local directories: every entry comes from Redis
    for r in warm:
        assert all((c["hits"], c["traces"], c["compiles"]) == (1, 0, 0)
                   for name, c in r["cases"].items() if name != "noinline_in_shard_map"), r


KILLED_JOB = r'''
import json, os, signal, sys, time
pid, port, store_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import jax.numpy as jnp
import numpy as np
from jax._src import compiler
from jax.sharding import NamedSharding, PartitionSpec as P
import kiln

# the backend starts with both processes (gloo joins them)
mesh = jax.make_mesh((2,), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                           np.arange(2, dtype=np.float32) + 2 * pid)
marker = os.path.join(os.path.dirname(store_dir), "victim-compiling")
if pid == 1:  # the victim: dies inside XLA's compile, holding the key's lease
    def dies(*args, **kwargs):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    compiler.backend_compile_and_load = dies
else:  # the survivor asks for the same key only once the victim holds it
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)

f = kiln.jit(lambda x: jnp.tanh(x * 2.0).sum())
t0 = time.monotonic()
compiled = f.lower(x).compile()  # through kiln's lease; not run (its peer is gone)
s = kiln.stats()
print("JOB " + json.dumps({"pid": pid, "compiles": s.compiles, "hits": s.hits,
                           "marker": os.path.exists(marker),
                           "waited_s": time.monotonic() - t0}), flush=True)
os._exit(0)  # not jax.distributed's shutdown barrier: the other process is dead
'''


def test_a_process_killed_mid_compile_does_not_hold_up_the_job_s_others(tmp_path: Path) -> None:
    """Process 1 of a job dies (SIGKILL) inside XLA's compile while it holds the key's lease on
    the job's shared store; process 0 asks for the same key then. Its wait ends when the OS
    frees the dead process's lock: it compiles the program itself, well within the lease's
    bounded wait, instead of waiting for an entry that will never come."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_JOB)
    store = tmp_path / "shared"
    port = _free_port()
    env = child_env(KILN_CACHE_DIR=str(store), JAX_PLATFORMS="cpu")
    procs = [start_child([sys.executable, script, str(pid), str(port), str(store)], env=env,
                         cwd=tmp_path) for pid in (0, 1)]
    try:
        out0, err0 = procs[0].communicate(timeout=300)
        procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9  # the victim died by SIGKILL, mid-compile
    lines = [ln for ln in out0.splitlines() if ln.startswith("JOB ")]
    assert procs[0].returncode == 0 and lines, f"exit {procs[0].returncode}\n{err0[-3000:]}"
    survivor = json.loads(lines[-1][4:])
    assert survivor["marker"] is True  # it asked while the victim held the lease
    assert (survivor["compiles"], survivor["hits"]) == (1, 0)  # compiled it itself
