"""Benchmark: what recording a trace's file reads costs, cold and warm (target: nothing
measurable on a trace; a warm check costs a stat per file).

Run from the repository root (about 1 minute each; ``lotka_volterra`` needs the ``examples``
extra):

    python benchmarks/trace_reads.py [--program mlp|lotka_volterra] [--reps 7] [--json PATH]

In one process, medians of ``--reps`` repetitions:

1. **The recorder on a trace** (cold): the program's trace with kiln's read recorder
   (``ReadRecorder``) around it and without, in turns (the audit hook is installed first, so
   both arms pay what any process pays once kiln has traced once). ``--program mlp`` (the
   default): ``jax.jit(step).trace(...)`` of an MLP training step (optax adam, 3 layers), a new
   function each time (jax's trace cache cannot serve it), timed with the recorder's entry and
   exit. ``--program lotka_volterra``: ``jax.jit(fit).trace(ts, ys)`` of a fresh Lotka-Volterra
   fit each time (the audit hook, and the wrappers of ``os.stat``, ``os.lstat``, ``os.access``
   and ``threading.Thread.start`` that are in place while a recording is open), timed from the
   trace to the recorded items.
2. ``mlp``: how many audit events one trace raises (each reaches kiln's hook), then **keying the
   files a trace read** (cold): ``ReadRecorder.items()`` after a trace that ``np.load``-ed a
   16 MiB array and ``json.load``-ed a config (content digests), and **re-checking them on a
   warm lookup**: ``check_read`` of those items with the files untouched (a stat each), and
   after their mtime moved (the content digested again). ``lotka_volterra``: how many calls of
   the wrapped ``os`` functions one recorded trace makes (each one a recorded thread pays for:
   a frame walk), and the items it records (none: the fit reads nothing outside Python).

Anchor: the trace itself (item 1) and the Lotka-Volterra warm start's fingerprint budget
(``benchmarks/fingerprint.py``: the warm fingerprint of the fit, ~0.03 s).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as bench

Arm = Callable[[bool], float]  # a trace, recorded or not: its seconds
Extra = Callable[[int], dict[str, Any]]  # the program's other figures, from --reps repetitions


def mlp() -> tuple[Arm, Extra]:
    """The MLP step's arm (recorded or not: seconds) and its extra figures."""
    import jax
    import jax.numpy as jnp
    import optax

    from kiln._keys._reads import ReadRecorder

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

    def arm(record: bool) -> float:
        t0 = time.perf_counter()
        if record:
            with ReadRecorder():
                trace()
        else:
            trace()
        return time.perf_counter() - t0

    with ReadRecorder():  # install the hook once, as the first kiln trace does
        pass
    trace()
    return arm, lambda reps: _audit_events(trace) | _keyed_files(reps)


def _audit_events(trace: Callable[[], None]) -> dict[str, Any]:
    # every audit event of the process reaches kiln's hook once it is installed: how many a
    # trace raises (a second hook counts them; it cannot be removed either, so it goes last)
    events: list[str] = []
    counting = [True]
    sys.addaudithook(lambda e, a: events.append(e) if counting[0] else None)
    trace()
    counting[0] = False
    print(f"audit events raised by one trace: {len(events)} "
          f"({', '.join(f'{e} {events.count(e)}' for e in sorted(set(events)))})", flush=True)
    return {"audit_events_per_trace": len(events)}


