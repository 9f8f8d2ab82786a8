"""Stress: 8 processes x 200 mixed gets and puts on overlapping keys against one Redis server
and one local directory (kiln's layered store), writers killed with SIGKILL at random.

Every blob read must verify (signed entry, its own key, the payload the key implies): 0 corrupt
reads, no process fails except those killed, and afterwards every entry in both stores
verifies."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import sys
import time

import pytest
from kiln_test_children import child_env, start_child

import kiln
from kiln._base import decode
from kiln.stores import LocalStore, open_store

SECRET = "stress-secret"
KEYS = 12  # overlapping: 8 processes share 12 keys

WORKER = r'''
import hashlib, json, random, sys

from kiln import get_config
from kiln._base import decode, encode
from kiln.stores import open_store

SECRET = "stress-secret"
seed, ops, keys = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def payload(i):
    # 1 KiB to ~300 KiB, so writes take long enough to be killed in the middle
    return hashlib.sha256(str(i).encode()).digest() * (32 + 300 * i)


def key(i):
    return hashlib.sha256(f"stress-{i}".encode()).hexdigest()


store = open_store(get_config())
print("READY", flush=True)
rng = random.Random(seed)
out = {"gets": 0, "hits": 0, "puts": 0, "corrupt": []}
for n in range(ops):
    i = rng.randrange(keys)
    if rng.random() < 0.5:
        out["gets"] += 1
        blob = store.get(key(i))
        if blob is None:
            continue
        out["hits"] += 1
        try:
            entry = decode(blob, signing_key=SECRET)
            assert entry.header["key"] == key(i) and entry.header["i"] == i
            assert entry.sections["data"] == payload(i)
        except Exception as e:
            out["corrupt"].append(f"{key(i)[:12]}: {type(e).__name__}: {e}")
    else:
        out["puts"] += 1
        blob = encode({"key": key(i), "i": i, "kind": "executable"}, {"data": payload(i)},
                      signing_key=SECRET)
        (store.replace if rng.random() < 0.3 else store.put)(key(i), blob)
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
def test_eight_processes_mixed_gets_and_puts_with_kills(redis_url, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    local = tmp_path / "local"
    env = child_env(KILN_STORE=redis_url, KILN_CACHE_DIR=str(local), KILN_SIGNING_KEY=SECRET,
                    JAX_PLATFORMS="cpu", KILN_JAX_CACHE="0")
    rng = random.Random(1234)
    # three of the eight are killed at a random moment of their run (they would run until then)
    doomed = set(rng.sample(range(8), 3))
    procs = [start_child(
        [sys.executable, script, str(seed), str(10**6 if seed in doomed else 200), str(KEYS)],
        env=env) for seed in range(8)]
    try:
        for i in sorted(doomed):
            assert procs[i].stdout.readline().strip() == "READY", procs[i].stderr.read()
            time.sleep(rng.uniform(0.2, 1.5))
            procs[i].send_signal(signal.SIGKILL)
        results = []
        for i, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=240)
            if i in doomed:
                assert p.returncode == -signal.SIGKILL, stderr[-4000:]
                continue
            assert p.returncode == 0, f"worker {i} failed (exit {p.returncode}):\n{stderr[-4000:]}"
            (line,) = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert len(results) == 5 and all(r["gets"] + r["puts"] == 200 for r in results)
    assert [r["corrupt"] for r in results] == [[] for _ in results]
    assert sum(r["hits"] for r in results) > 0 and sum(r["puts"] for r in results) > 0
    # afterwards: every entry in both stores verifies, under its own key
    with kiln.config_context(store=redis_url, signing_key=SECRET):
        remote = open_store(kiln.get_config(), layered=False)
        remote_keys = list(remote.iter())
        for key in remote_keys:
            assert decode(remote.get(key), signing_key=SECRET).header["key"] == key
    local_store = LocalStore(local, shared=True)
    local_keys = list(local_store.iter())
    for key in local_keys:
        assert decode(local_store.get(key), signing_key=SECRET).header["key"] == key
    want = {hashlib.sha256(f"stress-{i}".encode()).hexdigest() for i in range(KEYS)}
    assert set(remote_keys) <= want and set(local_keys) <= want and remote_keys
