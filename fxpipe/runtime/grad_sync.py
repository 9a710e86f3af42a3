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
Data-parallel reductions run in buckets started during the step's last backward
(``grad_buckets.py``); what cannot start early — tied copies and row-shared tensors
(their group sum must come first), expert stacks (their own groups), the LM head's
blocks and row-split tables (accumulated outside the stages' B/W actions) — is
flattened into one buffer per collective after the last backward, as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.runtime.experts import sync_expert_grads
from fxpipe.runtime.grad_buckets import OverlappedReduction, final_actions, plan_buckets
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
    overlap: OverlappedReduction | None = None
    """The buckets reduced during the last backward; None: everything after it."""
    waited_s: float = 0.0
    """Time the last ``sync`` blocked in collectives (the exposed reduction)."""

    @staticmethod
    def build(plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
              state: dict[str, Any], timeout: timedelta, like: dict[str, torch.Tensor] | None = None,
              zero: Any = None, experts: Any = None, actions: Any = None,
              bucket_mb: float = 0.0) -> "GradSync":
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
        sync = GradSync(groups, state, like, tied, rows, zero, experts)
        if mesh.dp > 1 and bucket_mb > 0 and actions is not None:
            sync.overlap = _overlapped(sync, plan, schedule, actions, timeout, bucket_mb)
        return sync

    def start_step(self) -> None:
        """Before the step's first action: the buckets zeroed, the gradients their views."""
        if self.overlap is not None:
            self.overlap.start_step()

    def _grad(self, name: str) -> torch.Tensor:
        holder = self.state[name]
        if holder.grad is None:
            holder.grad = torch.zeros(self.like[name].shape, dtype=self._dtype(holder, name),
                                      device=self.like[name].device)
        return holder.grad

    def _dtype(self, holder: Any, name: str) -> torch.dtype:
        return holder.dtype if isinstance(holder, torch.Tensor) else torch.float32

    def sync(self) -> None:
        start = time.perf_counter()
        self._sync()
        self.waited_s = time.perf_counter() - start

    def _sync(self) -> None:
        for name, group in self.tied:
            _all_reduce_flat([self._grad(name)], group)
        for name, pieces, group in self.rows:
            grad = self._grad(name)
            _all_reduce_flat([grad.narrow(0, start, length) for start, length in pieces], group)
        if self.groups.mesh.dp == 1:
            return
        if self.overlap is not None:
            self.overlap.finish()
        bucketed = self.overlap.names if self.overlap is not None else frozenset()
        trainable = [n for n, h in self.state.items() if (not isinstance(h, torch.Tensor) or h.requires_grad)
                     and n not in bucketed]
        if self.zero is not None:
            grads = {n: self._grad(n) for n in trainable}
            owned = self.zero.reduce_gradients(grads, grads) if grads else {}
            for n in trainable:
                self.state[n].grad = owned.get(n)  # None on the replicas that do not own it
            return
        owned = self.experts.params if self.experts is not None else frozenset()
        _all_reduce_flat([self._grad(n) for n in trainable if n not in owned], self.groups.dp_group,
                         1.0 / self.groups.mesh.dp)
        if self.experts is not None:
            sync_expert_grads([self._grad(n) for n in trainable if n in owned], self.experts, self.groups.mesh.dp)


def _overlapped(sync: GradSync, plan: PipelinePlan, schedule: Schedule, actions: Any, timeout: timedelta,
                bucket_mb: float) -> OverlappedReduction | None:
    """The bucketed reduction of this rank's tensors that only its stages' B/W actions
    accumulate into (module docstring)."""
    groups = sync.groups
    late = {n for n, _ in sync.tied} | {n for n, _, _ in sync.rows} | set(plan.row_shards)
    late |= set(sync.experts.params) if sync.experts is not None else set()
    late |= set(plan.vocab_head.params) if plan.vocab_head is not None else set()
    late |= {lk.table for lk in plan.lookups}
    stage_params = {s: [n for n in plan.stage_params(s) if n in sync.state and n not in late]
                    for s in schedule.stages_of_rank(groups.pp_rank)}
    final_at, order = final_actions(actions.actions[groups.pp_rank], stage_params)
    final_at = {n: i for n, i in final_at.items()
                if sync.like[n].requires_grad and (not isinstance(sync.state[n], torch.Tensor)
                                                    or sync.state[n].requires_grad)}
    if not final_at:
        return None
    dtype = {n: sync._dtype(sync.state[n], n) for n in final_at}
    owner = dict(sync.zero.owner) if sync.zero is not None else None
    buckets = plan_buckets(final_at, order, {n: sync.like[n].numel() for n in final_at}, dtype,
                           bucket_mb * 2**20, owner)
    mesh = groups.mesh
    return OverlappedReduction(buckets, sync.state, sync.like, groups.dp_group, mesh.dp, groups.dp_rank, timeout,
                               lambda d: mesh.rank(pp=groups.pp_rank, dp=d, tp=groups.tp_rank), owner)
