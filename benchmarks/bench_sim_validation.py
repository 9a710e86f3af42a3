"""Does the simulator predict a step it has not seen? Held-out validation at p=4.

    .venv/bin/python benchmarks/bench_sim_validation.py [--steps 6] [--pp 4]

HF GPT-2 (8 layers, h=256, s=128, V=50257), m=8 microbatches of 2, an uneven split
on purpose (``partition="uniform"``: equal layer counts, so the stage holding the
50257-way LM head and loss is the slowest — with one dominant stage the schedules
differ only through their dependencies, which is what is being tested), 1 thread
per process. For 1F1B, interleaved 1F1B (2 chunks) and ZB-H1:

- run --steps timed steps after 2 warm-ups, recording every rank's action times;
- predict the *last* step from the per-stage F / B / I / W medians of the *other*
  steps (schedules/simulate.py, compute only) and compare with its measured makespan
  (first compute start to last compute end over all ranks, one monotonic clock);
- beside it, the cost model alone (the CPU preset's FLOP/byte estimate, no measurement).

Writes benchmarks/results/sim_validation.md. With more processes than cores the
ranks share cores; the measured durations then include that sharing and the
simulator (one device per rank) is asked to predict a contended machine — said in
the results file.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from fxpipe.runtime.local_world import run_local_world

from bench_runtime import LAYERS, M, SEQ, workload, write_result

SCHEDULES = [("1f1b", None), ("interleaved", 2), ("zb-h1", None)]


def worker(rank: int, world: int, steps: int, out: str) -> None:
    import fxpipe

    results = {}
    for name, chunks in SCHEDULES:
        model, batch, loss_fn = workload()
        pm = fxpipe.parallelize(model, pp=world, microbatches=M, schedule=name, chunks=chunks,
                                example_inputs=batch, loss_fn=loss_fn, partition="uniform", costs="model")
        for _ in range(2):
            pm.train_step(batch)
        per_step = []
        for _ in range(steps):
            dist.barrier()
            pm.train_step(batch)
            per_step.append([(str(a), s, e) for a, s, e in pm.last_stats.events if a.kind.is_compute])
        gathered = [None] * world
        dist.all_gather_object(gathered, per_step)
        if rank == 0:
            results[name] = dict(steps=gathered, schedule=pm.schedule, partition=pm.partition)
    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


def predict(schedule, steps_by_rank, held_out: int):
    """Simulated makespan of ``held_out`` from the other steps' per-stage medians, and its
    measured makespan."""
    from fxpipe.schedules.actions import Action
    from fxpipe.schedules.simulate import StageDurations, simulate

    n = schedule.num_stages
    samples = {k: [[] for _ in range(n)] for k in "FBIW"}
    for rank in steps_by_rank:
        for i, step in enumerate(rank):
            if i == held_out:
                continue
            for a, s, e in step:
                act = Action.parse(a)
                samples[act.kind.name][act.stage].append(e - s)
    med = {k: [statistics.median(v) * 1e3 if v else 0.0 for v in per] for k, per in samples.items()}
    if schedule.splits_backward:
        backward = [i + w for i, w in zip(med["I"], med["W"])]
        weight = med["W"]
    else:
        backward = med["B"]
        weight = [b / 2 for b in backward]
    sim = simulate(schedule.compute_only(), StageDurations(forward=med["F"], backward=backward, weight=weight))
    events = [e for rank in steps_by_rank for e in rank[held_out]]
    measured = (max(e for _, _, e in events) - min(s for _, s, _ in events)) * 1e3
    return sim.makespan, measured


def model_only(schedule, partition) -> float:
    from fxpipe.schedules.simulate import StageDurations, simulate

    f = [c.fwd_s * 1e3 for c in partition.stages]
    b = [c.bwd_s * 1e3 for c in partition.stages]
    return simulate(schedule.compute_only(), StageDurations(forward=f, backward=b, weight=[x / 2 for x in b])).makespan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pp", type=int, default=4)
    args = ap.parse_args()
    cores = os.cpu_count()
    machine = (f"{platform.machine()}, {cores} cores, torch {torch.__version__}; {args.pp} processes x 1 "
               f"thread, gloo" + (" (more processes than cores: ranks share cores)" if args.pp > cores else ""))
    print(f"machine: {machine}")
    with tempfile.TemporaryDirectory() as out:
        run_local_world(args.pp, worker, args.steps, out, timeout=timedelta(seconds=300), threads=1)
        res = torch.load(os.path.join(out, "results.pt"), weights_only=False)
    lines = ["# Simulator validation: a held-out step predicted from the other steps", "",
             f"Machine: {machine}. HF GPT-2 {LAYERS} layers h=256 s={SEQ} V=50257, p={args.pp}, m={M}, "
             f"uneven split (partition='uniform'); {args.steps} timed steps after 2 warm-ups, the last held out.",
             "", "| schedule | measured ms | predicted from other steps ms | error | cost model alone ms | error |",
             "|---|---|---|---|---|---|"]
    for name, _ in SCHEDULES:
        r = res[name]
        sim, measured = predict(r["schedule"], r["steps"], args.steps - 1)
        model = model_only(r["schedule"], r["partition"])
        lines.append(f"| {name} | {measured:.1f} | {sim:.1f} | {abs(sim - measured) / measured:.1%} | "
                     f"{model:.1f} | {abs(model - measured) / measured:.1%} |")
    write_result(f"sim_validation_pp{args.pp}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
