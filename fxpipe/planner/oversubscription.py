"""What a pipeline hand-off costs when more ranks run than there are cores
(``Hardware.wakeup_s``; ``fxpipe calibrate``, ``benchmarks/bench_oversubscribed.py``).

Four ranks of one thread on a machine of fewer cores: ranks 0↔1 and 2↔3 are pairs; each
iteration a rank computes for a fixed time, then the pair swaps a 4 KB message (ranks 0
and 2 send then receive, 1 and 3 receive then send) — a pipeline's dependency between two
stages, twice per iteration. With the pair 0↔1 alone the two busy ranks have cores of
their own; with both pairs the four share the cores. Sharing alone would make an
oversubscribed iteration ``4 / cores`` times the compute plus the alone iteration's
hand-offs; what it takes beyond that, per hand-off, is the wait of a rank woken by its
message while every core runs another rank: it gave its core away when it blocked and
queues for one.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

RANKS = 4
"""Ranks of the measurement (two pairs)."""


def _compute(seconds: float, a: torch.Tensor) -> None:
    end = time.thread_time() + seconds  # the rank's own CPU seconds: its work, not its wait for a core
    while time.thread_time() < end:
        a = (a @ a).tanh_()


def handoffs(rank: int, iters: int, compute_s: float) -> float:
    """``iters`` iterations of ``compute_s`` of compute then a swap with the partner
    (``rank ^ 1``) in the default process group; wall seconds per iteration."""
    buf, a = torch.zeros(1024), torch.randn(64, 64)
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


def timed_modes(rank: int, iters: int, compute_s: float, rounds: int) -> dict[str, list[float]]:
    """Per mode ("alone": the pair 0↔1 only; "shared": both pairs), this rank's seconds
    per iteration in each of ``rounds`` rounds, the modes' order alternated per round."""
    handoffs(rank, 20, compute_s)  # connections and first-touch costs out of the numbers
    res: dict[str, list[float]] = {"alone": [], "shared": []}
    for r in range(rounds):
        for mode in (("alone", "shared") if r % 2 == 0 else ("shared", "alone")):
            dist.barrier()
            if mode == "shared" or rank < 2:
                res[mode].append(handoffs(rank, iters, compute_s))
            dist.barrier()
    return res


def wakeup_from(results: list[dict[str, list[float]]], compute_s: float, cores: int) -> dict[str, float]:
    """The module docstring's arithmetic on every rank's ``timed_modes``: medians, and the
    wait per hand-off beyond sharing the cores (never below 0)."""
    alone = statistics.median(results[0]["alone"])
    shared = statistics.median(t for r in results for t in r["shared"])
    swap = alone - compute_s
    sharing = max(1.0, RANKS / cores) * compute_s + swap
    return dict(alone_s=alone, shared_s=shared, sharing_s=sharing, wakeup_s=max(0.0, (shared - sharing) / 2))


def _worker(rank: int, port: int, out: str, iters: int, compute_s: float, rounds: int) -> None:
    """One of the four measuring processes (a fresh interpreter, one thread)."""
    from fxpipe.runtime.local_world import join_local_world

    torch.set_num_threads(1)
    join_local_world(rank, RANKS, port, timeout=datetime.timedelta(seconds=120))
    res = timed_modes(rank, iters, compute_s, rounds)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def measure_wakeup(iters: int = 100, compute_s: float = 1e-3, rounds: int = 3) -> dict[str, float]:
    """``Hardware.wakeup_s`` of this machine: 0 where four ranks have cores of their own,
    else the four-rank measurement of the module docstring, in fresh interpreters (not
    multiprocessing's spawn, which would re-run the caller's ``__main__``)."""
    import subprocess
    import sys

    from fxpipe.runtime.local_world import free_port

    cores = os.cpu_count() or 1
    if cores >= RANKS:
        return dict(wakeup_s=0.0, cores=cores)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        code = ("import sys; from fxpipe.planner.oversubscription import _worker as w; "
                "w(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), "
                "int(sys.argv[6]))")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), tmp, str(iters), str(compute_s),
                                   str(rounds)]) for r in range(RANKS)]
        codes = [p.wait(timeout=300) for p in procs]
        if any(codes):
            raise RuntimeError(f"oversubscription workers failed with exit codes {codes}")
        results = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(RANKS)]
    return dict(wakeup_from(results, compute_s, cores), cores=cores)
