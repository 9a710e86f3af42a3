"""End to end, as users would run it: fxpipe vs torch.distributed.pipelining vs one process.

    .venv/bin/python benchmarks/bench_runtime.py [--steps 10] [--pp 2]

HF GPT-2 config (8 layers, h=256, 4 heads, s=128, V=50257), m=8 microbatches of 2
sequences, one thread per process, gloo. Side by side in one run, same model,
batch and threads:

- **fxpipe**: ``fxpipe.parallelize(model, pp=P, microbatches=8, ...)`` with its
  defaults (ILP partition on costs measured on the ranks, 1F1B);
- **torch.distributed.pipelining** set up as its documentation shows: ``pipeline()``
  with a ``SplitPoint`` at the middle layer (an even layer split), ``build_stage``,
  ``Schedule1F1B``. Where the traced split sends a tensor that cannot carry a gradient
  (transformers 5 builds GPT-2's causal mask as a bool tensor, and PipelineStage
  makes every received tensor require grad), the same even layer split is cut by
  fxpipe's ``uniform`` partition and its stage graphs run by ``PipelineStage`` +
  ``Schedule1F1B`` instead — the result file says which ran;
- **one process** with gradient accumulation over the same 8 microbatches.

Prints the median step times, the three ratios the balance issue sets targets for
(stage imbalance <= 1.10, speed-up over one process >= 1.70x at pp=2, fxpipe <= 0.60x
the even-split pipeline), fxpipe's per-stage predicted vs measured times, and writes
benchmarks/results/runtime_pp{P}.md. Medians over --steps after 2 warm-up steps.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

M, B_MICRO, SEQ, LAYERS, HIDDEN, HEADS, VOCAB = 8, 2, 128, 8, 256, 4, 50257
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def workload():
    from fxpipe.losses import causal_lm_loss
    from fxpipe.models.hf import _gpt2

    torch.manual_seed(0)
    model = _gpt2(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    ids = torch.randint(0, VOCAB, (M * B_MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone()), causal_lm_loss


class _StageModule(nn.Module):
    """One stage GraphModule of an even-layer fxpipe plan as the nn.Module that
    torch.distributed.pipelining's PipelineStage drives (the fallback below). Batch
    inputs a later stage reads (labels) come from ``self.microbatches`` in microbatch
    order, as 1F1B runs each stage's forwards in that order."""

    def __init__(self, plan, stage, state):
        super().__init__()
        self.plan, self.stage = plan, stage
        self.names = plan.stage_params(stage.index)
        self.params = nn.ParameterList([nn.Parameter(state[n].detach().clone()) for n in self.names])
        self.microbatches: list = []
        self.calls = 0

    def forward(self, *received):
        state = dict(zip(self.names, self.params))
        batch = self.microbatches[self.calls % len(self.microbatches)]
        self.calls += 1
        out = self.stage.call(state, self.plan.canonical, batch, dict(zip(self.stage.inputs, received)))
        if self.stage.is_last:  # pipelining concatenates last-stage outputs: no 0-d tensors
            return out[-1].reshape(1)
        return out[0] if len(out) == 1 else out


def _non_float_crossings(pipe) -> list[str]:
    """Values a traced pipeline sends between stages that cannot carry a gradient:
    PipelineStage makes every received tensor require grad, which fails for them."""
    bad = []
    for k, (_, mod) in enumerate(pipe.split_gm.named_children()):
        for n in mod.graph.nodes:
            val = n.meta.get("val")
            if k and n.op == "placeholder" and isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
                bad.append(f"{n.name} ({val.dtype}) into stage {k}")
    return bad


