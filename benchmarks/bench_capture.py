"""Capture and cost-annotate a GPT-3-175B-shaped model on the meta device.

    .venv/bin/python benchmarks/bench_capture.py [--layers 96] [--repeats 3]

No weights are allocated (device="meta"). Prints build, capture and pass times
(medians) and checks the FLOPs total against Megatron's formula. Target: under
30 s for the full 96 layers on a 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes import model_flops_formula, run_passes, total_cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"torch={torch.__version__}")
    build, cap, passes, total = [], [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        w = build_workload("gpt3-175b", batch=1, device="meta", layers=args.layers)
        t1 = time.perf_counter()
        prog = fxpipe.capture(w.model, w.example_inputs)
        t2 = time.perf_counter()
        prog, _ = run_passes(prog)
        t3 = time.perf_counter()
        build.append(t1 - t0), cap.append(t2 - t1), passes.append(t3 - t2), total.append(t3 - t0)
    cfg = w.config
    c = total_cost(prog)
    ref = model_flops_formula(1, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size)
    med = statistics.median
    print(f"gpt3-175b shape: l={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} "
          f"V={cfg.vocab_size}, {prog.num_parameters() / 1e9:.1f}B parameters, "
          f"{len(prog.graph.nodes)} nodes")
    print(f"median of {args.repeats}: build {med(build):.2f} s, capture {med(cap):.2f} s, "
          f"passes {med(passes):.2f} s, total {med(total):.2f} s (target < 30 s)")
    print(f"FLOPs per sequence: {(c.fwd_flops + c.bwd_flops) / 1e15:.2f} PFLOP, "
          f"formula {ref / 1e15:.2f} PFLOP, ratio {(c.fwd_flops + c.bwd_flops) / ref:.4f}")


if __name__ == "__main__":
    from results_log import recorded

    with recorded("bench_capture"):
        main()
