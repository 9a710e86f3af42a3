"""Checkpoint cases run inside spawned gloo workers (importable by the children).

One function per spawned world, each running several checks, because spawning and
compiling dominate on a 2-core machine.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from fxpipe.models import build_workload

BATCH, SEQ, LAYERS, MICROBATCHES = 8, 16, 4, 4
STEPS, SAVE_AT = 4, 2


def workload(name: str = "gpt-tiny", *, seed: int = 0, layers: int = LAYERS):
    return build_workload(name, batch=BATCH, seq=SEQ, layers=layers, seed=seed)


def batch(w, step: int) -> tuple[torch.Tensor, ...]:
    """Training batch of ``step``: a pure function of the step, like fxpipe.data."""
    gen = torch.Generator().manual_seed(1000 + step)
    return w.batch_from_tokens(torch.randint(0, w.vocab_size, (BATCH, SEQ + 1), generator=gen))


def parallel(w, pp: int, dp: int | None = None):
    from fxpipe.runtime.api import parallelize
    return parallelize(w.model, pp=pp, dp=dp, microbatches=MICROBATCHES, example_inputs=batch(w, 0),
                       loss_fn=w.loss_fn, partition="uniform")


def optimizer(pm):
    """AdamW with a decaying learning rate, so resume must restore the group's lr too."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def rng_sample() -> list[float]:
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def train(pm, opt, sched, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pm.train_step(batch(pm_workload(pm), step)))
        opt.step()
        sched.step()
    return losses


def pm_workload(pm):
    return pm._fxpipe_test_workload


def build(name: str, pp: int, dp: int | None = None, *, seed: int = 0, layers: int = LAYERS):
    w = workload(name, seed=seed, layers=layers)
    pm = parallel(w, pp, dp)
    pm._fxpipe_test_workload = w
    return pm
