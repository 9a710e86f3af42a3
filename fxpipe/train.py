"""The training job behind ``fxpipe run``: one function per rank, plus the launcher.

``fxpipe run`` without torchrun's environment starts tp·pp·dp worker processes
itself through torch.distributed's elastic launcher — the code path torchrun uses,
so ``torchrun --nproc-per-node N -m fxpipe run ...`` (and multi-node rendezvous)
run the same worker function.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "gpt-small"
    """Model registry name (see ``fxpipe compile --help``)."""
    tp: int = 1
    pp: int = 2
    dp: int = 1
    schedule: str = "1f1b"
    chunks: int | None = None
    """Stages per pipeline rank (interleaved / V schedules); None: the schedule's default."""
    microbatches: int = 4
    micro_batch_size: int = 4
    global_batch: int | None = None
    """Sequences per step; default micro_batch_size · microbatches · dp."""
    seq: int = 128
    steps: int = 80
    lr: float = 2e-3
    warmup: int = 5
    """Linear learning-rate warm-up steps."""
    seed: int = 0
    log_interval: int = 10
    partition: str = "ilp"
    timeline: str | None = "fxpipe-timeline"
    """Path prefix for the measured timeline of the last step (.json Perfetto, .png); None: off."""
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.global_batch is not None:
            per_step = self.micro_batch_size * self.microbatches * self.dp
            if self.global_batch != per_step:
                raise ValueError(
                    f"global batch {self.global_batch} != micro-batch size · microbatches · dp = "
                    f"{self.micro_batch_size}·{self.microbatches}·{self.dp} = {per_step}; "
                    f"set --microbatches {self.global_batch // (self.micro_batch_size * self.dp)} "
                    f"if it divides evenly")
        for name in ("tp", "pp", "dp", "microbatches", "micro_batch_size", "seq", "steps", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def batch(self) -> int:
        return self.micro_batch_size * self.microbatches * self.dp


def _progress(step: int, total: int, loss: float, width: int = 30) -> None:
    if not sys.stderr.isatty():
        return
    done = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f}")
    sys.stderr.flush()
    if step == total:
        sys.stderr.write("\n")


def _bubble(events: tuple, start: float, end: float) -> float:
    """Idle share of this rank's step: 1 − (compute time / step wall time)."""
    busy = sum(e - s for a, s, e in events if a.kind.is_compute)
    return max(0.0, 1.0 - busy / max(end - start, 1e-12))


def worker(config: TrainConfig) -> dict[str, Any]:
    """One rank of the job (what torchrun or the elastic launcher starts)."""
    from fxpipe.data import ByteBatches, stdlib_corpus
    from fxpipe.models import build_workload
    from fxpipe.runtime.api import parallelize

    torch.manual_seed(config.seed)
    if not torch.cuda.is_available():  # share the cores between the local workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    w = build_workload(config.model, batch=config.batch, seq=config.seq, seed=config.seed)
    data = ByteBatches(stdlib_corpus(), config.batch, config.seq, seed=config.seed)
    first = w.batch_from_tokens(torch.cat(data.batch(0), dim=1)[:, :config.seq + 1])
    pm = parallelize(w.model, tp=config.tp, pp=config.pp, dp=config.dp,
                     microbatches=config.microbatches, schedule=config.schedule, chunks=config.chunks,
                     example_inputs=first, loss_fn=w.loss_fn, partition=config.partition,
                     timeout_s=config.timeout_s)
    rank = dist.get_rank()
    opt = torch.optim.AdamW(pm.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / config.warmup))
    costs = pm.plan.program.costs.values()
    # Model FLOPs per step (Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) for a GPT, here
    # summed from the cost pass, so any model gets it): matmul forward + backward.
    flops_per_step = sum(c.fwd_flops + c.bwd_flops for c in costs) * config.microbatches * config.dp
    tokens_per_step = config.batch * config.seq
    if rank == 0:
        print(f"fxpipe run: {config.model}, {pm.plan.program.num_parameters() / 1e6:.2f}M parameters, "
              f"tp={config.tp} pp={config.pp} dp={config.dp}, schedule {config.schedule}, "
              f"{config.microbatches} microbatches × {config.micro_batch_size} × {config.seq} tokens, "
              f"{config.steps} steps", flush=True)
    times, losses, bubbles = [], [], []
    t_start = time.perf_counter()
    for step in range(config.steps):
        inputs, targets = data.batch(step)
        tokens = torch.cat([inputs, targets[:, -1:]], dim=1)
        batch = w.batch_from_tokens(tokens)
        t0 = time.perf_counter()
        loss = pm.train_step(batch)
        opt.step()
        sched.step()
        t1 = time.perf_counter()
        if not torch.isfinite(torch.tensor(loss)):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or check the data")
        bubble = torch.tensor([_bubble(pm.last_stats.events, t0, t1)], dtype=torch.float64)
        dist.all_reduce(bubble)
        times.append(t1 - t0)
        losses.append(loss)
        bubbles.append(float(bubble) / dist.get_world_size())
        if rank == 0:
            _progress(step + 1, config.steps, loss)
            if (step + 1) % config.log_interval == 0 or step == 0:
                ms = (t1 - t0) * 1e3
                tflops = flops_per_step / (t1 - t0) / dist.get_world_size() / 1e12
                print(f"iter {step + 1:5d} | loss {loss:.4f} | {ms:8.1f} ms/iter | "
                      f"{tokens_per_step / (t1 - t0):9.0f} tokens/s | {tflops:.4f} TFLOP/s/process | "
                      f"bubble {bubbles[-1]:.1%}", flush=True)
    _write_timeline(pm, config)
    summary = dict(first_loss=losses[0], final_loss=losses[-1], median_ms=statistics.median(times) * 1e3,
                   tokens_per_s=tokens_per_step / statistics.median(times),
                   tflops_per_process=flops_per_step / statistics.median(times) / dist.get_world_size() / 1e12,
                   bubble=statistics.median(bubbles), wall_s=time.perf_counter() - t_start)
    if rank == 0:
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {config.steps} steps, "
              f"{summary['wall_s']:.1f} s; median {summary['median_ms']:.1f} ms/iter, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['tflops_per_process']:.4f} TFLOP/s/process, "
              f"bubble {summary['bubble']:.1%}", flush=True)
    return summary


