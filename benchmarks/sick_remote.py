"""Benchmark: what a sick shared store costs a process (target: at most 1 s, once).

Run from the repository root (about 1 minute):

    python benchmarks/sick_remote.py [--reps 5] [--json PATH]

A small program (``examples/mlp_digits.py --jit kiln``, 300 training steps) runs in fresh
processes on an empty local store, in three modes: ``local`` (no shared store), ``dead`` (a
Redis URL on a port nothing listens on) and ``hung`` (a loopback server that accepts
connections and never answers). Medians of ``--reps`` runs of each, interleaved: the time to the
program's first result and the whole process. Target: a hung or dead store adds at most 1 s to
a process, once, and never delays a first result for an upload.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _children import child_env, run_child
from _installed import compile_bytecode

REPO = Path(__file__).resolve().parent.parent


def _hung_server() -> tuple[int, threading.Event]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
                held.append(conn)  # never answered
            except OSError:
                continue
        listener.close()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1]), done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = run_child([sys.executable, REPO / "examples" / "mlp_digits.py", "--jit", "kiln"],
                     env=env, timeout=600)
    wall = time.perf_counter() - t0
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return float(result["time_to_first_result_s"]), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    compile_bytecode()
    port, stop = _hung_server()
    base = child_env(KILN_PROGRESS="0")
    urls = {"local": None, "dead": f"redis://127.0.0.1:{_free_port()}/0",
            "hung": f"redis://127.0.0.1:{port}/0"}
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in urls}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode, url in urls.items():
                env = base | {"KILN_CACHE_DIR": str(Path(tmp) / f"{mode}{rep}")}
                if url:
                    env |= {"KILN_STORE": url, "KILN_SIGNING_KEY": "bench"}
                runs[mode].append(_run(env))
    stop.set()
    local_ttfr = statistics.median(r[0] for r in runs["local"])
    local_wall = statistics.median(r[1] for r in runs["local"])
    report: dict[str, Any] = {"reps": args.reps, "modes": {}}
    for mode, rs in runs.items():
        ttfr, wall = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        report["modes"][mode] = {"median_ttfr_s": ttfr, "median_wall_s": wall,
                                 "runs": [{"ttfr_s": t, "wall_s": w} for t, w in rs]}
        print(f"{mode:6s} first result {ttfr:.2f} s (+{ttfr - local_ttfr:.2f} s), whole "
              f"process {wall:.2f} s (+{wall - local_wall:.2f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
