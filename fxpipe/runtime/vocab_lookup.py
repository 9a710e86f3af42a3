"""Embedding lookups of a table whose rows are split over pipeline ranks (``VocabLookup``).

The compiler (``passes/vocab_lookup.py``) took the lookup out of the stage that reads
it; here the owners of the table's rows do it, once per step, outside the schedule:

- ``forward`` (before the schedule's first action): every pipeline rank looks each
  microbatch's token ids up in the rows it owns — an id outside them reads zeros — and
  one ``reduce`` over the pipeline group sums the parts onto the rank of the consuming
  stage, which hands microbatch i's sum to that stage's forward as an input.
- ``backward`` (after the schedule's last action): the consuming rank has collected
  the gradient of that input for every microbatch; one ``broadcast`` over the pipeline
  group gives it to every owner, which runs its own part's backward, so autograd builds
  the gradient of its rows only (the fp32-master hooks fire as for any gradient).

Every rank reads the batch, so every owner has the ids. Under tensor parallelism the
lookup is one TP rank's vocabulary-parallel one (``VocabLookup.vocab_parallel``): the
pipeline ranks of each TP rank sum their parts of its rows, and the stage sums the TP
ranks' results as it did. Both collectives run on the
existing pipeline group (its timeout), at the same two points of every step, in the
plan's lookup order on every rank: nothing can interleave with the schedule's sends.
Each row is looked up by one rank only (the lowest holder), so the sum adds zeros to
exactly one copy of every embedding: bit-identical to one process's lookup.
Memory: the consuming rank holds every microbatch's lookup of the step at once (the
whole local batch's embeddings, ``m·b·s·h``), and each owner its part's ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from fxpipe.pipeline_plan import PipelinePlan, VocabLookup
from fxpipe.runtime.mesh import MeshGroups
from fxpipe.runtime.transport import Pending, Transport
from fxpipe.schedules.ir import Schedule


@dataclass
class _Lookup:
    plan: VocabLookup
    consumer: int
    """Global rank of the pipeline rank running the consuming stage."""
    owned: torch.Tensor | None
    """Global row -> position in this rank's rows, -1 where another rank looks it up;
    None: this rank owns no row of the table."""
    parts: list[torch.Tensor] = field(default_factory=list)
    """This rank's partial lookups of the step (with their autograd graph), per microbatch."""
    results: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


