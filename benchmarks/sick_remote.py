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

import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import _harness as bench

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


def _run(env: dict[str, str]) -> dict[str, float]:
    run = bench.fresh([REPO / "examples" / "mlp_digits.py", "--jit", "kiln"], env=env,
                      timeout=600)
    return {"ttfr_s": float(run.payload["time_to_first_result_s"]), "wall_s": run.wall_s}


def main(argv: list[str] | None = None) -> int:
    args = bench.begin(bench.options(__doc__, reps=5), argv, installed=True)
    port, stop = _hung_server()
    urls = {"local": None, "dead": f"redis://127.0.0.1:{bench.free_port()}/0",
            "hung": f"redis://127.0.0.1:{port}/0"}
    with tempfile.TemporaryDirectory() as tmp:
        def run(mode: str, rep: int) -> dict[str, float]:
            url = urls[mode]
            env = bench.child_env(**bench.kiln_store(Path(tmp) / f"{mode}{rep}"))
            if url:
                env |= {"KILN_STORE": url, "KILN_SIGNING_KEY": "bench"}
            return _run(env)

        runs = bench.interleave(list(urls), args.reps, run, rotate=False,
                                show=lambda r: f"ttfr {r['ttfr_s']:.2f} s, "
                                               f"wall {r['wall_s']:.2f} s")
    stop.set()
    report: dict[str, Any] = {"modes": {}}
    med = {f: bench.medians(runs, f) for f in ("ttfr_s", "wall_s")}
    for mode, rs in runs.items():
        report["modes"][mode] = {"median_ttfr_s": med["ttfr_s"][mode],
                                 "median_wall_s": med["wall_s"][mode], "runs": rs}
    print(bench.table(["mode", "first result s", "(+ local)", "whole process s", "(+ local)"],
                      [[m, med["ttfr_s"][m], f"{med['ttfr_s'][m] - med['ttfr_s']['local']:+.2f}",
                        med["wall_s"][m], f"{med['wall_s'][m] - med['wall_s']['local']:+.2f}"]
                       for m in runs]))
    bench.save(args, report)
    return 0

if __name__ == "__main__":
    sys.exit(main())
