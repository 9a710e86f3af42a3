"""The global gradient norm over every tp/pp/dp shard, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` on one process sees each parameter once. Here a
parameter's gradient may live in several places, and each must be counted exactly
once for the norm to equal it:
- tensor parallel: a sharded tensor's shards are disjoint parts (summed over the tp
  ranks); a replicated one is whole on every tp rank (counted on tp rank 0 only);
- pipeline parallel: stages hold disjoint parameters, except a tied group (the
  embedding and LM head of SC21 §3.3) held on several pipeline ranks with summed,
  equal gradients (counted on the lowest of those ranks only), and a parameter whose
  rows are split over pipeline ranks (``PipelinePlan.row_shards``: a split LM head,
  maybe tied to a whole embedding table): each run of rows is summed over the ranks
  holding it (``grad_sync``), so it is counted on the lowest of them only;
- data parallel: after the all-reduce every replica holds the same gradient (counted
  on dp rank 0 only); under ZeRO-1 each replica holds only the gradients it owns
  (``ParallelModel.named_parameters`` yields those), which partition the set.
Squares are summed in float64 and all-reduced once over the world; every rank then
scales its own gradients by the same factor (torch's ``max_norm / (norm + 1e-6)``,
capped at 1), so the replicas stay identical.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fxpipe.runtime.api import ParallelModel

EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s guard against a zero norm."""


def counted_here(pm: "ParallelModel") -> list[str]:
    """Names of this rank's trainable tensors whose gradients this rank counts."""
    groups = pm.groups
    tied_first = {}  # tied name -> the lowest pipeline rank holding a copy
    for name, stages in pm.plan.tied_stages.items():
        if stages:  # a name no stage reads has no copy to count
            tied_first[name] = min(pm.schedule.stage_to_rank(s) for s in stages)
    names = []
    for name, _ in pm.named_parameters():
        spec = pm.specs.get(name)
        sharded = spec is not None and spec.kind.name != "REPLICATED"
        if not sharded and groups.tp_rank != 0:
            continue
        if tied_first.get(name, groups.pp_rank) != groups.pp_rank:
            continue
        # An expert-parallel stack differs per expert rank: counted by the first replica of each.
        first_replica = groups.dp_rank < (pm.experts.ep if pm.experts is not None and name in pm.experts.params else 1)
        if pm.zero is None and not first_replica:
            continue
        names.append(name)
    return names


def _counted_rows(pm: "ParallelModel", name: str, grad: torch.Tensor) -> list[torch.Tensor]:
    """The parts of this rank's ``grad`` it counts: all of it, or, for rows split over
    pipeline ranks, the runs of rows of which this rank is the lowest holder."""
    shard = pm.plan.row_shards.get(name)
    if shard is None:
        return [grad]
    pp_rank = pm.groups.pp_rank
    return [grad.narrow(0, shard.offset(pp_rank, a), b - a)
            for a, b, holders in shard.segments() if min(holders) == pp_rank]


@torch.no_grad()
def global_grad_norm(pm: "ParallelModel") -> float:
    """The L2 norm of the whole model's gradient (collective: every rank calls it)."""
    params = dict(pm.named_parameters())
    total = torch.zeros((), dtype=torch.float64)
    for name in counted_here(pm):
        grad = params[name].grad
        if grad is not None:
            for piece in _counted_rows(pm, name, grad.detach()):
                total += piece.to(torch.float64).square().sum().cpu()
    dist.all_reduce(total)
    return math.sqrt(float(total))


@torch.no_grad()
def clip_grad_norm(pm: "ParallelModel", max_norm: float) -> float:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the
    norm before clipping (as ``torch.nn.utils.clip_grad_norm_`` does)."""
    norm = global_grad_norm(pm)
    coef = max_norm / (norm + EPS)
    if coef < 1.0:
        for _, t in pm.named_parameters():
            if t.grad is not None:
                t.grad.mul_(coef)
    return norm
