"""The one result type every partitioning method returns."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from fxpipe.base.enums import NamedEnum
from fxpipe.partition.problem import Node, PartitionProblem
from fxpipe.partition.stage_cost import StageCost, evaluate


class Method(str, NamedEnum, what="partition method", valid="valid methods"):
    """Partitioning methods, by the names ``fxpipe compile --partition`` accepts."""

    ILP = "ilp"
    """CP-SAT on the DAG, warm-started by the chain DP (optimal up to the reported gap)."""
    UNIFORM = "uniform"
    """Megatron-LM's default: transformer layers split evenly over the stages."""
    PARAMS = "params"
    """DeepSpeed's ``partition_method='parameters'``: balance parameter counts."""
    DP = "dp"
    """Optimal contiguous split of one topological order (chain dynamic program)."""


class SolveStatus(enum.Enum):
    OPTIMAL = "optimal"
    """Proven optimal in the ILP's integer-tick model (S = 1: trivially); ``gap`` is then
    only the time resolution, about 1e-5."""
    FEASIBLE = "feasible"
    """The solver stopped at its limit; ``gap`` bounds the distance to the optimum."""
    HEURISTIC = "heuristic"
    """A baseline or the chain DP: no optimality claim on the DAG."""


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """A stage assignment with its predicted costs."""

    method: Method
    status: SolveStatus
    assignment: tuple[tuple[Node, int], ...]
    """(node, stage) for every node, in the problem's topological node order."""
    stages: tuple[StageCost, ...]
    """Predicted cost of each stage, index = stage."""
    rank_memory_bytes: tuple[int, ...]
    """Memory of each pipeline rank (sum over its stages)."""
    memory_limit_bytes: int | None
    bottleneck_s: float
    """max over stages of time_s: the predicted time per microbatch of the pipeline."""
    lower_bound_s: float
    """Proven lower bound on the optimal bottleneck. ILP: CP-SAT's best objective
    bound (costs rounded *down* to the time resolution, so it stays sound); other
    methods: max(largest node, total compute / S)."""
    gap: float
    """(bottleneck_s - lower_bound_s) / bottleneck_s: how far from optimal at worst."""
    wall_time_s: float
    time_resolution_s: float = 0.0
    """Seconds per integer tick in the ILP (0 for methods that use exact floats)."""

    @cached_property
    def stage_of(self) -> dict[Node, int]:
        return dict(self.assignment)

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """Stage of each node, in the problem's node order."""
        return tuple(k for _, k in self.assignment)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def balance_ratio(self) -> float:
        """max / mean stage time (1.0 is perfect balance)."""
        times = [c.time_s for c in self.stages]
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    @property
    def rank_param_share(self) -> tuple[float, ...]:
        """Each pipeline rank's share of the parameters the partition placed (ideal 1/ranks)."""
        ranks = max(c.rank for c in self.stages) + 1
        held = [0] * ranks
        for c in self.stages:
            held[c.rank] += c.params
        total = sum(held)
        return tuple(h / total if total else 1 / ranks for h in held)

    @property
    def fits_memory(self) -> bool:
        return self.memory_limit_bytes is None or max(self.rank_memory_bytes) <= self.memory_limit_bytes

    def nodes_of(self, stage: int) -> tuple[Node, ...]:
        return tuple(n for n, k in self.assignment if k == stage)


def make_result(problem: PartitionProblem, stages: Sequence[int], *, method: Method,
                status: SolveStatus, lower_bound_s: float, wall_time_s: float,
                time_resolution_s: float = 0.0) -> PartitionResult:
    """Score a valid assignment (one stage per node, ``problem.nodes`` order)."""
    stages = tuple(int(k) for k in stages)
    problem.check_stages(stages)
    costs, rank_memory = evaluate(problem, stages)
    bottleneck = max(c.time_s for c in costs)
    assert lower_bound_s <= bottleneck * (1 + 1e-9) + 1e-12, (lower_bound_s, bottleneck)
    lower = min(lower_bound_s, bottleneck)  # float noise only
    return PartitionResult(
        method=method, status=status, assignment=tuple(zip(problem.nodes, stages)),
        stages=costs, rank_memory_bytes=rank_memory,
        memory_limit_bytes=problem.memory_limit_bytes, bottleneck_s=bottleneck,
        lower_bound_s=lower, gap=(bottleneck - lower) / bottleneck if bottleneck > 0 else 0.0,
        wall_time_s=wall_time_s, time_resolution_s=time_resolution_s)
