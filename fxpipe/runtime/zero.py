"""ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §5.1): optimizer state — and, under mixed precision, the
fp32 master weights — partitioned over the data-parallel group.

Partitioning is by whole parameter, balanced by size (largest first onto the least
loaded rank, ties to the lower rank): the scheme of torch's
``ZeroRedundancyOptimizer``. A parameter's optimizer state then lives whole on one
rank, so a checkpoint keeps its layout-independent keys (``optim.state.<name>.*``,
written by the owner) and loads into any layout, ZeRO or not. The price against a
flat-buffer partition (Megatron's distributed optimizer) is granularity: the largest
tensor bounds the balance.

Per step, with ``dp`` replicas of a stage:
- after the backward, each gradient is *reduced* (sum, then ÷dp) onto its owner —
  the bytes of a reduce-scatter — instead of all-reduced; other replicas drop it (on gloo
  all-reduced, ``reduces_onto_owner``);
- the owner's optimizer steps only what it owns (``ParallelModel.parameters()`` yields
  only those, so ``torch.optim.AdamW(pm.parameters())`` holds a 1/dp share of the
  state: the user's optimizer class, unchanged);
- before the next forward, owners broadcast their updated parameters (in the compute
  precision) to the other replicas — the all-gather of parameters — started at the
  step's start in the order the forward reads them, each waited for just before the
  first op that reads it (``runtime/param_waits.py``): behind the first forward's
  compute, Megatron's overlap-param-gather. Under vocabulary passes or Inductor all of
  them are waited for before the first forward computes (behind the wait for the first
  activation on every pipeline rank but the first).
Gradients are reduced in the data-parallel buckets (``grad_buckets.py``: each owner's run
of a bucket reduced onto it). Parameters travel without copies where they can: a tensor
of ``DIRECT_BYTES`` or more is broadcast in place (the owner's from it, the others' into
it), as ``ZeroRedundancyOptimizer`` does for every tensor; the smaller ones of one owner
are coalesced into a flat buffer allocated once (gloo and NCCL pay a fixed cost per call).
Flattening everything afresh each step cost a full copy of every parameter on every
replica, twice on the receivers, into newly allocated (page-faulting) memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.runtime.mesh import MeshGroups

DIRECT_BYTES = 1 << 20
"""A parameter this large is broadcast in place rather than coalesced (module docstring)."""


def assign_owners(sizes: Mapping[str, int], dp: int) -> dict[str, int]:
    """Data-parallel rank owning each parameter: greedy largest-first onto the least
    loaded rank (deterministic: every replica computes the same answer)."""
    load = [0] * dp
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(dp), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


@dataclass
class ZeroPartition:
    groups: MeshGroups
    owner: dict[str, int]
    """Trainable canonical name -> the data-parallel rank whose optimizer steps it."""
    _coalesced: dict[Any, torch.Tensor] = field(default_factory=dict)
    """(owner, dtype, device, total elements) -> the flat buffer its small tensors travel in."""

    @staticmethod
    def build(groups: MeshGroups, trainable: Mapping[str, torch.Tensor]) -> "ZeroPartition":
        return ZeroPartition(groups, assign_owners({n: t.numel() for n, t in trainable.items()}, groups.mesh.dp))

    def owns(self, name: str) -> bool:
        return self.owner[name] == self.groups.dp_rank

    @property
    def reduces_onto_owner(self) -> bool:
        """Whether a gradient is reduced onto its owner (NCCL: a reduce-scatter's bytes) or,
        on gloo, all-reduced and dropped by the others: gloo has no ring reduce, and its
        reduce onto one rank is slower than its all-reduce (``grad_buckets.py``)."""
        return dist.get_backend(self.groups.dp_group) != "gloo"

    def _global(self, dp_rank: int) -> int:
        g = self.groups
        return g.mesh.rank(pp=g.pp_rank, dp=dp_rank, tp=g.tp_rank)

    def _by_owner(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[int, list[str]]]:
        names: dict[int, list[str]] = {}
        for name in sorted(tensors):
            names.setdefault(self.owner[name], []).append(name)
        return sorted(names.items())

    @torch.no_grad()
    def reduce_gradients(self, grads: dict[str, torch.Tensor | None], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum each gradient onto its owner and divide by dp; returns the owned ones
        (missing gradients count as zeros, so every replica sends the same buffers)."""
        dp = self.groups.mesh.dp
        owned = {}
        for rank, names in self._by_owner(like):
            tensors = [grads[n] if grads.get(n) is not None else torch.zeros_like(like[n]) for n in names]
            flat = _flatten_dense_tensors(tensors)
            if self.reduces_onto_owner:
                dist.reduce(flat, dst=self._global(rank), group=self.groups.dp_group)
            else:
                dist.all_reduce(flat, group=self.groups.dp_group)
            if rank == self.groups.dp_rank:
                flat.mul_(1.0 / dp)
                owned.update(zip(names, _unflatten_dense_tensors(flat, tensors)))
        return owned

    @torch.no_grad()
    def broadcast_parameters(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every replica receives the owners' current values (in the tensors' dtype)."""
        self.start_broadcast(tensors).wait()

    @torch.no_grad()
    def start_broadcast(self, tensors: Mapping[str, torch.Tensor], order: Sequence[str] = ()) -> "PendingBroadcast":
        """``broadcast_parameters`` started asynchronously: ``wait()`` before reading them,
        or ``wait_for(name)`` before reading one (``runtime/param_waits.py``). The small
        tensors' buffers go first, then the others in ``order`` (the order this rank's
        forward reads them; names not in it after, by name): identical on every replica."""
        pending: list = []
        by_name: dict[str, int] = {}
        group = self.groups.dp_group
        direct: list[tuple[str, int, bool, torch.Tensor]] = []
        for rank, names in self._by_owner(tensors):
            src, mine = self._global(rank), rank == self.groups.dp_rank
            small: dict[tuple, list[str]] = {}
            for n in names:
                t = tensors[n]
                if t.is_contiguous() and t.numel() * t.element_size() >= DIRECT_BYTES:
                    direct.append((n, src, mine, t))
                else:
                    small.setdefault((t.dtype, t.device), []).append(n)
            for (dtype, device), group_names in small.items():
                ts = [tensors[n] for n in group_names]
                key = (rank, dtype, device, sum(t.numel() for t in ts))
                if key not in self._coalesced:
                    self._coalesced[key] = torch.empty(key[3], dtype=dtype, device=device)
                flat = self._coalesced[key]
                views = list(_unflatten_dense_tensors(flat, ts))  # views into the buffer
                if mine:
                    torch._foreach_copy_(views, ts)
                else:
                    by_name.update((n, len(pending)) for n in group_names)
                pending.append((dist.broadcast(flat, src=src, group=group, async_op=True), [] if mine else ts, views))
        rank_of = {n: i for i, n in enumerate(order)}
        direct.sort(key=lambda d: (rank_of.get(d[0], len(rank_of)), d[0]))
        for name, src, mine, t in direct:  # in place: the owner's tensor is the source, the others' the destination
            if not mine:
                by_name[name] = len(pending)
            pending.append((dist.broadcast(t.detach(), src=src, group=group, async_op=True), [], []))
        return PendingBroadcast(pending, by_name)


@dataclass
class PendingBroadcast:
    pending: list
    """(work, the tensors to overwrite — none on the owner or when received in place —, their
    views in the received buffer) per collective; None once waited for."""
    by_name: dict[str, int] = field(default_factory=dict)
    """Each tensor this rank receives -> the index of its collective in ``pending``."""
    waited_s: float = 0.0

    def wait_for(self, name: str) -> None:
        """Block until tensor ``name`` has arrived (nothing to wait for on its owner)."""
        index = self.by_name.pop(name, None)
        if index is not None:
            self._wait(index)

    def wait(self) -> None:
        """Every collective done: the owners' tensors may change again (the optimizer)."""
        for index in range(len(self.pending)):
            self._wait(index)
        self.by_name.clear()

    @torch.no_grad()
    def _wait(self, index: int) -> None:
        entry = self.pending[index]
        if entry is None:
            return
        start = time.perf_counter()
        work, parts, views = entry
        work.wait()  # the dp group's timeout bounds it
        if parts:
            torch._foreach_copy_(parts, views)
        self.pending[index] = None
        self.waited_s += time.perf_counter() - start
