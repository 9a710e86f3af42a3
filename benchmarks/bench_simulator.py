# Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_simulator.py
#
# Speed of the schedule simulator on a large interleaved schedule
# (p=64 ranks, m=2048 microbatches, v=4 stages per rank: 1,048,576 compute
# actions, 2,064,384 more sends and receives). Target (issue 3): one
# simulation under 200 ms after JIT warm-up. Not a timed test; prints numbers.
from __future__ import annotations

import os
import platform
import statistics
import time

from fxpipe.schedules import StageDurations, generate, lower, simulate


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main(p: int = 64, m: int = 2048, v: int = 4, repeats: int = 7) -> None:
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    compute, t_gen = timed(generate, "interleaved", p, m, v)
    lowered, t_lower = timed(lower, compute)
    n_compute = sum(map(len, compute.actions))
    n_all = sum(map(len, lowered.actions))
    print(f"interleaved p={p} m={m} v={v}: {n_compute:,} compute actions, {n_all:,} with comm")
    print(f"generate: {t_gen * 1e3:8.1f} ms   lower: {t_lower * 1e3:8.1f} ms")
    _, t_encode = timed(lambda: lowered.arrays)  # once per schedule, cached on it
    print(f"encode to arrays: {t_encode * 1e3:.1f} ms (cached on the schedule; lower() fills the cache)")

    durations = StageDurations.uniform(lowered.num_stages, forward=1.0, backward=2.0)
    _, t_first = timed(simulate, lowered, durations, p2p_latency=0.05)  # JIT (or cache load)
    times = []
    for _ in range(repeats):
        result, t = timed(simulate, lowered, durations, p2p_latency=0.05)
        times.append(t)
    median = statistics.median(times)
    print(f"simulate: first call {t_first * 1e3:.1f} ms (JIT / cache load); "
          f"median of {repeats} {median * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    print(f"  target < 200 ms: {'OK' if median < 0.2 else 'MISSED'}")
    exact = simulate(lowered, durations)  # no latency: the closed form holds exactly
    print(f"  bubble / compute: closed form (p-1)/(v*m) = {(p - 1) / (v * m):.4%}; simulated "
          f"{max(exact.bubble_ratio):.4%} without latency, {max(result.bubble_ratio):.4%} with latency 0.05")
    print(f"  makespan {result.makespan:g}, peak in flight (rank 0) {result.peak_in_flight[0]} "
          f"chunk-microbatches = {result.peak_activation[0]:g} stage-microbatches")


if __name__ == "__main__":
    from results_log import recorded

    with recorded("bench_simulator"):
        main()
