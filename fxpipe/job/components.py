"""The parts of ``fxpipe run``'s loop every training job has: the learning-rate
schedule, AdamW's parameter groups, validation, and the metrics file.

Kept apart from ``fxpipe/job/train.py`` (the config and the driver) so each is small and
testable without processes: ``lr_factor`` is a pure function, ``param_groups`` reads
names and shapes only.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable

import torch

from fxpipe.base.safe_io import open_output
from fxpipe.data import DataStream
from fxpipe.ir.program import ParamKind
from fxpipe.job.config import LRSchedule, TrainConfig


def lr_factor(step: int, *, schedule: LRSchedule, warmup: int, steps: int, lr: float, min_lr: float) -> float:
    """The multiple of --lr used for optimizer step ``step`` (0-based), in [min_lr/lr, 1]
    after warm-up. LambdaLR calls it with the count of steps taken, so a resumed run
    continues the same curve."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule is LRSchedule.CONSTANT:
        return 1.0
    floor = min_lr / lr
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule is LRSchedule.COSINE else 1 - progress
    return floor + (1 - floor) * decay


def lr_scheduler(opt: torch.optim.Optimizer, config: "TrainConfig") -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, schedule=config.lr_schedule, warmup=config.warmup, steps=config.steps,
                         lr=config.lr, min_lr=config.min_lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def param_groups(named: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups: decay for matrices and embeddings, none for 1-D tensors
    (biases, LayerNorm/RMSNorm weights) — decaying a norm's gain towards 0 or a bias
    towards 0 regularises nothing useful (nanoGPT's and Megatron's split). By rank,
    not by name, so it holds for any model; both groups always exist (a ZeRO-1 replica
    may own no 1-D tensor), so every rank's scheduler state has the same shape."""
    decay, no_decay = [], []
    for _, t in named:
        (decay if t.dim() >= 2 else no_decay).append(t)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


def evaluate(pm: Any, batches: Iterable[tuple[torch.Tensor, ...]]) -> float:
    """Mean loss over ``batches``. The runtime has no forward-only schedule yet, so each
    batch runs the training schedule and its gradients are discarded (the next
    ``train_step`` zeroes them); no optimizer step is taken. What a training step also
    changes is put back, so validation leaves the run as it found it: fp16's loss scale
    (an overflow or a growth counted on validation batches would move it) and the buffers
    the forward writes (running statistics, counters). Models trained with dropout see it
    here too."""

    scaler = getattr(pm.master, "scaler", None) if pm.master is not None else None
    kept_scale = dict(vars(scaler)) if scaler is not None else None
    kinds = {p.canonical: p.kind for p in pm.plan.program.params}
    buffers = {n: t.detach().clone() for n, t in pm.state.items()
               if kinds.get(n) is ParamKind.BUFFER and isinstance(t, torch.Tensor)}
    losses = [pm.train_step(batch) for batch in batches]
    for t in pm.parameters():
        t.grad = None
    if kept_scale is not None:
        vars(scaler).update(kept_scale)
    with torch.no_grad():
        for n, t in buffers.items():
            pm.state[n].copy_(t)
    return sum(losses) / len(losses)


class MetricsWriter:
    """One JSON object per line (rank 0 only) and, when the ``tensorboard`` package is
    installed and a directory given, the same scalars as TensorBoard events."""

    def __init__(self, path: str | None, tensorboard_dir: str | None,
                 forbidden: frozenset[tuple[int, int]] = frozenset()) -> None:
        # ``forbidden``: the run's inputs by identity (job/input_registry.py), checked on the opened file
        self.file = open_output(path, append=True, forbidden=forbidden) if path else None  # closed in close()
        self.tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if v is not None}  # e.g. no MFU without a known peak
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def peak_memory_gib() -> float:
    """This process's peak memory: the GPU's allocator peak, else the peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def validate(pm: Any, w: Any, windows: Any, config: "TrainConfig", step: int, metrics: Any) -> None:
    """Validation loss and perplexity over the first ``eval_steps`` global batches of the
    validation windows, in order (the same tokens at every evaluation)."""
    import math

    val = DataStream(windows, config.batch, dp=pm.groups.mesh.dp, dp_rank=pm.groups.dp_rank, shuffle=False)
    loss = evaluate(pm, (w.batch_from_tokens(val.global_rows(val.next_batch())) for _ in range(config.eval_steps)))
    if metrics is not None:
        perplexity = math.exp(min(loss, 700.0))
        print(f"eval {step:5d} | val loss {loss:.4f} | perplexity {perplexity:.2f}", flush=True)
        metrics.write(dict(step=step, val_loss=loss, val_perplexity=perplexity))
