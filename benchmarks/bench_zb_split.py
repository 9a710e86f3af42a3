"""Zero-bubble backward split: I + W against the fused backward B, per stage.

    .venv/bin/python benchmarks/bench_zb_split.py [--repeats 10]

HF GPT-2 (8 layers, h=256, 4 heads, s=128, V=50257), one microbatch of 2 sequences,
cut into two stages (ILP on the cost model), one process, 1 thread. Each stage runs
forward then either B, or I followed by W (base/backward_split.py), through the
runtime's StageRunner. Medians over --repeats after 2 warm-ups. The planner and
simulator price I + W as B; the ZB paper's split makes that true up to the extra
engine calls. Writes benchmarks/results/zb_split.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import fxpipe
    from bench_runtime import LAYERS, SEQ, workload
    from fxpipe.compiler.driver import run_passes
    from fxpipe.passes.assign_stages import PartitionConfig, assign_stages
    from fxpipe.passes.split import split_program
    from fxpipe.runtime.stage_runner import StageRunner

    model, batch, loss_fn = workload()
    mb = tuple(t[:2] for t in batch)
    program, _ = run_passes(fxpipe.capture(model, mb, loss_fn))
    cfg = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))
    plan = split_program(assign_stages(program, cfg), num_stages=2)
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in program.state.items()}
    runners = [StageRunner(plan, s, state) for s in plan.stages]
    sent = runners[0].forward(0, mb, {})
    grads_in = runners[1].forward(0, mb, sent)
    grads = runners[1].backward(0, {})
    runners[0].backward(0, grads)
    received = [{}, sent]
    out_grads = [grads, {}]
    rows = []
    for k, r in enumerate(runners):
        times = {"B": [], "I": [], "W": []}
        for i in range(2 + args.repeats):
            r.forward(0, mb, received[k])
            t0 = time.perf_counter()
            r.backward(0, out_grads[k])
            t1 = time.perf_counter()
            r.forward(0, mb, received[k])
            t2 = time.perf_counter()
            r.backward_input(0, out_grads[k])
            t3 = time.perf_counter()
            r.backward_weight(0)
            t4 = time.perf_counter()
            if i >= 2:
                times["B"].append(t1 - t0)
                times["I"].append(t3 - t2)
                times["W"].append(t4 - t3)
        med = {k2: statistics.median(v) * 1e3 for k2, v in times.items()}
        rows.append((k, med))
    del grads_in
    lines = [f"# Zero-bubble split: I + W vs B", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread. "
             f"HF GPT-2 {LAYERS} layers h=256 s={SEQ} V=50257, microbatch 2, two stages; "
             f"medians of {args.repeats}.", "",
             "| stage | B ms | I ms | W ms | (I + W) / B |", "|---|---|---|---|---|"]
    for k, m in rows:
        lines.append(f"| {k} | {m['B']:.1f} | {m['I']:.1f} | {m['W']:.1f} | {(m['I'] + m['W']) / m['B']:.3f} |")
    total = sum(m["I"] + m["W"] for _, m in rows) / sum(m["B"] for _, m in rows)
    lines += ["", f"Whole model: (I + W) / B = **{total:.3f}** (target <= 1.15; before the split: 1.64)."]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "zb_split.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