class Logits(nn.Module):
    """What a user hands to ``pipeline()``: the HF model returning its logits tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _time(fn, steps, each=None):
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if each is not None:
            each()
    return statistics.median(times)


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import fxpipe
    from fxpipe.runtime.balance import BalanceMeter
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    model, batch, loss_fn = workload()
    t = time.perf_counter()
    pm = fxpipe.parallelize(model, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn)
    setup = time.perf_counter() - t
    meter = BalanceMeter()
    fx_time = _time(lambda: pm.train_step(batch), steps, lambda: meter.add(pm.last_stats.events))

    # torch.distributed.pipelining as documented: trace, split at the middle layer(s).
    from torch.distributed.pipelining import PipelineStage

    model2, _, _ = workload()
    cuts = {f"model.transformer.h.{LAYERS * k // world}": SplitPoint.BEGINNING for k in range(1, world)}
    pipe = pipeline(Logits(model2), mb_args=(batch[0][:B_MICRO],), split_spec=cuts)
    blocked = _non_float_crossings(pipe)

    def lm_loss(logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1))

    if not blocked:
        how = "pipeline() + SplitPoint at the middle layer"
        sched = Schedule1F1B(pipe.build_stage(rank, torch.device("cpu")), n_microbatches=M, loss_fn=lm_loss)

        def pippy_step():
            if rank == 0:
                sched.step(batch[0])
            elif rank == world - 1:
                sched.step(target=batch[1])
            else:
                sched.step()
    else:
        # The same even layer split, cut by fxpipe's uniform (Megatron-style) partition,
        # each stage's graph run by PipelineStage + Schedule1F1B.
        how = ("PipelineStage + Schedule1F1B on the even layer split (pipeline() traced, but "
               f"{', '.join(blocked)} crosses the split and PipelineStage requires grad on received tensors)")
        model3, _, _ = workload()
        even = fxpipe.parallelize(model3, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                                  partition="uniform", costs="model")
        module = _StageModule(even.plan, even.plan.stages[rank], even.state)
        sched = Schedule1F1B(PipelineStage(module, rank, world, torch.device("cpu")), n_microbatches=M,
                             loss_fn=lambda loss, target: loss.sum())
        micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]
        dummy = torch.zeros(M * B_MICRO)

        def pippy_step():
            module.microbatches, module.calls = micro, 0
            if rank == 0:
                sched.step(batch[0])
            elif rank == world - 1:
                sched.step(target=dummy)
            else:
                sched.step()

    pippy_time = _time(pippy_step, steps)
    torch.save(dict(fx=fx_time, pippy=pippy_time, setup=setup, balance=meter.summary(), how=how,
                    partition=pm.partition if rank == 0 else None),
               os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def single_process(steps: int) -> float:
    torch.set_num_threads(1)
    model, batch, loss_fn = workload()
    micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]

    def step():
        for ids, labels in micro:
            (loss_fn(model(ids), labels) / M).backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_result(name: str, text: str) -> None:
    """Print ``text`` and write it to benchmarks/results/``name``."""
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as f:
        f.write(text)


def main() -> None:
    from fxpipe.runtime.balance import balance, balance_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
               f"{args.pp} processes x 1 thread, gloo")
    print(f"machine: {machine}")
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(worker, args=(args.pp, port, args.steps, out), nprocs=args.pp, start_method="spawn")
        res = [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(args.pp)]
    single = single_process(args.steps)
    fx = max(r["fx"] for r in res)
    pippy = max(r["pippy"] for r in res)
    rows, imbalance = balance(res[0]["partition"], [r["balance"] for r in res])
    ideal = args.pp * M / (M + args.pp - 1)
    lines = [
        f"# End to end: fxpipe vs torch.distributed.pipelining vs one process (pp={args.pp})", "",
        f"Machine: {machine}. HF GPT-2 {LAYERS} layers, h={HIDDEN}, s={SEQ}, V={VOCAB}; "
        f"m={M} microbatches of {B_MICRO}; medians of {args.steps} steps after 2 warm-ups.", "",
        "| | median step ms |", "|---|---|",
        f"| fxpipe.parallelize (defaults: measured costs, ILP, 1F1B) | {fx * 1e3:.1f} |",
        f"| torch.distributed.pipelining, even layer split, 1F1B | {pippy * 1e3:.1f} |",
        f"| one process, gradient accumulation | {single * 1e3:.1f} |", "",
        f"- measured stage imbalance (max/mean busy time): **{imbalance:.3f}** (target <= 1.10)",
        f"- speed-up over one process: **{single / fx:.3f}x** (ideal 1F1B {ideal:.2f}x; target >= 1.70x at pp=2)",
        f"- fxpipe / even-split pipelining step time: **{fx / pippy:.3f}** (target <= 0.60)",
        f"- torch.distributed.pipelining speed-up over one process: {single / pippy:.3f}x",
        f"- fxpipe setup (capture, cost measurement, partition, split): {max(r['setup'] for r in res):.1f} s",
        f"- torch.distributed.pipelining set up as: {res[0]['how']}",
        "", "```", balance_table(rows, imbalance), "```", ""]
    write_result(f"runtime_pp{args.pp}.md", "\n".join(lines))


if __name__ == "__main__":
    main()
