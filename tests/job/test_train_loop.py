"""fxpipe run's loop pieces without processes: the LR schedules against their closed
forms and against torch's own schedulers, AdamW's decay groups by tensor rank."""
from __future__ import annotations

import math

import pytest
import torch

from fxpipe.models import build_workload
from fxpipe.job.optimizer import lr_factor, param_groups
from fxpipe.job.config import LRSchedule

LR, MIN_LR, WARMUP, STEPS = 1e-3, 1e-4, 10, 110


def _curve(schedule: LRSchedule) -> list[float]:
    return [LR * lr_factor(s, schedule=schedule, warmup=WARMUP, steps=STEPS, lr=LR, min_lr=MIN_LR)
            for s in range(STEPS)]


def test_warmup_then_cosine_to_min_lr():
    lrs = _curve(LRSchedule.COSINE)
    assert lrs[:WARMUP] == pytest.approx([LR * (s + 1) / WARMUP for s in range(WARMUP)])
    assert lrs[WARMUP] == pytest.approx(LR) and lrs[-1] == pytest.approx(MIN_LR)
    mid = WARMUP + (STEPS - 1 - WARMUP) / 2  # halfway in (99 decay steps): cos(π/2) = 0
    assert LR * lr_factor(int(mid), schedule=LRSchedule.COSINE, warmup=WARMUP, steps=STEPS, lr=LR,
                          min_lr=MIN_LR) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5 * (
                              1 + math.cos(math.pi * (int(mid) - WARMUP) / (STEPS - 1 - WARMUP))))
    # torch's CosineAnnealingLR after the warm-up is the same curve.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=LR)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 1 - WARMUP, eta_min=MIN_LR)
    torch_lrs = []
    for _ in range(STEPS - WARMUP):
        torch_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert lrs[WARMUP:] == pytest.approx(torch_lrs, rel=1e-9)


def test_linear_and_constant():
    lin = _curve(LRSchedule.LINEAR)
    assert lin[-1] == pytest.approx(MIN_LR) and lin[WARMUP] == pytest.approx(LR)
    diffs = [a - b for a, b in zip(lin[WARMUP:], lin[WARMUP + 1:])]
    assert max(diffs) == pytest.approx(min(diffs)) == pytest.approx((LR - MIN_LR) / (STEPS - 1 - WARMUP))
    assert _curve(LRSchedule.CONSTANT)[WARMUP:] == [LR] * (STEPS - WARMUP)
    with pytest.raises(ValueError, match="unknown --lr-schedule 'step'; valid: constant, cosine, linear"):
        LRSchedule.parse("step")


def test_no_weight_decay_on_biases_and_norm_weights():
    model = build_workload("hf:llama").model
    decay, no_decay = param_groups(model.named_parameters(), 0.1)
    names = {id(t): n for n, t in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(t)] for t in no_decay["params"]} == {n for n, t in model.named_parameters()
                                                          if "norm" in n}
    assert all(t.dim() == 2 for t in decay["params"]) and len(decay["params"]) + len(no_decay["params"]) == \
        len(list(model.parameters()))


def test_evaluation_leaves_the_loss_scale_and_written_buffers_as_it_found_them():
    """Validation runs the training step (no forward-only schedule): what that step changes
    besides gradients — fp16's loss scale, buffers the forward writes — is put back."""
    from types import SimpleNamespace

    from fxpipe.ir.program import ParamKind
    from fxpipe.runtime.mixed_precision import LossScaler
    from fxpipe.job.validation import evaluate

    weight = torch.nn.Parameter(torch.ones(2))
    state = {"w": weight, "running": torch.zeros(2)}
    scaler = LossScaler(scale=1024.0, good_steps=3)

    def train_step(batch):  # what a step does: a gradient, an overflow halving the scale, a write
        weight.grad = torch.ones(2)
        scaler.update(overflow=True)
        state["running"].add_(batch)
        return float(batch.sum())

    params = [SimpleNamespace(canonical="w", kind=ParamKind.PARAMETER),
              SimpleNamespace(canonical="running", kind=ParamKind.BUFFER)]
    pm = SimpleNamespace(master=SimpleNamespace(scaler=scaler), state=state, train_step=train_step,
                         plan=SimpleNamespace(program=SimpleNamespace(params=params)),
                         parameters=lambda: [weight])
    assert evaluate(pm, [torch.ones(2), 3 * torch.ones(2)]) == 4.0
    assert (scaler.scale, scaler.good_steps, scaler.skipped) == (1024.0, 3, 0)
    assert state["running"].tolist() == [0.0, 0.0] and weight.grad is None
