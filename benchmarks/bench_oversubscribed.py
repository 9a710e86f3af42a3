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
(docs/layout_search.md). Writes benchmarks/results/bench_oversubscribed.txt.
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

OUT = Path(__file__).resolve().parent / "results" / "bench_oversubscribed.txt"


def _compute(seconds: float, a: torch.Tensor) -> None:
    end = time.thread_time() + seconds  # this rank's own CPU seconds: the work, not the wait for a core
    while time.thread_time() < end:
        a = (a @ a).tanh_()


def _pairs(rank: int, iters: int, compute_s: float, buf: torch.Tensor, a: torch.Tensor) -> float:
    """``iters`` iterations of compute then a swap with the partner; seconds per iteration."""
    partner = rank ^ 1
    start = time.perf_counter()
    for _ in range(iters):
        _compute(compute_s, a)
        if rank % 2 == 0:
            dist.send(buf, partner)
            dist.recv(buf, partner)
        else:
            dist.recv(buf, partner)
            dist.send(buf, partner)
    return (time.perf_counter() - start) / iters


def _worker(rank: int, world: int, out: str, iters: int, compute_s: float, rounds: int) -> None:
    buf, a = torch.zeros(1024), torch.randn(64, 64)
    _pairs(rank, 20, compute_s, buf, a)  # connections and first-touch costs out of the numbers
    res: dict[str, list[float]] = {"own cores": [], "oversubscribed": []}
    for r in range(rounds):
        for mode in (("own cores", "oversubscribed") if r % 2 == 0 else ("oversubscribed", "own cores")):
            dist.barrier()
            if mode == "oversubscribed" or rank < 2:
                res[mode].append(_pairs(rank, iters, compute_s, buf, a))
            dist.barrier()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--compute-ms", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run_local_world(4, _worker, tmp, args.iters, args.compute_ms / 1e3, args.rounds,
                        timeout=timedelta(seconds=600), threads=1)
        res = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(4)]
    own = statistics.median(res[0]["own cores"])
    over = statistics.median(t for r in res for t in r["oversubscribed"])
    c = args.compute_ms / 1e3
    swap = own - c  # the two hand-offs with a core for every rank
    shared = max(1.0, 4 / cores) * c + swap  # the cores shared, nothing else
    extra = (over - shared) / 2
    lines = [f"# bench_oversubscribed — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {cores} cpus, "
             f"torch {torch.__version__}, world 4 gloo, 1 thread per rank, {args.iters} iterations of "
             f"{args.compute_ms:g} ms of compute and a 4 KB swap, {args.rounds} rounds ({time.perf_counter() - start:.0f} s)",
             "", "| mode | busy ranks | ms per iteration (median) |", "|---|---|---|",
             f"| own cores | 2 | {own * 1e3:.3f} |", f"| oversubscribed | 4 | {over * 1e3:.3f} |", "",
             f"two hand-offs with a core each: {swap * 1e3:.3f} ms per iteration; the cores shared and nothing else "
             f"would take {shared * 1e3:.3f} ms; beyond that, per hand-off: {extra * 1e3:.3f} ms"]
    print("\n".join(lines))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
