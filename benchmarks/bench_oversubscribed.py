"""What a point-to-point hand-off costs when more ranks run than there are cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_oversubscribed.py [--iters 200] [--compute-ms 1]

A world of 4 gloo processes, one thread each, on this machine. Ranks 0↔1 and 2↔3 are
pairs; each iteration a rank computes ``--compute-ms`` (a small matmul loop) and then
the pair swaps a 4 KB message (rank 0 and 2 send then receive, 1 and 3 receive then
send): a pipeline's dependency between two stages, twice per iteration. Two modes,
interleaved over ``--rounds`` rounds:
- **own cores**: only the pair 0↔1 runs (2 busy processes on this machine's cores);
- **oversubscribed**: both pairs run at once (4 busy processes).
Per mode, the median iteration time over the rounds. With no cost beyond sharing the
cores, the oversubscribed iteration would be ``busy_ranks / cores`` times the compute
plus the own-cores hand-offs; what it takes beyond that, per hand-off (two per
iteration), is the wait of a rank whose message arrived while every core was held by
another rank — the cost the layout price leaves out at world 4 on 2 cores
(docs/layout_search.md). The measurement is ``fxpipe calibrate``'s
(``fxpipe/planner/oversubscription.py``), here with more iterations and rounds. Writes
benchmarks/results/bench_oversubscribed.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from fxpipe.planner.oversubscription import RANKS, timed_modes, wakeup_from
from fxpipe.runtime.local_world import run_local_world

OUT = Path(__file__).resolve().parent / "results" / "bench_oversubscribed.txt"


def _worker(rank: int, world: int, out: str, iters: int, compute_s: float, rounds: int) -> None:
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(timed_modes(rank, iters, compute_s, rounds), f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--compute-ms", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    c = args.compute_ms / 1e3
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run_local_world(RANKS, _worker, tmp, args.iters, c, args.rounds, timeout=timedelta(seconds=600), threads=1)
        got = wakeup_from([json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(RANKS)], c, cores)
    lines = [f"# bench_oversubscribed — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {cores} cpus, "
             f"torch {torch.__version__}, world 4 gloo, 1 thread per rank, {args.iters} iterations of "
             f"{args.compute_ms:g} ms of compute and a 4 KB swap, {args.rounds} rounds ({time.perf_counter() - start:.0f} s)",
             "", "| mode | busy ranks | ms per iteration (median) |", "|---|---|---|",
             f"| own cores | 2 | {got['alone_s'] * 1e3:.3f} |", f"| oversubscribed | 4 | {got['shared_s'] * 1e3:.3f} |", "",
             f"two hand-offs with a core each: {(got['alone_s'] - c) * 1e3:.3f} ms per iteration; the cores shared and "
             f"nothing else would take {got['sharing_s'] * 1e3:.3f} ms; beyond that, per hand-off: "
             f"{got['wakeup_s'] * 1e3:.3f} ms (Hardware.wakeup_s)"]
    print("\n".join(lines))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