def _write_timeline(pm: Any, config: TrainConfig) -> None:
    """Gather the last step's per-action times from every pipeline rank; rank 0 draws them."""
    if config.timeline is None:
        return
    from fxpipe.schedules.render.gantt import render_gantt
    from fxpipe.schedules.render.trace import render_trace
    from fxpipe.schedules.timeline import Timeline

    events = [None] * config.pp
    dist.all_gather_object(events, pm.last_stats.events, group=pm.groups.pp_group)
    if dist.get_rank() != 0:
        return
    t0 = min(s for rank in events for _, s, _ in rank)
    per_rank = [[(a, (s - t0) * 1e3, (e - t0) * 1e3) for a, s, e in rank if a.kind.is_compute]
                for rank in events]
    timeline = Timeline.from_events(per_rank, unit="ms", num_chunks=pm.schedule.num_chunks,
                                    title=f"measured {config.schedule} p={config.pp} m={config.microbatches}")
    render_trace(timeline, config.timeline + ".json")
    render_gantt(timeline, config.timeline + ".png")
    print(f"timeline of the last step: {config.timeline}.json (Perfetto), {config.timeline}.png", flush=True)


def _elastic_entry(config: TrainConfig) -> dict[str, Any]:
    try:
        return worker(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(config: TrainConfig) -> int:
    """Run the job: directly under torchrun, else spawn tp·pp·dp local workers."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _elastic_entry(config)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=config.world_size,
                              run_id=f"fxpipe-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                              start_method="spawn")
    try:
        elastic_launch(launch_cfg, _elastic_entry)(config)
    except ChildFailedError as exc:
        print(f"fxpipe run: a worker failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def preflight(config: TrainConfig) -> None:
    """Check what can be checked before any process starts (bad flags fail fast)."""
    from fxpipe.models.registry import GPT_CONFIGS, model_names
    from fxpipe.schedules.registry import generate, get_spec

    if config.model not in model_names() and ":" not in config.model:
        raise ValueError(f"unknown model {config.model!r}; valid names: {', '.join(model_names())}")
    cfg = GPT_CONFIGS.get(config.model)
    if cfg is not None and config.seq > cfg.block_size:
        raise ValueError(f"--seq {config.seq} exceeds {config.model}'s block size {cfg.block_size}")
    spec = get_spec(config.schedule)
    generate(config.schedule, config.pp, config.microbatches,
             config.chunks if config.chunks is not None else spec.default_chunks)
