"""What owning the head's rows per rank changes in the work: the same partition run with
and without ``passes/vocab_rows.py``, and one process, in interleaved rounds.

    .venv/bin/python benchmarks/bench_vocab_rows.py [--steps 4] [--pp 2]

The model of ``bench_runtime.py`` (HF GPT-2, 8 layers, h=256, V=50257, tied), m=8,
1F1B, the ILP on the cost model (so both variants get the same cut), one thread per
process, gloo. Each round times one step of each variant back to back and one step of
the one-process job (the pipeline ranks idle meanwhile). Prints, per variant, the
median step time and the busy time summed over the ranks (F, B, I, W actions) per
step, against the one process: the work the split adds. On a shared machine the
times move with the load; only ratios within a round mean anything.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fxpipe.runtime.local_world import run_local_world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _busy(pm) -> float:
    """Seconds this rank spent in F/B/I/W actions during the last step."""
    from fxpipe.schedules.actions import ActionKind as K

    return sum(end - start for action, start, end in pm.last_stats.events if action.kind in (K.F, K.B, K.I, K.W))


def worker(rank: int, world: int, steps: int, out: str) -> None:
    import fxpipe
    import fxpipe.compiler.pass_list as compiler  # the pipeline reads its PIPELINE at each compile
    from bench_runtime import M, workload

    models = {}
    pipeline = compiler.PIPELINE
    for variant in ("rows", "whole"):
        # "whole": the pipeline without the vocab_rows step, i.e. every rank reading a
        # block of the head holds the whole tied table (the code before the pass).
        compiler.PIPELINE = pipeline if variant == "rows" else tuple(p for p in pipeline if p.name != "vocab_rows")
        model, batch, loss_fn = workload()
        pm = fxpipe.parallelize(model, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                                costs="model")
        models[variant] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), batch)
    compiler.PIPELINE = pipeline
    single, sbatch, sloss = workload()
    sopt = torch.optim.AdamW(single.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"rows": [], "whole": [], "alone": []}
    busy: dict[str, list[float]] = {"rows": [], "whole": []}
    for step in range(steps + 1):
        for variant, (pm, opt, batch) in models.items():
            dist.barrier()
            t = time.perf_counter()
            pm.train_step(batch)
            opt.step()
            dist.barrier()
            total = torch.tensor([_busy(pm)], dtype=torch.float64)
            dist.all_reduce(total)
            if step:
                times[variant].append(time.perf_counter() - t)
                busy[variant].append(float(total))
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:  # the one-process job, alone on the machine
            sopt.zero_grad()
            for ids, labels in zip(sbatch[0].chunk(M), sbatch[1].chunk(M)):
                (sloss(single(ids), labels) / M).backward()
            sopt.step()
        dist.barrier()
        if step:
            times["alone"].append(time.perf_counter() - t)
    if rank == 0:
        rows = models["rows"][0].plan.row_shards
        torch.save(dict(times=times, busy=busy, rows={n: r.ranks for n, r in rows.items()}),
                   os.path.join(out, "result.pt"))
    for pm, _, _ in models.values():
        pm.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        run_local_world(args.pp, worker, args.steps, out, timeout=timedelta(seconds=600), threads=1)
        res = torch.load(os.path.join(out, "result.pt"), weights_only=False)
    times, busy = res["times"], res["busy"]
    print(f"pp={args.pp}, m=8, 1F1B, ILP on the cost model; rows owned: {res['rows']}")
    print(f"{args.steps} rounds after 1 warm-up; medians, ratios are medians of per-round ratios")
    print("| variant | step ms | busy ms summed over ranks | busy / one process | step / one process |")
    print("|---|---|---|---|---|")
    alone = times["alone"]
    for variant in ("whole", "rows"):
        r_busy = statistics.median(b / a for b, a in zip(busy[variant], alone))
        r_step = statistics.median(t / a for t, a in zip(times[variant], alone))
        print(f"| {variant} | {statistics.median(times[variant]) * 1e3:.0f} | "
              f"{statistics.median(busy[variant]) * 1e3:.0f} | {r_busy:.3f} | {r_step:.3f} |")
    print(f"| one process | {statistics.median(alone) * 1e3:.0f} | | 1 | 1 |")
    print("rows / whole, per round: busy " + " ".join(f"{a / b:.3f}" for a, b in zip(busy["rows"], busy["whole"]))
          + "; step " + " ".join(f"{a / b:.3f}" for a, b in zip(times["rows"], times["whole"])))


if __name__ == "__main__":
    main()
