"""What a pipeline rank spends besides computing its stages: the CPU side of its
point-to-point transfers, and the embedding lookups it does for other ranks.

- **Transfers.** The runtime posts one send per value a stage hands to a stage on another
  rank and one receive per value it takes from one (``runtime/executor.py``), forward and,
  for values with gradients, backward. Each end costs the rank ``Hardware.transfer_cpu_s``
  of its own time besides the bytes on the link (gloo posts and completes a transfer on
  the calling thread); the link's latency and bandwidth stay in the simulated wait.
- **Lookups of a row-split table** (``runtime/lookup_exchange.py``): every rank holding
  rows of a table whose rows are split over the pipeline looks each microbatch's ids up in
  its own rows — every microbatch, whichever stage consumes it — sends its part to the
  consuming rank and later takes the gradient back and runs its part's backward. A GPT
  whose tied head sits whole on the last rank makes that rank do the whole table's lookup
  and its backward for the first rank, microbatch by microbatch: work the stages' own
  times do not hold. Each owner pays its part's forward and backward (timed, or the cost
  model) and two transfers; the consuming rank two transfers per other owner.
Both are added per microbatch to the rank's stage durations before the schedule is
simulated, as the action overhead is (``step_price.with_action_overhead``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from fxpipe.base.hardware import Hardware
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.schedules.simulate import StageDurations


@dataclass(frozen=True)
class LookupWork:
    """One row-split table's lookup, per microbatch."""
    tokens: int
    table_rows: int
    """Rows of the whole (tensor-parallel local) table."""
    hidden: int
    dtype: torch.dtype
    consumer: int
    """Pipeline rank of the stage that reads the summed lookup."""
    rows: tuple[int, ...]
    """Rows each pipeline rank looks up (each row by its lowest holder; 0: none)."""

    def part_key(self, rows: int) -> tuple:
        """What a part's time depends on: ``time_lookup_part``'s arguments."""
        return (self.tokens, self.table_rows, self.hidden, rows, self.dtype)


def lookup_work(plan: PipelinePlan, stage_to_rank: Callable[[int], int], pp: int) -> tuple[LookupWork, ...]:
    """Every row-split lookup of ``plan`` as the runtime runs it (module docstring)."""
    out = []
    for lk in plan.lookups:
        shard = plan.row_shards[lk.table]
        rows = [0] * pp
        for a, b, holders in shard.segments():
            rows[min(holders)] += b - a
        out.append(LookupWork(tokens=math.prod(lk.spec.shape[:-1]), table_rows=shard.rows, hidden=lk.spec.shape[-1],
                              dtype=lk.spec.dtype, consumer=stage_to_rank(lk.stage), rows=tuple(rows)))
    return tuple(out)


def transfer_counts(program: Program, stage_to_rank: Callable[[int], int],
                    num_stages: int) -> tuple[list[int], list[int]]:
    """Per stage, the point-to-point transfers its forward and its backward post: one per
    (value, stage on another rank) pair it receives from or sends to; backward, those of
    floating-point values (the gradients)."""
    fwd, bwd = [0] * num_stages, [0] * num_stages
    stages = program.stages
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in stages:
            continue  # batch inputs and parameters are on every rank that reads them
        src = stages[node.name]
        val = node.meta.get("val")
        grads = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        for dst in {stages[u.name] for u in node.users if u.name in stages}:
            if dst == src or stage_to_rank(dst) == stage_to_rank(src):
                continue
            for s in (src, dst):
                fwd[s] += 1
                bwd[s] += grads
    return fwd, bwd


def part_model_s(work: LookupWork, rows: int, hw: Hardware) -> tuple[float, float]:
    """A part's forward and backward from the cost model, where nothing was timed: the
    runtime's dozen small ops (forward) and half as many (backward), the result's bytes
    forward, the rows' dense gradient backward."""
    size = work.dtype.itemsize
    return (12 * hw.op_overhead_s + 2 * work.tokens * work.hidden * size / hw.memory_bw,
            6 * hw.op_overhead_s + (2 * rows * work.hidden + work.tokens * work.hidden) * size / hw.memory_bw)


def with_transfers(d: StageDurations, counts: tuple[Sequence[int], Sequence[int]], stage_ranks: Sequence[int],
                   lookups: Sequence[LookupWork], parts: Mapping[tuple, tuple[float, float]],
                   hw: Hardware) -> StageDurations:
    """``d`` with each stage's transfers (``transfer_cpu_s`` an end) and each rank's lookup
    work added to its first stage, per microbatch (module docstring). ``parts``: a part's
    (forward, backward) seconds by ``LookupWork.part_key``, where timed."""
    fwd, bwd = list(d.forward), list(d.backward)
    post = hw.transfer_cpu_s
    for s, (f, b) in enumerate(zip(*counts)):
        fwd[s] += post * f
        bwd[s] += post * b
    first = {}
    for s, r in enumerate(stage_ranks):
        first.setdefault(r, s)
    for work in lookups:
        owners = [r for r, n in enumerate(work.rows) if n and r != work.consumer]
        for r, n in enumerate(work.rows):
            if r not in first or (not n and r != work.consumer):
                continue
            pf, pb = parts.get(work.part_key(n)) or part_model_s(work, n, hw) if n else (0.0, 0.0)
            sends = 1 if r != work.consumer else len(owners)
            fwd[first[r]] += pf + post * sends
            bwd[first[r]] += pb + post * sends
    # Gradients travel, and parts take theirs, in the input-gradient half (I): W is unchanged.
    return dataclasses.replace(d, forward=tuple(fwd), backward=tuple(bwd))
