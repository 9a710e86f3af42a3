"""Gradient synchronisation of a step's backward passes.

1. Tied groups (Megatron's embedding group, SC21 §3.3 / Shoeybi et al.): a tensor
   used by stages on several pipeline ranks exists once per rank; each copy got
   only its own stages' gradient, so the copies' gradients are summed over exactly
   those ranks and the copies stay identical after the optimizer step.
   A parameter whose rows are split over pipeline ranks (``PipelinePlan.row_shards``:
   vocabulary parallelism across stages) is summed range by range instead: each run
   of rows held by several ranks (a tied embedding's table on the first stage and the
   head rows of a later one) over exactly the ranks holding it; rows one rank holds
   alone need nothing (Yeung et al., MLSys 2025, arXiv 2411.05288).
2. Data parallel: every gradient averaged over the dp group (gloo has no AVG op:
   sum, then divide); with ZeRO-1, reduced onto its owner only (``zero.py``; on gloo
   all-reduced, the others dropping it: ``ZeroPartition.reduces_onto_owner``).
   Expert-parallel stacks (``runtime/experts.py``) are summed over the ranks holding
   the same experts only, and divided by dp.

The sum over a tied group's pipeline ranks and the average over dp are both linear, so
they commute and fold into ONE all-reduce over the union group — the tied pipeline
ranks × the dp replicas — divided by dp (likewise a row-shared run over its holders ×
dp): one collective where there were two, the second of which had to wait for the
first. Under ZeRO-1 a tied or row-shared tensor is all-reduced so (every replica gets
the sum; the non-owners drop it), not reduced onto its owner: the owner of a name is
chosen per pipeline rank (``zero.assign_owners`` over that rank's tensors), so the
tied ranks' owners differ and no one reduce over the union group reaches them all.
Under mixed precision the reduced tensors are the fp32 master (or ZeRO holder)
gradients, as for the data-parallel buckets.

When: every reduction runs in buckets started during the backward (``grad_buckets.py``)
as soon as its tensors are final on this rank — the last B/W of every stage of this
rank that reads them; for the LM head's blocks (``head_blocks.py``) the rank's last T,
whose autograd accumulates their rows; for a row-split table looked up by its owners
(``lookup_exchange.py``) the end of the action before which (or during which, on the
consuming rank) its last gradient is taken. What still waits for the end of the backward,
flattened into one buffer per collective: a table whose last gradient is taken after the
rank's last action (``VocabLookups.finish``: nothing of this rank's step is left to hide
it behind — gpt-tiny at pp=2, whose whole table sits on the head's rank and is looked up
for the first stage, whose backward ends the step), and a table this rank holds without
looking it up.
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
from fxpipe.schedules.actions import ActionKind
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
    """(canonical name, process group over the pp ranks holding it × the dp replicas) for this rank."""
    rows: list[tuple[str, tuple[tuple[int, int], ...], Any]] = field(default_factory=list)
    """(canonical name, (local start, length) of each run of rows, process group over the
    pp ranks holding those runs × the dp replicas) for the row-split parameters of this rank."""
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
              bucket_mb: float = 0.0, lookup_final: dict[str, int] | None = None) -> "GradSync":
        mesh = groups.mesh
        tied = []
        # Every rank creates every group in the same order (new_group is collective).
        for name in sorted(plan.tied_stages):
            pp_ranks = sorted({schedule.stage_to_rank(s) for s in plan.tied_stages[name]})
            if len(pp_ranks) < 2:
                continue  # all copies on one rank are already one tensor
            group = subgroup(_union(mesh, pp_ranks), groups.rank, timeout)
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
                group = subgroup(_union(mesh, holders), groups.rank, timeout)
                if groups.pp_rank in holders:
                    local = tuple((shard.offset(groups.pp_rank, a), b - a) for a, b in segments)
                    rows.append((name, local, group))
        like = like if like is not None else {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}
        sync = GradSync(groups, state, like, tied, rows, zero, experts)
        if bucket_mb > 0 and actions is not None and (mesh.dp > 1 or tied or rows):
            sync.overlap = _overlapped(sync, plan, schedule, actions, timeout, bucket_mb, lookup_final or {})
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
        """What the buckets did not take (module docstring), then wait for the buckets."""
        dp = self.groups.mesh.dp
        bucketed = self.overlap.names if self.overlap is not None else frozenset()
        for name, group in self.tied:
            if name not in bucketed:
                _all_reduce_flat([self._grad(name)], group, 1.0 / dp)
        for name, pieces, group in self.rows:
            if name not in bucketed:
                grad = self._grad(name)
                for start, length in pieces:  # one collective per run, as the buckets issue them
                    _all_reduce_flat([grad.narrow(0, start, length)], group, 1.0 / dp)
        if self.overlap is not None:
            self.overlap.finish()
        if dp == 1:
            return
        shared = {n for n, _ in self.tied} | {n for n, _, _ in self.rows}
        trainable = [n for n, h in self.state.items() if (not isinstance(h, torch.Tensor) or h.requires_grad)
                     and n not in bucketed]
        # Row-split tensors: the rows this pipeline rank holds alone, averaged over dp.
        alone = [self._grad(n).narrow(0, a, length) for n in trainable if n in self.alone
                 for a, length in self.alone[n]]
        plain = [n for n in trainable if n not in shared]
        if self.zero is not None:
            grads = {n: self._grad(n) for n in plain}
            owned = self.zero.reduce_gradients(grads, grads) if grads else {}
            _all_reduce_flat(alone, self.groups.dp_group, 1.0 / dp)
            for n in trainable:  # reduced onto their owner, or to every replica: the others drop them
                if not self.zero.owns(n):
                    self.state[n].grad = None
                elif n in owned:
                    self.state[n].grad = owned[n]
            return
        experts = self.experts.params if self.experts is not None else frozenset()
        _all_reduce_flat([self._grad(n) for n in plain if n not in experts] + alone, self.groups.dp_group, 1.0 / dp)
        if self.experts is not None:
            sync_expert_grads([self._grad(n) for n in plain if n in experts], self.experts, dp)

    def segments(self) -> tuple[dict[str, tuple[tuple[int, int, int], ...]], list[Any], frozenset[int]]:
        """The buckets' view of the reductions above: name -> (group index or -1 for the dp
        group, offset, length) in elements of each range (names absent: all of it on the dp
        group); the groups indexed; those whose members lay tensors out alike (mergeable)."""
        groups: list[Any] = []
        segments: dict[str, list[tuple[int, int, int]]] = {}
        for name, group in self.tied:
            groups.append(group)
            segments[name] = [(len(groups) - 1, 0, self.like[name].numel())]
        for name, pieces, group in self.rows:
            groups.append(group)
            row = self.like[name][0].numel()
            segments.setdefault(name, []).extend((len(groups) - 1, a * row, n * row) for a, n in pieces)
        for name, alone in self.alone.items():
            row = self.like[name][0].numel()
            segments[name].extend((-1, a * row, n * row) for a, n in alone)
        mergeable = frozenset()
        if self.experts is not None:
            groups.append(self.experts.replicas)  # ranks of one pp rank: the same layout
            mergeable = frozenset({len(groups) - 1})
            for name in self.experts.params:
                if name in self.like:
                    segments[name] = [(len(groups) - 1, 0, self.like[name].numel())]
        return {n: tuple(sorted(s, key=lambda x: x[1])) for n, s in segments.items()}, groups, mergeable

    @property
    def alone(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """Row-split tensor -> (local start, length) of the runs of rows only this pipeline
        rank holds (averaged over dp alone)."""
        shared: dict[str, list[tuple[int, int]]] = {}
        for name, pieces, _ in self.rows:
            shared.setdefault(name, []).extend(pieces)
        out = {}
        for name, pieces in shared.items():
            at, runs = 0, []
            for a, n in sorted(pieces):
                if a > at:
                    runs.append((at, a - at))
                at = max(at, a + n)
            if at < self.like[name].shape[0]:
                runs.append((at, self.like[name].shape[0] - at))
            out[name] = tuple(runs)
        return out


def _union(mesh: Any, pp_ranks: Any) -> list[list[int]]:
    """Per tp rank, the global ranks of ``pp_ranks`` × every dp replica: one tied group's
    sum and the data-parallel average as one all-reduce (module docstring)."""
    return [[mesh.rank(pp=p, dp=d, tp=t) for p in pp_ranks for d in range(mesh.dp)] for t in range(mesh.tp)]


def _overlapped(sync: GradSync, plan: PipelinePlan, schedule: Schedule, actions: Any, timeout: timedelta,
                bucket_mb: float, lookup_final: dict[str, int]) -> OverlappedReduction | None:
    """The bucketed reduction of this rank's tensors, each started when final (module
    docstring); ``lookup_final``: ``VocabLookups.final_points``."""
    groups = sync.groups
    mesh = groups.mesh
    tables = {lk.table for lk in plan.lookups}
    mine = actions.actions[groups.pp_rank]
    # A table this rank holds but neither looks up nor consumes, or whose last gradient is
    # taken after the rank's last action: reduced after the backward.
    late = tables - {n for n, i in lookup_final.items() if i < len(mine)}
    head = set(plan.vocab_head.params) if plan.vocab_head is not None else set()
    segments, others, mergeable = sync.segments()
    if mesh.dp == 1:  # only the tied and row-shared sums have anything to reduce
        late |= {n for n in sync.state if n not in segments}
    stage_params = {s: [n for n in plan.stage_params(s) if n in sync.state and n not in late]
                    for s in schedule.stages_of_rank(groups.pp_rank)}
    final_at, order = final_actions(mine, stage_params)
    last_t = max((i for i, a in enumerate(mine) if a.kind is ActionKind.T), default=None)
    for n in sorted(head - late):  # the head's rows: final after the rank's last T (and its stages' B/W)
        if n in sync.state and last_t is not None and last_t >= final_at.get(n, -1):
            final_at[n], order[n] = last_t, 0
    for n in sorted(tables - late):
        if n in sync.state and lookup_final[n] >= final_at.get(n, -1):
            final_at[n], order[n] = lookup_final[n], 0
    final_at = {n: i for n, i in final_at.items()
                if sync.like[n].requires_grad and (not isinstance(sync.state[n], torch.Tensor)
                                                    or sync.state[n].requires_grad)}
    if not final_at:
        return None
    dtype = {n: sync._dtype(sync.state[n], n) for n in final_at}
    owner = dict(sync.zero.owner) if sync.zero is not None else None
    buckets = plan_buckets(final_at, order, {n: sync.like[n].numel() for n in final_at}, dtype,
                           bucket_mb * 2**20, owner, segments, mergeable)
    return OverlappedReduction(buckets, sync.state, sync.like, groups.dp_group, mesh.dp, groups.dp_rank, timeout,
                               lambda d: mesh.rank(pp=groups.pp_rank, dp=d, tp=groups.tp_rank), owner, others,
                               frozenset(tables),
                               reduce_onto_owner=sync.zero is None or sync.zero.reduces_onto_owner)
