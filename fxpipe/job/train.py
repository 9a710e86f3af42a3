"""The training job behind ``fxpipe run``: its config and the function every rank runs.

``fxpipe/job/launcher.py`` starts the ranks (or torchrun does), ``fxpipe/job/run_report.py``
prints and draws what they measured.
"""
from __future__ import annotations

import signal
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.base.peak_flops import device_peak_tflops, mfu
from fxpipe.checkpoint.dcp import load_checkpoint, save_checkpoint
from fxpipe.checkpoint.export import export_consolidated
from fxpipe.checkpoint.files import write_atomic
from fxpipe.checkpoint.size import checkpoint_size
from fxpipe.data import DataStream
from fxpipe.job.metrics import MetricsWriter, peak_memory_gib
from fxpipe.job.optimizer import lr_scheduler, param_groups
from fxpipe.job.validation import report_validation
from fxpipe.job.config import TrainConfig
from fxpipe.job.config_file import SAVED_NAME, to_toml
from fxpipe.job.input_registry import InputRegistry
from fxpipe.job.preflight_files import check_schedule
from fxpipe.job.prepare import build_job, weights_dir
from fxpipe.job.run_report import bubble_share, progress_bar, recomputed_flops, report_balance, write_timeline
from fxpipe.job.stop_signal import StopSignal
from fxpipe.parallel import parallelize
from fxpipe.runtime.balance import BalanceMeter
from fxpipe.runtime.build import NoParametersWarning
from fxpipe.runtime.grad_norm import clip_grad_norm, global_grad_norm
from fxpipe.runtime.launch import threads_per_rank


