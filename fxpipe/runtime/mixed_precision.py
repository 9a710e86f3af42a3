"""Mixed precision: low-precision compute, fp32 master weights, dynamic loss scaling.

As Megatron-LM (Micikevicius et al. 2018 "Mixed Precision Training"; Megatron's
``Float16OptimizerWithFloat16Params``):
- the graph runs on bf16/fp16 copies of the parameters (the Program is captured
  from a low-precision copy of the model, so every stage's dtypes are in the plan);
- the optimizer owns fp32 master weights; each low-precision gradient is added into
  the master's fp32 ``.grad`` as soon as autograd accumulates it (a post-accumulate
  hook), so summing microbatches never happens in 16 bits;
- fp16 scales the loss by S (dynamic): after the step, if any rank saw inf/NaN the
  step is skipped (gradients dropped) and S halves; after ``growth_interval`` clean
  steps S doubles. bf16 has fp32's range and needs no scaling.
The low-precision copies are refreshed from the masters at the start of every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.base.precision import Precision


@dataclass
class LossScaler:
    """Dynamic loss scale (fp16 only)."""
    scale: float = 2.0 ** 16
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2


class _GradHolder:
    """Only a ``.grad``: where a gradient accumulates in fp32 before it is reduced onto
    the replica that owns the parameter's master (ZeRO-1)."""
    grad: torch.Tensor | None = None


@dataclass
class MasterWeights:
    """fp32 masters for the low-precision leaves the graph reads."""
    precision: Precision
    compute: dict[str, torch.Tensor]
    """Canonical name -> low-precision leaf fed to the graph."""
    masters: dict[str, torch.Tensor]
    """Canonical name -> fp32 leaf the optimizer updates."""
    scaler: LossScaler | None = None
    loose: dict[str, Any] = field(default_factory=dict)
    """Canonical name -> fp32 gradient holder (``.grad``) of a trained leaf without a
    master: under ZeRO-1 another data-parallel replica owns its master."""
    _hooks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, low in self.compute.items():
            if low.requires_grad:
                if name not in self.masters:
                    self.loose[name] = _GradHolder()
                self._hooks.append(low.register_post_accumulate_grad_hook(self._make_hook(name)))

    def _make_hook(self, name: str):
        master = self.masters.get(name, self.loose.get(name))

        def hook(low: torch.Tensor) -> None:
            g = low.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            low.grad = None
        return hook

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the (possibly just updated) masters into the low-precision leaves."""
        for name, low in self.compute.items():
            master = self.masters.get(name)
            if master is not None:
                low.copy_(master)

    @torch.no_grad()
    def finish(self, group: Any = None) -> bool:
        """Unscale master gradients; with fp16 check overflow on every rank. Returns
        False when the step must be skipped (its gradients are then dropped)."""
        if self.scaler is None:
            return True
        grads = [m.grad for m in self.masters.values() if m.grad is not None]
        bad = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        overflow = bool(bad.item())
        used = self.scaler.scale
        self.scaler.update(overflow)
        if overflow:
            for m in self.masters.values():
                m.grad = None
            return False
        for g in grads:
            g.mul_(1.0 / used)
        return True
