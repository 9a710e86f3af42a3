"""AdamW's parameter groups and the learning-rate schedule of ``fxpipe run``.

Pure functions of names, shapes and step counts, so they are tested without processes:
``lr_factor`` against the schedules' closed forms and torch's own schedulers,
``param_groups`` by tensor rank.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

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
