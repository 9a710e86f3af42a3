"""Stage balance of the partitioners on real captured graphs (meta device, A100 cost model).

    .venv/bin/python benchmarks/bench_partition.py [--skip-175b]

1. GPT-2-medium shapes (h=1024, 24 layers, s=1024, V=50257), b=1, 1F1B with m=8:
   ilp vs uniform vs params vs dp at p=4 and p=8 — predicted bottleneck per
   microbatch, balance ratio (max/mean stage time), and how much heavier the
   uniform split's first and last stages are than its middle ones.
2. GPT-3-175B shapes (96 layers, h=12288, s=2048, V=51200), b=1, for (p, v) =
   (16, 1) and (8, 2) with an 80 GB limit per rank: ILP time including
   coarsening, gap, balance. Parameters are assumed sharded tp=8 ways (the
   paper's setting), so static bytes are divided by 8; Adam in mixed precision
   holds 18 bytes per parameter (Megatron: fp16 param + grad, fp32 master + 2 moments);
   activations are bf16 and sequence-parallel over tp=8 (1/16 of the fp32 capture's).
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import fxpipe
from fxpipe.base.hardware import A100
from fxpipe.models import build_workload
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.assign_stages import PartitionConfig, solve_partition
from fxpipe.schedules.inflight import stage_inflight
from fxpipe.schedules.registry import generate


def _program(name: str):
    w = build_workload(name, batch=1, device="meta")
    return run_passes(fxpipe.capture(w.model, w.example_inputs))[0]


def gpt2_medium() -> None:
    prog = _program("gpt2-medium")
    print("GPT-2-medium shapes, b=1, s=1024, 1F1B m=8, A100 cost model")
    print(f"{'p':>3} {'method':>8} {'bottleneck ms':>14} {'balance':>8} {'gap':>7} {'first/mid':>10} "
          f"{'last/mid':>9} {'solve s':>8}")
    for p in (4, 8):
        sched = generate("1f1b", p, 8, 1)
        for method in ("ilp", "uniform", "params", "dp"):
            cfg = PartitionConfig(num_stages=p, stage_to_rank=sched.stage_ranks,
                                  inflight=stage_inflight(sched), method=method, hardware=A100,
                                  time_limit_s=20, num_workers=2)
            t = time.perf_counter()
            _, res = solve_partition(prog, cfg)
            dt = time.perf_counter() - t
            times = [c.time_s for c in res.stages]
            mid = sum(times[1:-1]) / max(1, len(times) - 2)
            print(f"{p:>3} {method:>8} {res.bottleneck_s * 1e3:>14.3f} {res.balance_ratio:>8.3f} "
                  f"{res.gap:>7.2%} {times[0] / mid:>10.2f} {times[-1] / mid:>9.2f} {dt:>8.2f}")


def gpt3_175b() -> None:
    t0 = time.perf_counter()
    prog = _program("gpt3-175b")
    print(f"\nGPT-3-175B shapes captured on meta in {time.perf_counter() - t0:.1f} s; "
          f"80 GB per rank, tp=8 sharding assumed, 18 B/param (bf16 + fp32 Adam)")
    print(f"{'p':>3} {'v':>2} {'method':>8} {'bottleneck ms':>14} {'balance':>8} {'gap':>7} "
          f"{'max mem GB':>11} {'solve s':>8}")
    for p, v in ((16, 1), (8, 2)):
        sched = generate("interleaved" if v > 1 else "1f1b", p, 2 * p, v)
        for method in ("ilp", "uniform"):
            # bf16 params: 2 bytes each; 18 bytes of state per parameter = 9 per param byte, /tp.
            cfg = PartitionConfig(num_stages=p * v, stage_to_rank=sched.stage_ranks,
                                  inflight=stage_inflight(sched), method=method, hardware=A100,
                                  memory_limit_bytes=80 * 10**9, state_bytes_per_param_byte=9 / 8 / 2,
                                  activation_scale=1 / 8 / 2,  # tp=8 with SP, bf16
                                  allow_over_limit=True,  # the table shows uniform's overflow
                                  time_limit_s=15, num_workers=2)
            t = time.perf_counter()
            try:
                _, res = solve_partition(prog, cfg)
            except ValueError as exc:
                print(f"{p:>3} {v:>2} {method:>8} infeasible: {exc}")
                continue
            dt = time.perf_counter() - t
            print(f"{p:>3} {v:>2} {method:>8} {res.bottleneck_s * 1e3:>14.2f} {res.balance_ratio:>8.3f} "
                  f"{res.gap:>7.2%} {max(res.rank_memory_bytes) / 1e9:>11.1f} {dt:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-175b", action="store_true")
    args = ap.parse_args()
    print(f"machine: {platform.machine()} cpus={os.cpu_count()}")
    gpt2_medium()
    if not args.skip_175b:
        gpt3_175b()


if __name__ == "__main__":
    from results_log import recorded

    with recorded("bench_partition"):
        main()
