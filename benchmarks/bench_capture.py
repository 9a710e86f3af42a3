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
from fxpipe.compiler.driver import run_passes
from fxpipe.passes import total_cost
from fxpipe.planner.shapes import model_flops_formula


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--functionalize", nargs="*", default=["gpt3-175b"],
                    help="models whose raw export is functionalized and reported (registry names)")
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
    for name in args.functionalize:
        functionalize_cost(name, args.layers)


def functionalize_cost(name: str, layers: int) -> None:
    """What functionalization (part of capture) finds and costs on a model's raw export."""
    from fxpipe.compiler.capture import _LossModule, _model_kwargs
    from fxpipe.passes.aliasing import mutated_args
    from fxpipe.passes.functionalize import functionalize

    w = build_workload(name, batch=1, device="meta", layers=layers)
    wrapper = _LossModule(w.model, w.loss_fn, _model_kwargs(w.model))
    ep = torch.export.export(wrapper, tuple(w.example_inputs), strict=False)
    before = len(ep.graph.nodes)
    writes = sum(1 for n in ep.graph.nodes if mutated_args(n))
    t0 = time.perf_counter()
    done = functionalize(ep.graph_module, writable=lambda n: n.name.startswith("b_"))
    dt = time.perf_counter() - t0
    print(f"functionalize {name} ({layers} layers, meta): {writes} in-place nodes in the training "
          f"IR, {before} -> {len(done.graph_module.graph.nodes)} nodes, {dt:.2f} s")


if __name__ == "__main__":
    from results_log import recorded

    with recorded("bench_capture"):
        main()
