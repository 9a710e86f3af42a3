"""The layout search against measurement: every layout of a world, predicted and timed.

    .venv/bin/python benchmarks/bench_auto_layout.py [--world 2] [--models gpt-tiny hf:llama ...] [--hardware H]

For each model the search (``fxpipe/planner/auto_layout.py``) prices every layout of
``--world`` ranks for one global batch; then every layout it priced is built with
``fxpipe.parallelize`` in one gloo world (the same config the search priced: measured or modelled costs,
chain-DP partition) and trained for ``--steps`` steps per round, in ``--rounds``
interleaved rounds (every layout once per round, so drift hits all alike). The table
shows each layout's measured median step beside the prediction, the search's choice
against the best measured layout, and the Spearman rank correlation of predicted and
measured times. CPU figures: only ratios mean anything here.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxpipe.ir.parallel_config import ParallelConfig  # noqa: E402
from fxpipe.models.registry import build_workload  # noqa: E402
from fxpipe.planner.auto_layout import SEARCHED, search_layout  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_auto_layout.txt")


def wide_gpt():
    """A model whose LM head dominates (V = 16384 over width 64, two layers), for
    ``--models bench_auto_layout:wide_gpt``: a batch of 8 sequences of 64 tokens."""
    from fxpipe.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16384, block_size=64, n_layer=2, n_head=4, n_embd=64))
    ids = torch.randint(0, 16384, (8, 65))
    return model, (ids[:, :-1], ids[:, 1:])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args, layouts: list[dict], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    import fxpipe

    w = build_workload(args.model, batch=args.batch, seq=args.seq, seed=0)
    models = []
    for fields in layouts:
        model = build_workload(args.model, batch=args.batch, seq=args.seq, seed=0).model
        pm = fxpipe.parallelize(model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs=args.costs,
                                partition="dp", hardware=args.hardware, **fields)
        pm.train_step(w.example_inputs)  # warm-up: first-step allocations
        models.append(pm)
    times: list[list[float]] = [[] for _ in layouts]
    for _ in range(args.rounds):
        for i, pm in enumerate(models):
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                pm.train_step(w.example_inputs)
                times[i].append(time.perf_counter() - start)
    if rank == 0:
        out["times"] = [statistics.median(t) for t in times]
    for pm in models:
        pm.close()
    dist.destroy_process_group()


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def bench(args) -> list[str]:
    w = build_workload(args.model, batch=args.batch, seq=args.seq, seed=0)
    # The ranks run one thread each (_worker): the search times compute as they will run it,
    # and with more ranks than cores it prices the cores they share.
    cores = os.cpu_count() or 1
    found = search_layout(w.model, w.example_inputs, args.world, loss_fn=w.loss_fn,
                          base=ParallelConfig(costs=args.costs, hardware=args.hardware), threads=1,
                          concurrent=cores if args.world > cores else None)
    layouts = [{f: getattr(p.config, f) for f in SEARCHED} for p in found.ranked]
    layouts = [dict(f, microbatches=f.pop("num_microbatches")) for f in layouts]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(args.world, _port(), args, layouts, out), nprocs=args.world,
                           start_method="spawn")
        measured = list(out["times"])
    predicted = [p.step_s for p in found.ranked]
    best = min(range(len(measured)), key=measured.__getitem__)
    lines = [f"## {args.model}, world {args.world}, batch {args.batch}x{args.seq}, hardware {args.hardware}: "
             f"{len(layouts)} layouts, costs {args.costs} "
             f"(search {found.seconds:.1f} s; {len(found.refused)} refused)",
             f"{'layout':<44} {'predicted ms':>12} {'measured ms':>12}"]
    for i, p in enumerate(found.ranked):
        mark = "chosen" if i == 0 else ("best measured" if i == best else "")
        lines.append(f"{p.describe():<44} {1e3 * predicted[i]:12.2f} {1e3 * measured[i]:12.2f}  {mark}")
    lines.append(f"chosen measured {1e3 * measured[0]:.2f} ms, best measured {1e3 * measured[best]:.2f} ms "
                 f"({found.ranked[best].describe()}): chosen / best = {measured[0] / measured[best]:.3f}; "
                 f"Spearman rank correlation predicted vs measured {_spearman(predicted, measured):.3f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["gpt-tiny", "hf:llama", "hf:gpt2", "zoo:moe", "zoo:llama3",
                                                    "bench_auto_layout:wide_gpt"],
                   help="registry names, or module:function (bench_auto_layout:wide_gpt: a large vocabulary; "
                        "its batch is fixed at 8x64); default: a registry GPT, an untied and a tied HF model, "
                        "an MoE, a zoo Llama and a large vocabulary")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default=RESULTS, help="results file (default: %(default)s)")
    p.add_argument("--costs", default="measure", choices=("measure", "model"),
                   help="what the search prices compute by, and the layouts are partitioned on: timed at each "
                        "layout's shard shapes, or the cost model with --hardware (default: %(default)s)")
    p.add_argument("--hardware", default="cpu",
                   help="the cost model's preset or a `fxpipe calibrate` profile (default: %(default)s)")
    args = p.parse_args()
    head = (f"# bench_auto_layout — {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cpus, "
            f"torch {torch.__version__}; command: benchmarks/bench_auto_layout.py {' '.join(sys.argv[1:])}")
    lines = [head]
    print(head, flush=True)
    for model in args.models:
        for line in bench(argparse.Namespace(**{**vars(args), "model": model})):
            print(line, flush=True)
            lines.append(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
