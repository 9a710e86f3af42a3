"""Gradient synchronisation after a step's backward passes.

1. Tied groups (Megatron's embedding group, SC21 §3.3 / Shoeybi et al.): a tensor
   used by stages on several pipeline ranks exists once per rank; each copy got
   only its own stages' gradient, so the copies' gradients are summed (all-reduce
   over exactly those ranks) and the copies stay identical after the optimizer step.
   A parameter whose rows are split over pipeline ranks (``PipelinePlan.row_shards``:
   vocabulary parallelism across stages) is summed range by range instead: each run
   of rows held by several ranks (a tied embedding's table on the first stage and the
   head rows of a later one) over exactly the ranks holding it; rows one rank holds
   alone need nothing (Yeung et al., MLSys 2025, arXiv 2411.05288).
2. Data parallel: every gradient averaged over the dp group (gloo has no AVG op:
   sum, then divide); with ZeRO-1, reduced onto its owner only (``zero.py``).
   Expert-parallel stacks (``runtime/experts.py``) are summed over the ranks holding
   the same experts only, and divided by dp.
Gradients are flattened into one buffer per collective to pay latency once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.runtime.experts import sync_expert_grads
from fxpipe.runtime.mesh import MeshGroups, subgroup
from fxpipe.schedules.schedule import Schedule


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
    state: dict[str, Any]
    """Canonical name -> what holds its gradient in ``.grad``: the trainable leaf (fp32),
    its fp32 master (mixed precision), or a holder (ZeRO-1 under mixed precision: a
    parameter this rank does not own has no master, only an fp32 gradient)."""
    like: dict[str, torch.Tensor] = field(default_factory=dict)
    """Canonical name -> a tensor of the gradient's shape (the compute leaf)."""
    tied: list[tuple[str, Any]] = field(default_factory=list)
    """(canonical name, process group over the pp ranks holding it) for this rank."""
    rows: list[tuple[str, tuple[tuple[int, int], ...], Any]] = field(default_factory=list)
    """(canonical name, (local start, length) of each run of rows, process group over the
    pp ranks holding those runs) for the row-split parameters of this rank."""
    zero: Any = None
    """A ``ZeroPartition``: reduce each gradient onto its data-parallel owner."""
    experts: Any = None
    """``ExpertGroups``: expert-parallel parameters and the ranks holding the same experts."""

    @staticmethod
    def build(plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
              state: dict[str, Any], timeout: timedelta, like: dict[str, torch.Tensor] | None = None,
              zero: Any = None, experts: Any = None) -> "GradSync":
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
        rows = []
        for name in sorted(plan.row_shards):
            shard = plan.row_shards[name]
            by_holders: dict[tuple[int, ...], list[tuple[int, int]]] = {}
            for a, b, holders in shard.segments():
                if len(holders) > 1:
                    by_holders.setdefault(holders, []).append((a, b))
            for holders, segments in sorted(by_holders.items()):
                families = [[mesh.rank(pp=p, dp=d, tp=t) for p in holders]
                            for d in range(mesh.dp) for t in range(mesh.tp)]
                group = subgroup(families, groups.rank, timeout)
                if groups.pp_rank in holders:
                    local = tuple((shard.offset(groups.pp_rank, a), b - a) for a, b in segments)
                    rows.append((name, local, group))
        like = like if like is not None else {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}
        return GradSync(groups, state, like, tied, rows, zero, experts)

    def _grad(self, name: str) -> torch.Tensor:
        holder = self.state[name]
        if holder.grad is None:
            holder.grad = torch.zeros(self.like[name].shape, dtype=self._dtype(holder, name),
                                      device=self.like[name].device)
        return holder.grad

    def _dtype(self, holder: Any, name: str) -> torch.dtype:
        return holder.dtype if isinstance(holder, torch.Tensor) else torch.float32

    def sync(self) -> None:
        for name, group in self.tied:
            _all_reduce_flat([self._grad(name)], group)
        for name, pieces, group in self.rows:
            grad = self._grad(name)
            _all_reduce_flat([grad.narrow(0, start, length) for start, length in pieces], group)
        if self.groups.mesh.dp == 1:
            return
        trainable = [n for n, h in self.state.items() if not isinstance(h, torch.Tensor) or h.requires_grad]
        if self.zero is not None:
            grads = {n: self._grad(n) for n in trainable}
            owned = self.zero.reduce_gradients(grads, grads)
            for n in trainable:
                self.state[n].grad = owned.get(n)  # None on the replicas that do not own it
            return
        owned = self.experts.params if self.experts is not None else frozenset()
        _all_reduce_flat([self._grad(n) for n in trainable if n not in owned], self.groups.dp_group,
                         1.0 / self.groups.mesh.dp)
        if self.experts is not None:
            sync_expert_grads([self._grad(n) for n in trainable if n in owned], self.experts, self.groups.mesh.dp)
