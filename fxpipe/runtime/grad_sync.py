"""Gradient synchronisation after a step's backward passes.

1. Tied groups (Megatron's embedding group, SC21 §3.3 / Shoeybi et al.): a tensor
   used by stages on several pipeline ranks exists once per rank; each copy got
   only its own stages' gradient, so the copies' gradients are summed (all-reduce
   over exactly those ranks) and the copies stay identical after the optimizer step.
2. Data parallel: every gradient averaged over the dp group (gloo has no AVG op:
   sum, then divide).
Gradients are flattened into one buffer per collective to pay latency once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.plan import PipelinePlan
from fxpipe.runtime.mesh import MeshGroups, subgroup
from fxpipe.schedules.ir import Schedule


def _all_reduce_flat(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


@dataclass
class GradSync:
    groups: MeshGroups
    state: dict[str, torch.Tensor]
    tied: list[tuple[str, Any]] = field(default_factory=list)
    """(canonical name, process group over the pp ranks holding it) for this rank."""

    @staticmethod
    def build(plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
              state: dict[str, torch.Tensor], timeout: timedelta) -> "GradSync":
        mesh = groups.mesh
        tied = []
        # Every rank creates every group in the same order (new_group is collective).
        for name in sorted(plan.tied_stages):
            pp_ranks = sorted({schedule.stage_to_rank(s) for s in plan.tied_stages[name]})
            if len(pp_ranks) < 2:
                continue  # all copies on one rank are already one tensor
            families = [[mesh.rank(pp=p, dp=d, tp=t) for p in pp_ranks]
                        for d in range(mesh.dp) for t in range(mesh.tp)]
            group = subgroup(families, groups.rank, timeout)
            if groups.pp_rank in pp_ranks:
                tied.append((name, group))
        return GradSync(groups, state, tied)

    def sync(self) -> None:
        for name, group in self.tied:
            t = self.state[name]
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            _all_reduce_flat([t.grad], group)
        if self.groups.mesh.dp > 1:
            grads = []
            for t in self.state.values():
                if t.requires_grad:
                    if t.grad is None:
                        t.grad = torch.zeros_like(t)
                    grads.append(t.grad)
            _all_reduce_flat(grads, self.groups.dp_group, 1.0 / self.groups.mesh.dp)
