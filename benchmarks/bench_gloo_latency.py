"""How long one gloo collective (all-reduce, all-gather, broadcast) and one p2p transfer
take, as distributions, not medians.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_gloo_latency.py [--reps 100]

World 2 (gloo, one thread per process, the ranks' own cores): for 4 KB, 64 KB and 1 MB
(each rank's), an all-reduce, an all-gather, a broadcast and a send/recv right after a
barrier ("back to back") and after each rank computed for 2 ms (as a TP collective or a pipeline transfer follows a stage's compute).
A sample's time is from the later rank's arrival (both ranks' perf_counter: one monotonic
clock on one machine) to the end of the later to finish (a collective) or of the receive
(p2p). Prints mean, median and quartiles: ``fxpipe calibrate`` fits the all-reduce on the
mean because the price sums a step's collectives (docs/planner.md). The vocabulary
passes combine their softmax statistics with one all-gather, not two all-reduces
(``runtime/head_blocks.py``): the table shows what each costs.
Writes benchmarks/results/bench_gloo_latency.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fxpipe.runtime.local_world import run_local_world

SIZES = (4 << 10, 64 << 10, 1 << 20)
GAPS = (0.0, 0.002)
KINDS = ("all-reduce", "all-gather", "broadcast", "p2p")
OUT = Path(__file__).resolve().parent / "results" / "bench_gloo_latency.txt"


def _compute(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).tanh_()


def _worker(rank: int, world: int, out: str, reps: int) -> None:
    buf_of = {n: torch.zeros(n // 4) for n in SIZES}
    gathered_of = {n: torch.zeros(world * n // 4) for n in SIZES}
    res = {}
    for nbytes, buf in buf_of.items():
        for gap in GAPS:
            for kind in KINDS:
                samples = []
                for _ in range(reps + 5):
                    dist.barrier()
                    if gap:
                        _compute(gap)
                    t = time.perf_counter()
                    if kind == "all-reduce":
                        dist.all_reduce(buf)
                    elif kind == "all-gather":
                        dist.all_gather_single(gathered_of[nbytes], buf)
                    elif kind == "broadcast":
                        dist.broadcast(buf, 0)
                    elif rank == 0:
                        dist.send(buf, 1)
                    else:
                        dist.recv(buf, 0)
                    samples.append((t, time.perf_counter()))
                res[f"{kind}|{nbytes}|{gap}"] = samples[5:]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run_local_world(2, _worker, tmp, args.reps, timeout=timedelta(seconds=600), threads=1)
        r0, r1 = (json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2))
    lines = [f"# bench_gloo_latency — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {os.cpu_count()} cpus, "
             f"torch {torch.__version__}, world 2 gloo, 1 thread per rank, {args.reps} samples each "
             f"({time.perf_counter() - start:.0f} s)", "",
             "| what | bytes | after | mean us | median us | p25 us | p75 us |", "|---|---|---|---|---|---|---|"]
    for key in r0:
        kind, nbytes, gap = key.split("|")
        a, b = r0[key], r1[key]
        if kind != "p2p":
            lat = [max(x[1], y[1]) - max(x[0], y[0]) for x, y in zip(a, b)]
        else:  # the receive (rank 1) done, from the later of the two posts
            lat = [y[1] - max(x[0], y[0]) for x, y in zip(a, b)]
        q = statistics.quantiles(lat, n=4)
        after = "a barrier" if float(gap) == 0 else f"{float(gap) * 1e3:g} ms of compute"
        lines.append(f"| {kind} | {int(nbytes)} | {after} | {statistics.mean(lat) * 1e6:.0f} | "
                     f"{statistics.median(lat) * 1e6:.0f} | {q[0] * 1e6:.0f} | {q[2] * 1e6:.0f} |")
    print("\n".join(lines))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
