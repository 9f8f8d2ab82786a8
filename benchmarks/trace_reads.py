"""Benchmark: what recording a trace's file reads costs, cold and warm (target:
nothing measurable on a trace; a warm check costs a stat per file).

Run from the repository root (about 1 minute):

    python benchmarks/trace_reads.py [--reps 7] [--json PATH]

In one process, medians of ``--reps`` repetitions:

1. **The audit hook while tracing** (cold): ``jax.jit(step).trace(...)`` of an MLP training
   step (optax adam, 3 layers), with kiln's read recorder around it and without, in turns (the
   hook is installed first, so both arms pay what any process pays once kiln has traced once).
2. **Keying the files a trace read** (cold): ``ReadRecorder.items()`` after a trace that
   ``np.load``-ed a 16 MiB array and ``json.load``-ed a config (content digests).
3. **Re-checking them on a warm lookup**: ``check_read`` of those items with the files
   untouched (a stat each), and after their mtime moved (the content digested again).

Anchor: the trace itself (item 1) and the Lotka-Volterra warm start's fingerprint budget
(``benchmarks/fingerprint.py``: the warm fingerprint of the fit, ~0.03 s).
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
from typing import Any


def _median_pair(reps: int, a: Any, b: Any) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(reps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from kiln._keys._reads import ReadRecorder, check_read

    opt = optax.adam(1e-3)
    sizes = [64, 256, 256, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [(jax.random.normal(k, (m, n)) * 0.1, jnp.zeros(n))
              for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=False)]
    state = opt.init(params)
    x, y = jnp.ones((32, 64)), jnp.zeros((32,), jnp.int32)

    def make_step() -> Any:
        def step(params: Any, state: Any, x: Any, y: Any) -> Any:
            def loss(p: Any) -> Any:
                h = x
                for w, b in p[:-1]:
                    h = jax.nn.relu(h @ w + b)
                logits = h @ p[-1][0] + p[-1][1]
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            val, grads = jax.value_and_grad(loss)(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, val

        return step

    def trace() -> None:
        # a new function each time: jax's trace cache cannot serve it
        jax.jit(make_step()).trace(params, state, x, y)

    def trace_recorded() -> None:
        with ReadRecorder():
            trace()

    with ReadRecorder():  # install the hook once, as the first kiln trace does
        pass
    trace()
    t_plain, t_rec = _median_pair(args.reps, trace, trace_recorded)
    out: dict[str, Any] = {"trace_s": t_plain, "trace_recorded_s": t_rec,
                           "hook_ratio": t_rec / t_plain}
    print(f"trace of an MLP adam step: {t_plain:.4f} s plain, {t_rec:.4f} s recorded "
          f"({t_rec / t_plain:.3f}x)", flush=True)
    # every audit event of the process reaches kiln's hook once it is installed: how many a
    # trace raises (a second hook counts them; it cannot be removed either, so it goes last)
    events: list[str] = []
    counting = [True]
    sys.addaudithook(lambda e, a: events.append(e) if counting[0] else None)
    trace()
    counting[0] = False
    out["audit_events_per_trace"] = len(events)
    print(f"audit events raised by one trace: {len(events)} "
          f"({', '.join(f'{e} {events.count(e)}' for e in sorted(set(events)))})", flush=True)

    with tempfile.TemporaryDirectory() as d:
        npy, cfg = os.path.join(d, "w.npy"), os.path.join(d, "cfg.json")
        np.save(npy, np.zeros((4 << 20,), np.float32))  # 16 MiB
        Path(cfg).write_text(json.dumps({"scale": 2.0}))
        old = time.time() - 60
        for p in (npy, cfg):
            os.utime(p, (old, old))
        items_s, check_s, moved_s = [], [], []
        for _ in range(args.reps):
            with ReadRecorder() as r:
                np.load(npy)
                with open(cfg) as fh:
                    json.load(fh)
            t0 = time.perf_counter()
            items = r.items()
            items_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert all(check_read(*i) is None for i in items)
            check_s.append(time.perf_counter() - t0)
            for p in (npy, cfg):
                os.utime(p, None)
            t0 = time.perf_counter()
            assert all(check_read(*i) is None for i in items)
            moved_s.append(time.perf_counter() - t0)
            for p in (npy, cfg):
                os.utime(p, (old, old))
    out.update(items_s=statistics.median(items_s), check_s=statistics.median(check_s),
               check_moved_s=statistics.median(moved_s))
    print(f"16 MiB npy + json: keyed in {out['items_s'] * 1e3:.2f} ms cold; warm check "
          f"{out['check_s'] * 1e6:.1f} us (stat), {out['check_moved_s'] * 1e3:.2f} ms when "
          "the mtime moved (digest)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