def worker(config: TrainConfig, stop: "StopSignal | None" = None) -> dict[str, Any]:
    """One rank of the job (what torchrun or the elastic launcher starts). ``stop``
    catches SIGTERM/SIGINT from the first step on; without one, its handlers stay
    installed for the process's life."""

    seed, layout = config.parallel.seed, config.parallel
    torch.manual_seed(seed)
    if not torch.cuda.is_available():  # share the cores between the local workers
        torch.set_num_threads(threads_per_rank())
    w, source = build_job(config)
    # Every rank passes the same global batch as the example (train_step's contract).
    first = w.batch_from_tokens(DataStream(source.train, config.batch, seed=seed).next_batch())
    with warnings.catch_warnings():  # its optimizer is built from parameter groups below: a rank
        # holding no parameter needs no advice on building one (runtime/build.py)
        warnings.simplefilter("ignore", NoParametersWarning)
        pm = parallelize(w.model, layout, example_inputs=first, loss_fn=w.loss_fn, weights=weights_dir(config))
    rank = dist.get_rank()
    stream = DataStream(source.train, config.batch, dp=layout.dp, dp_rank=pm.groups.dp_rank, seed=seed)
    opt = torch.optim.AdamW(param_groups(pm.named_parameters(), config.weight_decay), lr=config.lr,
                            betas=(0.9, 0.95))
    sched = lr_scheduler(opt, config)
    start_step = 0
    if config.resume:
        start_step, extra = load_checkpoint(pm, opt, config.checkpoint_dir, step=config.resume_from)
        check_schedule(extra, start_step, config.lr, len(opt.param_groups))  # digest-covered, and in range
        sched.load_state_dict(extra["lr_scheduler"])
        if "data" in extra:  # the token position, whatever the layout that saved it
            stream.load_state(extra["data"], steps=start_step)
        else:  # saved before the data position was kept: one global batch per step
            stream.position = start_step * config.batch
    last_saved = start_step if config.resume else None
    # Model FLOPs per step (Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) for a GPT, summed
    # by the cost pass over the whole model, so any model gets it). Recomputation is
    # hardware work, not model work: reported separately as hardware FLOP/s.
    flops_per_step = pm.model_stats.flops_per_step
    hw_flops_per_step = flops_per_step + recomputed_flops(pm) * layout.num_microbatches * layout.dp
    tokens_per_step = config.batch * config.seq
    peak = run_peak_tflops(config)
    metrics = MetricsWriter(config.metrics_file, config.tensorboard_dir,
                            InputRegistry.of(config).identities()) if rank == 0 else None
    if rank == 0:
        print("config: " + ", ".join(to_toml(config).splitlines()), flush=True)  # the resolved run, in its keys
        print(f"fxpipe run: {config.model}, {pm.model_stats.num_parameters / 1e6:.2f}M parameters, "
              f"tp={layout.tp}{' (sp)' if layout.sp else ''} pp={layout.pp} dp={layout.dp}, "
              f"schedule {layout.schedule.value}, {layout.precision.value}, recompute {layout.recompute.value}, "
              f"{'compiled (Inductor), ' if layout.inductor else ''}"
              f"{layout.num_microbatches} microbatches × {config.micro_batch_size} × {config.seq} tokens, "
              f"{config.steps} steps; data: {source.train.stream.source}, {source.train.count} windows"
              + (f", validation {source.val.count}" if source.val is not None else ""), flush=True)
    times, losses, bubbles, exposed = [], [], [], []
    meter = BalanceMeter()
    t_start = time.perf_counter()
    stop = stop if stop is not None else StopSignal()
    stop.install()
    for step in range(start_step, config.steps):
        if stop.agreed():
            break
        batch = w.batch_from_tokens(stream.global_rows(stream.next_batch()))
        lr = opt.param_groups[0]["lr"]
        t0 = time.perf_counter()
        loss = pm.train_step(batch)
        grad_norm = clip_grad_norm(pm, config.grad_clip) if config.grad_clip else global_grad_norm(pm)
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
        exposed.append(pm.last_stats.exposed.total_s)
        losses.append(loss)
        bubbles.append(float(bubble) / dist.get_world_size())
        if rank == 0:
            progress_bar(step + 1, config.steps, loss)
            if (step + 1) % config.log_interval == 0 or step == 0:
                tflops = flops_per_step / (t1 - t0) / dist.get_world_size() / 1e12
                hw = "" if hw_flops_per_step == flops_per_step else \
                    f" ({hw_flops_per_step / (t1 - t0) / dist.get_world_size() / 1e12:.3g} hardware)"
                skipped = f" | skipped: fp16 overflow, loss scale {pm.master.loss_scale:g}" \
                    if pm.last_step_skipped else ""
                used = mfu(flops_per_step, t1 - t0, dist.get_world_size(), peak) if peak else None
                print(f"iter {step + 1:5d} | loss {loss:.4f} | {(t1 - t0) * 1e3:8.1f} ms/iter | "
                      f"{tokens_per_step / (t1 - t0):9.0f} tokens/s | {tflops:.3g} TFLOP/s/process{hw} | "
                      + (f"MFU {used:.1%} | " if used is not None else "")
                      + f"bubble {bubbles[-1]:.1%}{skipped}", flush=True)
                metrics.write(dict(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm,
                                   tokens_per_s=tokens_per_step / (t1 - t0),
                                   tokens_per_s_per_device=tokens_per_step / (t1 - t0) / dist.get_world_size(),
                                   tflops_per_process=tflops, mfu=used, bubble=bubbles[-1],
                                   memory_gib=peak_memory_gib()))
        if source.val is not None and config.eval_interval and (
                (step + 1) % config.eval_interval == 0 or step + 1 == config.steps):
            report_validation(pm, w, source.val, config, step + 1, metrics)
        if config.save_interval and (step + 1) % config.save_interval == 0:
            last_saved = _save(pm, opt, sched, stream, step + 1, config)
    stopped = stop.agreed()  # again: a signal during the last step must stop every rank alike
    done = start_step + len(losses)
    if metrics is not None:
        metrics.close()
    if config.checkpoint_dir is not None and done != last_saved:
        _save(pm, opt, sched, stream, done, config)
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
    # Time each rank blocked waiting for communication (runtime/api.py ExposedComm), median per step.
    waits: list = [None] * dist.get_world_size()
    dist.all_gather_object(waits, statistics.median(exposed))
    imbalance = report_balance(pm, meter)
    write_timeline(pm, config, imbalance)
    summary = dict(imbalance=imbalance, first_loss=losses[0], final_loss=losses[-1], median_ms=statistics.median(times) * 1e3,
                   tokens_per_s=tokens_per_step / statistics.median(times),
                   tflops_per_process=flops_per_step / statistics.median(times) / dist.get_world_size() / 1e12,
                   bubble=statistics.median(bubbles), wall_s=time.perf_counter() - t_start,
                   parameter_share=pm.parameter_share, exposed_comm_ms=[1e3 * w for w in waits])
    if peak:
        summary["mfu"] = mfu(flops_per_step, statistics.median(times), dist.get_world_size(), peak)
    if rank == 0:
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {config.steps} steps, "
              f"{summary['wall_s']:.1f} s; median {summary['median_ms']:.1f} ms/iter, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['tflops_per_process']:.3g} TFLOP/s/process, "
              + (f"MFU {summary['mfu']:.1%} of {peak:g} TFLOP/s, " if peak else "") +
              f"bubble {summary['bubble']:.1%}, stage imbalance {imbalance:.3f}, parameter share per tp rank "
              f"{pm.parameter_share:.2f} (ideal {1 / layout.tp:.2f}), exposed communication "
              f"{max(summary['exposed_comm_ms']):.1f} ms/iter (per rank: "
              f"{', '.join(f'{w:.1f}' for w in summary['exposed_comm_ms'])})", flush=True)
    tokens = pm.tokens_per_expert()  # collective under expert parallelism; {} without
    if tokens:
        summary["tokens_per_expert"] = tokens
        if rank == 0:
            print("tokens per expert (MoE layer: counts over the run): "
                  + "; ".join(f"{layer}: {counts}" for layer, counts in tokens.items()), flush=True)
    return summary


def run_peak_tflops(config: TrainConfig) -> float | None:
    """--peak-tflops, else the table's peak for this GPU at the run's precision (none on CPU)."""
    if config.peak_tflops is not None:
        return config.peak_tflops
    if not torch.cuda.is_available():
        return None
    half = config.parallel.precision.value != "fp32"
    return device_peak_tflops(torch.cuda.get_device_name(), half, torch.backends.cuda.matmul.allow_tf32)


def _save(pm: Any, opt: Any, sched: Any, stream: Any, step: int, config: TrainConfig) -> int:
    from pathlib import Path

    start = time.perf_counter()
    path = save_checkpoint(pm, opt, step, config.checkpoint_dir, keep_last=config.keep_checkpoints,
                           extra={"lr_scheduler": sched.state_dict(), "data": stream.state()},
                           overwrite=config.overwrite)
    if dist.get_rank() == 0:
        # The resolved config beside the checkpoints: `fxpipe run --config` runs it again.
        # Atomic and never through a link planted under its name (write_atomic).
        write_atomic(Path(config.checkpoint_dir) / SAVED_NAME, to_toml(config).encode())
        print(f"checkpoint: {path} in {time.perf_counter() - start:.2f} s, "
              f"{checkpoint_size(path).describe()}", flush=True)
    return step
