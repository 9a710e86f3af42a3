"""A stage's time as the search times it (group by group) against the stage run whole.

    .venv/bin/python benchmarks/bench_group_timing.py [--models deep-narrow gpt-tiny zoo:llama3] [--repeats 15]

The layout search prices a stage as the sum of its probe groups' times (``costs/local.py``,
``costs/measure.py``), each group run alone by the runtime's stage runner; the runtime runs
the stage as one action. Per model, at pp = 2 with 4 microbatches of the benchmark batch
(16 × 32 tokens, as ``bench_auto_layout.py``), one thread, for each stage: the groups'
sum with the runner's fixed cost left in every group (``gross``), net of it (``net``, what
the search prices now), both summed over the same split's nodes, the fixed cost itself,
and the stage run whole by the same runner
(``whole``, median of ``--repeats``, after two warm-ups). The price adds the runtime's cost
per action on top of ``net`` (``Hardware.action_overhead_s``). Times are this thread's CPU
seconds, as the search reads them; the load is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxpipe.costs.measure as measure  # noqa: E402
from benchmarks.bench_auto_layout import workload  # noqa: E402
from fxpipe.base.cpu_memory import keep_freed_blocks  # noqa: E402
from fxpipe.compiler.pipeline import compile_program  # noqa: E402
from fxpipe.ir.parallel_config import ParallelConfig  # noqa: E402
from fxpipe.params.rank_state import ShardBuilder  # noqa: E402
from fxpipe.planner.layout_costs import RESUME_AT, CaptureCosts  # noqa: E402
from fxpipe.runtime.stage_runner import StageRunner  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_group_timing.md")
M, BATCH, SEQ = 4, 16, 32


def searched(model: str):
    """The pp = 2 compile the search prices, and per stage (forward, backward) summed over its
    nodes from the search's timing with the runner's fixed cost left in every group
    (``gross``, as before it was subtracted) and net of it (``net``), on the same split."""
    real = measure.runner_fixed_cost
    w = workload(model, BATCH, SEQ)
    config = ParallelConfig(pp=2, num_microbatches=M, partition="dp").with_world(2)
    rows = BATCH // M
    costs = CaptureCosts(w.model, w.example_inputs, ParallelConfig(), w.loss_fn, measure=True, threads=1)
    compiled = compile_program(costs.prefix(config, rows), config, hooks=costs.hooks(config, rows), resume=RESUME_AT)
    net = costs._timed(config, rows)
    measure.runner_fixed_cost = lambda *a, **k: (0.0, 0.0, 0.0, 0.0)
    try:
        gross = CaptureCosts(w.model, w.example_inputs, ParallelConfig(), w.loss_fn, measure=True,
                             threads=1)._timed(config, rows)
    finally:
        measure.runner_fixed_cost = real
    stage_of = compiled.program.stages
    sums = []
    for times in (gross, net):
        per = [[0.0, 0.0] for _ in range(config.num_stages)]
        for node, (f, b) in times.fused.items():
            if node in stage_of:
                per[stage_of[node]][0] += f
                per[stage_of[node]][1] += b
        sums.append(per)
    return sums[0], sums[1], compiled, w


def whole(compiled, w, repeats: int) -> list[tuple[float, float]]:
    """(forward, backward) per stage, each stage run whole by the runtime's runner."""
    plan, program = compiled.plan, compiled.program
    shards = ShardBuilder(program, program.tp_specs, w.model, tp_rank=0, device=torch.device("cpu"), seed=0)
    names = [p for s in range(plan.num_stages) for p in plan.stage_params(s)]
    tensors, gen = shards.tensors(names), torch.Generator().manual_seed(0)
    batch = tuple(t[:BATCH // M] for t in w.example_inputs)
    specs = {lk.name: lk.spec for lk in plan.lookups}
    cpu = torch.device("cpu")
    out = []
    for stage in plan.stages:
        runner = StageRunner(plan, stage, tensors, loss_scale=1.0)
        f, b = [], []
        for i in range(repeats + 2):
            got = {n: measure._synthetic(plan.values[n].spec if n in plan.values else specs[n], cpu, gen)
                   for n in (*stage.inputs, *stage.lookups)}
            t = time.thread_time()
            runner.forward(0, batch, got)
            t1 = time.thread_time()
            grads = {n: measure._synthetic(plan.values[n].spec, cpu, gen) for n in stage.outputs
                     if plan.values[n].requires_grad}
            t2 = time.thread_time()
            runner.backward(0, grads)
            t3 = time.thread_time()
            if i >= 2:
                f.append(t1 - t)
                b.append(t3 - t2)
        out.append((statistics.median(f), statistics.median(b)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["deep-narrow", "gpt-tiny", "zoo:llama3"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--output", default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_blocks()  # as every CPU rank runs
    load = os.getloadavg()[0]
    lines = [f"# Group timing against the stage run whole (benchmarks/bench_group_timing.py), "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             f"{platform.machine()}, {os.cpu_count()} cores, 1 thread, torch {torch.__version__}; load average "
             f"{load:.1f} at the start; pp=2, {M} microbatches of {BATCH // M} x {SEQ} tokens; thread CPU ms",
             "", "| model | stage | phase | groups gross | groups net (priced) | whole | gross / whole | net / whole |",
             "|---|---|---|---|---|---|---|---|"]
    fixed = None
    for model in args.models:
        gross, net, compiled, w = searched(model)
        ran = whole(compiled, w, args.repeats)
        if fixed is None:
            fixed = measure.runner_fixed_cost(compiled.plan, torch.device("cpu"), cpu_time=True)
        for s, (g, n, r) in enumerate(zip(gross, net, ran)):
            for k, phase in enumerate(("forward", "backward")):
                lines.append(f"| {model} | {s} | {phase} | {1e3 * g[k]:.2f} | {1e3 * n[k]:.2f} | {1e3 * r[k]:.2f} | "
                             f"{g[k] / r[k]:.2f} | {n[k] / r[k]:.2f} |")
        print("\n".join(lines[-4:]), flush=True)
    lines += ["", f"The runner's fixed cost (a stage computing next to nothing): forward {1e6 * fixed[0]:.0f} us, "
              f"backward {1e6 * fixed[1]:.0f} us, input half {1e6 * fixed[2]:.0f} us, weight half "
              f"{1e6 * fixed[3]:.0f} us. Load average at the end: {os.getloadavg()[0]:.1f}."]
    with open(args.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(lines[-1])


if __name__ == "__main__":
    main()
