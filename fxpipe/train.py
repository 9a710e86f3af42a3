"""The training job behind ``fxpipe run``: its config and the function every rank runs.

``fxpipe/launcher.py`` starts the ranks (or torchrun does), ``fxpipe/run_report.py``
prints and draws what they measured.
"""
from __future__ import annotations

import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.launcher import StopSignal
from fxpipe.run_report import bubble_share, progress_bar, recomputed_flops, report_balance, write_timeline
from fxpipe.runtime.balance import BalanceMeter

if TYPE_CHECKING:
    from fxpipe.config import ParallelConfig


def _default_layout() -> "ParallelConfig":
    from fxpipe.config import ParallelConfig

    return ParallelConfig(tp=2, pp=2, dp=1, microbatches=4)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """``fxpipe run``: the layout (one ``ParallelConfig``, as ``parallelize`` takes it)
    and what only a training job has — data, optimizer, checkpoints, reports."""
    model: str = "gpt-small"
    """Model registry name (see ``fxpipe compile --help``)."""
    parallel: "ParallelConfig" = field(default_factory=_default_layout)
    micro_batch_size: int = 4
    global_batch: int | None = None
    """Sequences per step; default micro_batch_size · microbatches · dp."""
    seq: int = 128
    steps: int = 80
    lr: float = 2e-3
    warmup: int = 5
    """Linear learning-rate warm-up steps."""
    log_interval: int = 10
    timeline: str | None = "fxpipe-timeline"
    """Path prefix for the measured timeline of the last step (.json Perfetto, .png); None: off."""
    init_from: str | None = None
    """A Hugging Face safetensors directory to take the weights from (each rank reads its shards)."""
    checkpoint_dir: str | None = None
    """Directory of DCP checkpoints (docs/checkpoints.md); None: never save."""
    save_interval: int | None = None
    """Save every N steps when checkpoint_dir is set (always also at the end and on SIGTERM/SIGINT)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in checkpoint_dir (model, optimizer, RNG, step)."""
    overwrite: bool = False
    """Save into a checkpoint_dir that holds another run's checkpoints, replacing them at the
    first save (without it, and without resume, the launcher refuses such a directory)."""
    resume_from: int | None = None
    """Resume from the checkpoint of this step (implies ``resume``); an error if it is corrupt."""
    export: str | None = None
    """Write one consolidated state_dict under the model's own names here when the run completes."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept in checkpoint_dir; older ones are deleted after each save."""

    def __post_init__(self) -> None:
        if self.parallel.dp is None:  # fxpipe run starts tp·pp·dp workers: dp must be known
            raise ValueError("TrainConfig needs parallel.dp (the workers fxpipe run starts)")
        if self.checkpoint_dir is None and (self.resume or self.resume_from is not None
                                            or self.save_interval is not None):
            raise ValueError("--resume, --resume-from and --save-interval need --checkpoint-dir DIR")
        if self.resume_from is not None:
            if self.resume_from < 0:
                raise ValueError(f"--resume-from must be a step >= 0, got {self.resume_from}")
            object.__setattr__(self, "resume", True)
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")
        layout = self.parallel
        if self.global_batch is not None:
            per_step = self.micro_batch_size * layout.num_microbatches * layout.dp
            if self.global_batch != per_step:
                raise ValueError(
                    f"global batch {self.global_batch} != micro-batch size · microbatches · dp = "
                    f"{self.micro_batch_size}·{layout.num_microbatches}·{layout.dp} = {per_step}; "
                    f"{_batch_hint(self.global_batch, self.micro_batch_size, layout.dp)}")
        for name in ("micro_batch_size", "seq", "steps", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.parallel.dp

    @property
    def batch(self) -> int:
        return self.micro_batch_size * self.parallel.num_microbatches * self.parallel.dp


def _batch_hint(global_batch: int, micro_batch_size: int, dp: int) -> str:
    """Flags that make b·m·dp equal ``global_batch`` (only values that do), or why none can."""
    if global_batch % dp:
        return f"--global-batch must be a multiple of --dp {dp}"
    per_replica = global_batch // dp
    if per_replica % micro_batch_size == 0:
        return f"set --microbatches {per_replica // micro_batch_size}"
    b = max(d for d in range(1, micro_batch_size) if per_replica % d == 0)
    return f"set --micro-batch-size {b} --microbatches {per_replica // b}"


def worker(config: TrainConfig, stop: "StopSignal | None" = None) -> dict[str, Any]:
    """One rank of the job (what torchrun or the elastic launcher starts). ``stop``
    catches SIGTERM/SIGINT from the first step on; without one, its handlers stay
    installed for the process's life."""
    from fxpipe.data import ByteBatches, stdlib_corpus
    from fxpipe.models import build_workload
    from fxpipe.preflight_files import check_schedule
    from fxpipe.parallel import parallelize
    from fxpipe.runtime.checkpoint import export_consolidated, load_checkpoint

    torch.manual_seed(config.parallel.seed)
    if not torch.cuda.is_available():  # share the cores between the local workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    w = build_workload(config.model, batch=config.batch, seq=config.seq, seed=config.parallel.seed)
    data = ByteBatches(stdlib_corpus(), config.batch, config.seq, seed=config.parallel.seed)
    first = w.batch_from_tokens(torch.cat(data.batch(0), dim=1)[:, :config.seq + 1])
    layout = config.parallel
    pm = parallelize(w.model, layout, example_inputs=first, loss_fn=w.loss_fn, weights=config.init_from)
    rank = dist.get_rank()
    opt = torch.optim.AdamW(pm.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / config.warmup))
    start_step = 0
    if config.resume:  # batches are a function of (seed, step): the step is the data position
        start_step, extra = load_checkpoint(pm, opt, config.checkpoint_dir, step=config.resume_from)
        check_schedule(extra, start_step, config.lr, len(opt.param_groups))  # digest-covered, and in range
        sched.load_state_dict(extra["lr_scheduler"])
    last_saved = start_step if config.resume else None
    # Model FLOPs per step (Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) for a GPT, summed
    # by the cost pass over the whole model, so any model gets it). Recomputation is
    # hardware work, not model work: reported separately as hardware FLOP/s.
    flops_per_step = pm.model_stats.flops_per_step
    hw_flops_per_step = flops_per_step + recomputed_flops(pm) * layout.num_microbatches * layout.dp
    tokens_per_step = config.batch * config.seq
    if rank == 0:
        print(f"fxpipe run: {config.model}, {pm.model_stats.num_parameters / 1e6:.2f}M parameters, "
              f"tp={layout.tp}{' (sp)' if layout.sp else ''} pp={layout.pp} dp={layout.dp}, "
              f"schedule {layout.schedule.value}, {layout.precision.value}, recompute {layout.recompute.value}, "
              f"{'compiled (Inductor), ' if layout.compile else ''}"
              f"{layout.num_microbatches} microbatches × {config.micro_batch_size} × {config.seq} tokens, "
              f"{config.steps} steps", flush=True)
    times, losses, bubbles = [], [], []
    meter = BalanceMeter()
    t_start = time.perf_counter()
    stop = stop if stop is not None else StopSignal()
    stop.install()
    for step in range(start_step, config.steps):
        if stop.agreed():
            break
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
        if step > start_step or config.steps - start_step == 1:  # the first step warms up
            meter.add(pm.last_stats.events)
        bubble = torch.tensor([bubble_share(pm.last_stats.events, t0, t1)], dtype=torch.float64)
        dist.all_reduce(bubble)
        times.append(t1 - t0)
        losses.append(loss)
        bubbles.append(float(bubble) / dist.get_world_size())
        if rank == 0:
            progress_bar(step + 1, config.steps, loss)
            if (step + 1) % config.log_interval == 0 or step == 0:
                ms = (t1 - t0) * 1e3
                tflops = flops_per_step / (t1 - t0) / dist.get_world_size() / 1e12
                hw = "" if hw_flops_per_step == flops_per_step else \
                    f" ({hw_flops_per_step / (t1 - t0) / dist.get_world_size() / 1e12:.3g} hardware)"
                skipped = f" | skipped: fp16 overflow, loss scale {pm.master.loss_scale:g}" \
                    if pm.last_step_skipped else ""
                print(f"iter {step + 1:5d} | loss {loss:.4f} | {ms:8.1f} ms/iter | "
                      f"{tokens_per_step / (t1 - t0):9.0f} tokens/s | {tflops:.3g} TFLOP/s/process{hw} | "
                      f"bubble {bubbles[-1]:.1%}{skipped}", flush=True)
        if config.save_interval and (step + 1) % config.save_interval == 0:
            last_saved = _save(pm, opt, sched, step + 1, config)
    stopped = stop.agreed()  # again: a signal during the last step must stop every rank alike
    done = start_step + len(losses)
    if config.checkpoint_dir is not None and done != last_saved:
        _save(pm, opt, sched, done, config)
    if stopped:
        if rank == 0:
            print(f"stopped by {signal.Signals(stopped).name} after step {done}"
                  + ("; resume with --resume" if config.checkpoint_dir else ""), flush=True)
        return dict(signal=stopped, steps_done=done)
    if config.export:
        hf_config = getattr(w.model, "config", None)  # a Hugging Face model: config.json beside
        export_consolidated(pm, config.export,
                            hf_config=hf_config if hasattr(hf_config, "save_pretrained") else None)
        if rank == 0:
            print(f"consolidated state_dict: {config.export}", flush=True)
    if not losses:
        if rank == 0:
            print(f"the checkpoint is at step {start_step} >= --steps {config.steps}: nothing to train", flush=True)
        return dict(steps_done=start_step)
    imbalance = report_balance(pm, meter)
    write_timeline(pm, config, imbalance)
    summary = dict(imbalance=imbalance, first_loss=losses[0], final_loss=losses[-1], median_ms=statistics.median(times) * 1e3,
                   tokens_per_s=tokens_per_step / statistics.median(times),
                   tflops_per_process=flops_per_step / statistics.median(times) / dist.get_world_size() / 1e12,
                   bubble=statistics.median(bubbles), wall_s=time.perf_counter() - t_start,
                   parameter_share=pm.parameter_share)
    if rank == 0:
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {config.steps} steps, "
              f"{summary['wall_s']:.1f} s; median {summary['median_ms']:.1f} ms/iter, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['tflops_per_process']:.3g} TFLOP/s/process, "
              f"bubble {summary['bubble']:.1%}, stage imbalance {imbalance:.3f}, parameter share per tp rank "
              f"{pm.parameter_share:.2f} (ideal {1 / layout.tp:.2f})", flush=True)
    return summary


def _save(pm: Any, opt: Any, sched: Any, step: int, config: TrainConfig) -> int:
    from fxpipe.runtime.checkpoint import save_checkpoint

    from fxpipe.runtime.checkpoint_size import checkpoint_size

    start = time.perf_counter()
    path = save_checkpoint(pm, opt, step, config.checkpoint_dir, keep_last=config.keep_checkpoints,
                           extra={"lr_scheduler": sched.state_dict()}, overwrite=config.overwrite)
    if dist.get_rank() == 0:
        print(f"checkpoint: {path} in {time.perf_counter() - start:.2f} s, "
              f"{checkpoint_size(path).describe()}", flush=True)
    return step