class VocabLookups:
    """This rank's part in every ``VocabLookup`` of the plan (module docstring)."""

    def __init__(self, plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
                 state: dict[str, torch.Tensor], device: torch.device, transport: Transport) -> None:
        self.groups, self.state, self.device = groups, state, device
        self.transport = transport
        """Waits on the collectives with the step's timeout and names the peer on a stall."""
        self.owners = {lk.name: [groups.pp_peer(p) for p, r in enumerate(plan.row_shards[lk.table].ranks) if r]
                       for lk in plan.lookups}
        self.lookups: list[_Lookup] = []
        self.m = 0
        me = groups.pp_rank
        for lk in plan.lookups:
            rows = plan.row_shards[lk.table]
            owned = None
            if rows.ranks[me]:
                owned = torch.full((rows.rows,), -1, dtype=torch.long)
                for a, b, holders in rows.segments():
                    if min(holders) == me:  # a row several ranks hold: looked up by the lowest
                        start = rows.offset(me, a)
                        owned[a:b] = torch.arange(start, start + b - a)
                owned = owned.to(device)
            self.lookups.append(_Lookup(lk, groups.pp_peer(schedule.stage_to_rank(lk.stage)), owned))

    def forward(self, microbatches: Sequence[Sequence[torch.Tensor]]) -> None:
        """Every microbatch's lookups, summed onto their consuming ranks (collective)."""
        self.m = len(microbatches)
        for lk in self.lookups:
            spec = lk.plan.spec
            lk.parts, lk.grads = [], {}
            if lk.owned is not None:
                with torch.enable_grad():
                    lk.parts = [self._part(lk, mb[lk.plan.batch_input]) for mb in microbatches]
                flat = torch.cat([p.detach().reshape(-1) for p in lk.parts])
            else:
                flat = torch.zeros(len(microbatches) * math.prod(spec.shape), dtype=spec.dtype, device=self.device)
            mine = lk.consumer == self.groups.rank
            self._wait(dist.reduce(flat, dst=lk.consumer, group=self.groups.pp_group, async_op=True), lk,
                       "receiving" if mine else "sending")
            lk.results = [t.view(spec.shape) for t in flat.chunk(len(microbatches))] if mine else []

    def _wait(self, work, lk: _Lookup, doing: str) -> None:
        """Wait for a lookup's collective; a stall names the peer: the consuming rank for
        the others, an owner (the first other one) for the consuming rank."""
        mine = lk.consumer == self.groups.rank
        others = [r for r in self.owners[lk.plan.name] if r != self.groups.rank] or [self.groups.rank]
        peer = others[0] if mine else lk.consumer
        toward = "from" if doing.startswith("receiving") else "to"
        self.transport.wait(Pending(work, peer, f"{doing} the embedding lookup {lk.plan.name!r} of the step's "
                                                f"microbatches {toward} rank {peer}"))

    def _part(self, lk: _Lookup, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows' share of the lookup: zeros where another rank owns the id."""
        assert lk.owned is not None
        ids, pad = lk.plan.ids(batch), lk.plan.padding_idx
        rows = lk.owned.shape[0]
        if lk.plan.vocab_parallel:  # the TP rank's rows: token t is its row t - tp_rank·rows
            ids, pad = ids - self.groups.tp_rank * rows, pad - self.groups.tp_rank * rows
        inside = (ids >= 0) & (ids < rows)
        local = torch.where(inside, lk.owned[ids.clamp(0, rows - 1)], -1)
        hit = local >= 0
        table = self.state[lk.plan.table]
        pad = int(lk.owned[pad]) if lk.plan.padding_idx >= 0 and 0 <= pad < rows else -1
        out = torch.ops.aten.embedding(table, local.clamp(min=0), pad)
        return torch.where(hit.unsqueeze(-1), out, out.new_zeros(()))

    def inputs(self, stage: int, mb: int) -> dict[str, torch.Tensor]:
        """The summed lookups stage ``stage`` reads for microbatch ``mb``."""
        return {lk.plan.name: lk.results[mb] for lk in self.lookups if lk.plan.stage == stage}

    def put_grad(self, name: str, mb: int, grad: torch.Tensor | None) -> None:
        """The gradient of lookup ``name``'s result for ``mb`` (None: it reached no loss)."""
        for lk in self.lookups:
            if lk.plan.name == name:
                lk.grads[mb] = grad if grad is not None else torch.zeros_like(lk.results[mb])

    def backward(self) -> None:
        """Every owner builds the gradient of its rows from the consuming rank's (collective)."""
        for lk in self.lookups:
            spec, m = lk.plan.spec, self.m
            if lk.consumer == self.groups.rank:
                assert sorted(lk.grads) == list(range(m)), f"lookup {lk.plan.name}: gradients of {sorted(lk.grads)}"
                flat = torch.cat([lk.grads[i].reshape(-1) for i in range(m)])
            else:
                flat = torch.empty(m * math.prod(spec.shape), dtype=spec.dtype, device=self.device)
            self._wait(dist.broadcast(flat, src=lk.consumer, group=self.groups.pp_group, async_op=True), lk,
                       "sending the gradient of" if lk.consumer == self.groups.rank else "receiving the gradient of")
            if lk.parts:
                torch.autograd.backward(lk.parts, [g.view(spec.shape) for g in flat.chunk(len(lk.parts))])
            lk.parts, lk.grads, lk.results = [], {}, []

