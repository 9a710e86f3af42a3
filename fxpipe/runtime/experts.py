"""Expert parallelism on the mesh: the groups, the gradient rule and the counts.

With ``ep`` > 1 the data-parallel ranks of one (pp, tp) position form dp/ep expert
groups of ep consecutive ranks; rank ``dp_rank % ep`` of each owns experts
``[ep_rank·E/ep, (ep_rank+1)·E/ep)`` of every expert-parallel stack
(``passes/expert_parallel.py``), and the graph's ``ep_dispatch`` / ``ep_combine``
talk to its expert group.

Gradients (Megatron-Core's expert data parallelism): an expert's gradient on its
owner already sums the tokens of every rank of the expert group (the all-to-all's
backward brings them home), each rank's loss being the mean over its own rows. The
full-batch gradient is the mean over dp of the ranks' losses, so an expert's
gradient is summed over the ranks holding the same experts (dp/ep replicas: none
beyond scaling when ep == dp) and divided by dp; dense parameters are averaged over
the whole dp group as without experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.ep import ExpertContext
from fxpipe.runtime.mesh import MeshGroups, subgroup
from fxpipe.tp import ProcessGroupTP


@dataclass
class ExpertGroups:
    ep: int
    ep_rank: int
    group: Any
    """The expert group (``ProcessGroupTP`` over its process group): where tokens go."""
    replicas: Any
    """Process group of the ranks holding the same experts (None: this rank alone)."""
    context: ExpertContext
    """The context every step runs in (tokens per expert accumulate here)."""
    params: frozenset[str]
    """Canonical names of the expert-parallel parameters."""

    @property
    def process_groups(self) -> list[Any]:
        return [g for g in (self.group.group, self.replicas) if g is not None]


def build_expert_groups(groups: MeshGroups, ep: int, params: frozenset[str], timeout: timedelta) -> ExpertGroups:
    """Create every rank's expert and replica groups (collective: every rank calls it)."""
    mesh = groups.mesh
    assert mesh.dp % ep == 0, (mesh.dp, ep)
    blocks = mesh.dp // ep
    owners = [[mesh.rank(pp=p, dp=b * ep + i, tp=t) for i in range(ep)]
              for p in range(mesh.pp) for t in range(mesh.tp) for b in range(blocks)]
    holders = [[mesh.rank(pp=p, dp=b * ep + i, tp=t) for b in range(blocks)]
               for p in range(mesh.pp) for t in range(mesh.tp) for i in range(ep)]
    group = ProcessGroupTP(subgroup(owners, groups.rank, timeout))
    replicas = subgroup(holders, groups.rank, timeout) if blocks > 1 else None
    return ExpertGroups(ep, groups.dp_rank % ep, group, replicas, ExpertContext(group), params)


def sync_expert_grads(grads: list[torch.Tensor], experts: ExpertGroups, dp: int) -> None:
    """Sum over the replicas of the same experts, then divide by dp (module docstring)."""
    if not grads:
        return
    if experts.replicas is not None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=experts.replicas)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    for g in grads:
        g.div_(dp)


def tokens_per_expert(experts: ExpertGroups, dp_group: Any) -> dict[int, list[int]]:
    """MoE layer -> tokens the router sent to each expert, over the global batches of
    every step run so far (summed over the data-parallel ranks; collective)."""
    out = {}
    for layer in sorted(experts.context.tokens):
        counts = experts.context.tokens[layer].clone()
        dist.all_reduce(counts, group=dp_group)
        out[layer] = counts.tolist()
    return out


def gather_experts(local: dict[str, torch.Tensor], experts: ExpertGroups) -> dict[str, torch.Tensor]:
    """Full expert stacks from every owner's experts (for tests and small exports). Collective."""
    mine = {n: t for n, t in local.items() if n in experts.params}
    everyone: list[Any] = [None] * experts.ep
    dist.all_gather_object(everyone, mine, group=experts.group.group)
    return {**local, **{n: torch.cat([part[n] for part in everyone]) for n in mine}}
