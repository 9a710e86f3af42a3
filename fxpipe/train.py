"""The training job behind ``fxpipe run``: one function per rank, plus the launcher.

``fxpipe run`` without torchrun's environment starts tp·pp·dp worker processes
itself through torch.distributed's elastic launcher — the code path torchrun uses,
so ``torchrun --nproc-per-node N -m fxpipe run ...`` (and multi-node rendezvous)
run the same worker function.
"""
from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.runtime.balance import BalanceMeter, balance, balance_table

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
            per_step = self.micro_batch_size * layout.microbatches * layout.dp
            if self.global_batch != per_step:
                raise ValueError(
                    f"global batch {self.global_batch} != micro-batch size · microbatches · dp = "
                    f"{self.micro_batch_size}·{layout.microbatches}·{layout.dp} = {per_step}; "
                    f"set --microbatches {self.global_batch // (self.micro_batch_size * layout.dp)} "
                    f"if it divides evenly")
        for name in ("micro_batch_size", "seq", "steps", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.parallel.dp

    @property
    def batch(self) -> int:
        return self.micro_batch_size * self.parallel.microbatches * self.parallel.dp


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


def worker(config: TrainConfig, stop: "_StopSignal | None" = None) -> dict[str, Any]:
    """One rank of the job (what torchrun or the elastic launcher starts). ``stop``
    catches SIGTERM/SIGINT from the first step on; without one, its handlers stay
    installed for the process's life."""
    from fxpipe.data import ByteBatches, stdlib_corpus
    from fxpipe.models import build_workload
    from fxpipe.runtime.api import parallelize
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
        sched.load_state_dict(extra["lr_scheduler"])
    last_saved = start_step if config.resume else None
    # Model FLOPs per step (Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) for a GPT, summed
    # by the cost pass over the whole model, so any model gets it). Recomputation is
    # hardware work, not model work: reported separately as hardware FLOP/s.
    flops_per_step = pm.model_stats.flops_per_step
    hw_flops_per_step = flops_per_step + _recomputed_flops(pm) * layout.microbatches * layout.dp
    tokens_per_step = config.batch * config.seq
    if rank == 0:
        print(f"fxpipe run: {config.model}, {pm.model_stats.num_parameters / 1e6:.2f}M parameters, "
              f"tp={layout.tp}{' (sp)' if layout.sp else ''} pp={layout.pp} dp={layout.dp}, "
              f"schedule {layout.schedule.value}, {layout.precision.value}, recompute {layout.recompute.value}, "
              f"{'compiled (Inductor), ' if layout.compile else ''}"
              f"{layout.microbatches} microbatches × {config.micro_batch_size} × {config.seq} tokens, "
              f"{config.steps} steps", flush=True)
    times, losses, bubbles = [], [], []
    meter = BalanceMeter()
    t_start = time.perf_counter()
    stop = stop if stop is not None else _StopSignal()
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
    imbalance = _report_balance(pm, meter)
    _write_timeline(pm, config, imbalance)
    summary = dict(imbalance=imbalance, first_loss=losses[0], final_loss=losses[-1], median_ms=statistics.median(times) * 1e3,
                   tokens_per_s=tokens_per_step / statistics.median(times),
                   tflops_per_process=flops_per_step / statistics.median(times) / dist.get_world_size() / 1e12,
                   bubble=statistics.median(bubbles), wall_s=time.perf_counter() - t_start)
    if rank == 0:
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {config.steps} steps, "
              f"{summary['wall_s']:.1f} s; median {summary['median_ms']:.1f} ms/iter, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['tflops_per_process']:.3g} TFLOP/s/process, "
              f"bubble {summary['bubble']:.1%}, stage imbalance {imbalance:.3f}", flush=True)
    return summary


class _StopSignal:
    """SIGTERM / SIGINT (Ctrl-C) ask the job to stop at the next step boundary.

    The handler only records the signal; ranks then agree with an all-reduce, because
    a signal reaches each process at a different point and every rank must stop after
    the same step (a collective left half-done would hang). A repeated signal (the
    elastic agent forwards the one the terminal already sent) is ignored.

    Installed when training starts, not before: during set-up there is nothing to
    save, and a rank blocked there on a peer that crashed must die with the agent's
    SIGTERM at once (a Python handler would run only after the blocked call returns)."""

    def __init__(self) -> None:
        self.received = 0
        """Written by the handler only: it may run between any two bytecodes of ``agreed``."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal any rank received (0: none); the same answer on every rank."""
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def _save(pm: Any, opt: Any, sched: Any, step: int, config: TrainConfig) -> int:
    from fxpipe.runtime.checkpoint import save_checkpoint

    from fxpipe.runtime.checkpoint_size import checkpoint_size

    start = time.perf_counter()
    path = save_checkpoint(pm, opt, step, config.checkpoint_dir, keep_last=config.keep_checkpoints,
                           extra={"lr_scheduler": sched.state_dict()})
    if dist.get_rank() == 0:
        print(f"checkpoint: {path} in {time.perf_counter() - start:.2f} s, "
              f"{checkpoint_size(path).describe()}", flush=True)
    return step


