"""Validation during ``fxpipe run``: the mean loss over held-out windows, taken without
changing the run (no optimizer step; loss scale and written buffers put back), and its
report as loss and perplexity."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from fxpipe.data import DataStream
from fxpipe.ir.program import ParamKind
from fxpipe.job.config import TrainConfig


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


def report_validation(pm: Any, w: Any, windows: Any, config: "TrainConfig", step: int, metrics: Any) -> None:
    """Validation loss and perplexity over the first ``eval_steps`` global batches of the
    validation windows, in order (the same tokens at every evaluation)."""
    val = DataStream(windows, config.batch, dp=pm.groups.mesh.dp, dp_rank=pm.groups.dp_rank, shuffle=False)
    loss = evaluate(pm, (w.batch_from_tokens(val.global_rows(val.next_batch())) for _ in range(config.eval_steps)))
    if metrics is not None:
        perplexity = math.exp(min(loss, 700.0))
        print(f"eval {step:5d} | val loss {loss:.4f} | perplexity {perplexity:.2f}", flush=True)
        metrics.write(dict(step=step, val_loss=loss, val_perplexity=perplexity))