def _keyed_files(reps: int) -> dict[str, Any]:
    import numpy as np

    from kiln._keys._reads import ReadRecorder, check_read

    with tempfile.TemporaryDirectory() as d:
        npy, cfg = os.path.join(d, "w.npy"), os.path.join(d, "cfg.json")
        np.save(npy, np.zeros((4 << 20,), np.float32))  # 16 MiB
        Path(cfg).write_text(json.dumps({"scale": 2.0}))
        old = time.time() - 60
        for p in (npy, cfg):
            os.utime(p, (old, old))

        def once() -> dict[str, float]:
            with ReadRecorder() as r:
                np.load(npy)
                with open(cfg) as fh:
                    json.load(fh)
            t0 = time.perf_counter()
            items = r.items()
            t1 = time.perf_counter()
            assert all(check_read(*i) is None for i in items)
            t2 = time.perf_counter()
            for p in (npy, cfg):
                os.utime(p, None)
            t3 = time.perf_counter()
            assert all(check_read(*i) is None for i in items)
            t4 = time.perf_counter()
            for p in (npy, cfg):
                os.utime(p, (old, old))
            return {"items_s": t1 - t0, "check_s": t2 - t1, "check_moved_s": t4 - t3}

        rows = [once() for _ in range(reps)]
    out = {k: bench.median(r[k] for r in rows) for k in rows[0]}
    print(f"16 MiB npy + json: keyed in {out['items_s'] * 1e3:.2f} ms cold; warm check "
          f"{out['check_s'] * 1e6:.1f} us (stat), {out['check_moved_s'] * 1e3:.2f} ms when "
          "the mtime moved (digest)", flush=True)
    return out


def lotka_volterra() -> tuple[Arm, Extra]:
    """The Lotka-Volterra fit's arm (recorded or not: seconds) and its extra figures."""
    import jax

    from kiln._keys import _reads
    from kiln._keys._reads import ReadRecorder
    from kiln_demo.lotka_volterra import _build_fit, load_data

    ts, ys = load_data()
    _reads._install_hook()
    recorded: list[Any] = [None]

    def arm(record: bool) -> float:
        fit = jax.jit(_build_fit())
        t0 = time.perf_counter()
        if not record:
            fit.trace(ts, ys)
            return time.perf_counter() - t0
        with ReadRecorder() as r:
            fit.trace(ts, ys)
        recorded[0] = r.items()
        return time.perf_counter() - t0

    def extra(reps: int) -> dict[str, Any]:
        # the wrapped os calls one recorded trace makes: counters in front of kiln's wrappers
        counts = {"stat": 0, "lstat": 0, "access": 0}
        wrappers = {name: w for owner, name, _, w in _reads._state._WRAPPERS if owner is os}
        originals = {name: o for owner, name, o, _ in _reads._state._WRAPPERS if owner is os}

        def counting(name: str) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                counts[name] += 1
                return wrappers[name](*a, **k)
            return call

        wrap, unwrap = _reads._wrap, _reads._unwrap
        _reads._wrap = _reads._unwrap = lambda: None
        try:
            for name in counts:
                setattr(os, name, counting(name))
            arm(True)
        finally:
            for name in counts:
                setattr(os, name, originals[name])
            _reads._wrap, _reads._unwrap = wrap, unwrap
        print(f"calls of os.stat / os.lstat / os.access in one recorded trace: {counts}; "
              f"items recorded: {recorded[0]}")
        return {"wrapped_calls_per_recorded_trace": counts, "items_recorded": recorded[0]}

    arm(False)
    arm(True)  # imports and first-use costs out of the way
    return arm, extra


PROGRAMS = {"mlp": mlp, "lotka_volterra": lotka_volterra}


def main(argv: list[str] | None = None) -> int:
    parser = bench.options(__doc__, reps=7)
    parser.add_argument("--program", choices=PROGRAMS, default="mlp")
    args = bench.begin(parser, argv)
    arm, extra = PROGRAMS[args.program]()
    runs = bench.interleave(("plain", "recorded"), args.reps, lambda v, _: arm(v == "recorded"),
                            rotate=False)
    med = {v: bench.median(ts) for v, ts in runs.items()}
    ratio = med["recorded"] / med["plain"]
    print(f"{args.program} trace, median of {args.reps}: {med['plain']:.4f} s plain, "
          f"{med['recorded']:.4f} s recorded ({ratio:.3f}x)", flush=True)
    bench.save(args, {"program": args.program, "trace_s": runs, "median_trace_s": med,
                      "recorded_over_plain": ratio, **extra(args.reps)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