def _recomputed_flops(pm: Any) -> int:
    """Forward matmul FLOPs re-run in backward by recompute regions, per microbatch, all
    stages; per-rank costs × tp approximates the whole model's under tensor parallelism."""
    from fxpipe.passes.recompute import regions_of

    costs = pm.plan.program.costs
    total = sum(costs[n].fwd_flops for st in pm.plan.stages for r in regions_of(st.graph_module)
                for n in r.nodes if n in costs)
    return total * pm.groups.mesh.tp


def _report_balance(pm: Any, meter: "BalanceMeter") -> float:
    """Per-stage predicted vs measured F/B (rank 0 prints); the measured imbalance."""
    summaries = [None] * pm.groups.mesh.pp
    dist.all_gather_object(summaries, meter.summary(), group=pm.groups.pp_group)
    rows, imbalance = balance(pm.partition, summaries) if pm.partition is not None else ([], 1.0)
    if dist.get_rank() == 0 and rows:
        print(balance_table(rows, imbalance), flush=True)
    return imbalance


def _write_timeline(pm: Any, config: TrainConfig, imbalance: float = 1.0) -> None:
    """Gather the last step's per-action times from every pipeline rank; rank 0 draws them."""
    if config.timeline is None:
        return
    from fxpipe.schedules.render.gantt import render_gantt
    from fxpipe.schedules.render.trace import render_trace
    from fxpipe.schedules.timeline import Timeline

    events = [None] * config.parallel.pp
    dist.all_gather_object(events, pm.last_stats.events, group=pm.groups.pp_group)
    if dist.get_rank() != 0:
        return
    t0 = min(s for rank in events for _, s, _ in rank)
    per_rank = [[(a, (s - t0) * 1e3, (e - t0) * 1e3) for a, s, e in rank if a.kind.is_compute]
                for rank in events]
    timeline = Timeline.from_events(per_rank, unit="ms", num_chunks=pm.schedule.num_chunks,
                                    title=f"measured {config.parallel.schedule.value} p={config.parallel.pp} "
                                          f"m={config.parallel.microbatches}, "
                                          f"stage imbalance {imbalance:.2f}")
    render_trace(timeline, config.timeline + ".json")
    render_gantt(timeline, config.timeline + ".png")
    print(f"timeline of the last step: {config.timeline}.json (Perfetto), {config.timeline}.png", flush=True)


def _elastic_entry(config: TrainConfig) -> dict[str, Any]:
    stop = _StopSignal()  # kept until the end: a forwarded signal must not cut a save short
    try:
        return worker(config, stop)
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_entry(config: TrainConfig) -> dict[str, Any]:
    """A worker under the elastic launcher. Stopped by a signal, it exits at once with
    128 + signal: returning would block it until the agent reads its return value, which
    an agent that was signalled itself never does (it waits 30 s, then SIGKILLs)."""
    summary = _elastic_entry(config)
    if "signal" in summary:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + summary["signal"])
    return summary


def launch(config: TrainConfig, *, debug: bool = False) -> int:
    """Run the job: directly under torchrun, else spawn tp·pp·dp local workers.
    A failed worker is reported as one line naming its rank and error (``debug``:
    also torch's own report with every failed rank's traceback)."""
    # A run stopped by a signal exits 128 + its number (130 Ctrl-C, 143 SIGTERM), as a
    # shell reports a signalled process, after saving when --checkpoint-dir is set.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        summary = _elastic_entry(config)
        return 128 + summary["signal"] if "signal" in summary else 0
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=config.world_size,
                              run_id=f"fxpipe-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                              start_method="spawn")
    try:
        with _quiet_launcher_logs(not debug):
            elastic_launch(launch_cfg, _spawned_entry)(config)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if len(codes) == 1 and codes <= {128 + signal.SIGINT, 128 + signal.SIGTERM}:
            return codes.pop()  # only the workers were signalled; they stopped cleanly
        print(f"fxpipe run: {summarize_failure(exc)}", file=sys.stderr)
        if debug:
            print(exc, file=sys.stderr)
        return 1
    except SignalException as exc:  # the agent got it; its workers saved before it returned
        return 128 + int(exc.sigval)
    return 0


def summarize_failure(exc: Any) -> str:
    """One line from the elastic launcher's ``ChildFailedError``: the first rank to fail
    (by the timestamp of its error file) and its exception, then the other ranks."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # the error file that ``record`` writes
        message = message.get("message", "")
    message = " ".join(str(message).split()) or f"exit code {failure.exitcode}"
    others = sorted(r for r in exc.failures if r != rank)
    also = f" (ranks {', '.join(map(str, others))} failed too)" if others else ""
    return (f"rank {rank} failed: {message}{also}; "
            f"add --debug for every failed rank's traceback")


@contextlib.contextmanager
def _quiet_launcher_logs(quiet: bool):
    """The elastic agent logs each failed worker's whole traceback and every SIGTERM it
    sends to the others; the launcher prints its own one-line summary instead."""
    import logging

    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.multiprocessing"))] if quiet else []
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
