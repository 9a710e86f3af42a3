"""The smallest per-rank memory limit any valid assignment can meet.

When a limit is infeasible the user needs the number that would work, not just
"infeasible". It is the optimum of min over assignments of max over ranks of rank
memory, solved exactly with CP-SAT on the same encoding as the ILP (bytes are
integers, so no rounding). If the solver stops early the error reports both the
best assignment found (a limit that surely fits) and the proven lower bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fxpipe.partition.chain_dp import min_memory_split
from fxpipe.partition.encoding import StageEncoding, solver_for
from fxpipe.partition.problem import PartitionError, PartitionProblem
from fxpipe.partition.stage_cost import evaluate

GIB = 2**30
"""Bytes per GiB: the unit of ``--memory-limit`` (and of what the messages print)."""


def gib(nbytes: float) -> str:
    """Bytes in GiB, four significant digits (small models' stages are far below 1 GiB)."""
    return f"{nbytes / GIB:.4g} GiB"


@dataclass(frozen=True, kw_only=True)
class MemoryFloor:
    """Result of minimising the largest rank memory."""

    fitting_limit_bytes: int
    """Peak rank memory of the best assignment found: a limit this large fits."""
    lower_bound_bytes: int
    """No assignment fits under this (equals fitting_limit_bytes when proven)."""
    rank: int
    """The binding rank of that assignment (the lowest one at the peak)."""
    stage_memory: tuple[tuple[int, int, int, int], ...]
    """(stage, static bytes, activation bytes per microbatch, inflight) of the binding rank."""
    stages: tuple[int, ...]
    """The assignment (stage per node, problem order)."""

    @property
    def proven(self) -> bool:
        return self.lower_bound_bytes >= self.fitting_limit_bytes


class MemoryLimitError(PartitionError):
    """No assignment fits ``memory_limit_bytes``; ``floor`` holds the smallest limit that does."""

    def __init__(self, problem: PartitionProblem, floor: MemoryFloor) -> None:
        self.floor = floor
        limit = problem.memory_limit_bytes
        parts = ", ".join(f"stage {k}: {gib(st)} static + {m} x {gib(act)} activations"
                          for k, st, act, m in floor.stage_memory)
        smallest = (f"the smallest limit that fits is {gib(floor.fitting_limit_bytes)} "
                    f"({floor.fitting_limit_bytes} B)" if floor.proven else
                    f"the smallest limit that fits is between {gib(floor.lower_bound_bytes)} "
                    f"(proven) and {gib(floor.fitting_limit_bytes)} "
                    f"({floor.fitting_limit_bytes} B, found)")
        super().__init__(
            f"memory limit {gib(limit)} ({limit} B) per rank cannot be met by any "
            f"stage assignment: {smallest}; at that optimum rank {floor.rank} binds ({parts}). "
            f"Raise the limit, use more pipeline stages, or hold fewer microbatches in flight "
            f"(recompute activations).")


def trivial_memory_bound(problem: PartitionProblem) -> int:
    """Sound floor: each node costs at least static + act·min(inflight) on some rank,
    so the peak is at least the largest node and the average over ranks."""
    m = min(problem.inflight)
    need = [st + m * a for st, a in zip(problem.static_bytes, problem.act_bytes)]
    return max(max(need), -(-sum(need) // problem.num_ranks))


def memory_floor(problem: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0,
                 num_workers: int = 1) -> MemoryFloor:
    """Minimise the peak rank memory over all valid assignments (see module doc).
    Starts from the memory-minimal contiguous split (exact on chains, one stage per rank)."""
    start = min_memory_split(problem)
    stages, bound = start, trivial_memory_bound(problem)
    if problem.num_stages > 1:
        from ortools.sat.python import cp_model  # ~1 s to import: only where a model is solved

        model = cp_model.CpModel()
        enc = StageEncoding(model, problem)
        total = sum(problem.static_bytes) + max(problem.inflight) * sum(problem.act_bytes)
        peak = model.NewIntVar(0, total, "peak_bytes")
        for r in range(problem.num_ranks):
            model.Add(peak >= enc.rank_memory(r))
        model.Minimize(peak)
        enc.add_hint(start)
        model.AddHint(peak, max(evaluate(problem, start)[1]))
        solver = solver_for(time_limit_s, seed, num_workers)
        status = solver.Solve(model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stages = enc.stages(solver)
            bound = max(bound, int(math.ceil(solver.BestObjectiveBound() - 1e-6)))
    costs, rank_memory = evaluate(problem, stages)
    peak_bytes = max(rank_memory)
    if problem.num_stages == 1:
        bound = peak_bytes
    rank = rank_memory.index(peak_bytes)
    return MemoryFloor(
        fitting_limit_bytes=peak_bytes, lower_bound_bytes=min(bound, peak_bytes), rank=rank,
        stage_memory=tuple((c.stage, c.static_bytes, c.act_bytes, c.inflight)
                           for c in costs if c.rank == rank),
        stages=tuple(stages))
