"""What every compile pass receives: the layout, and each pass's config derived from it
once (the schedule the partition is solved for, the tensor-parallel, expert-parallel and
partition configs), plus the front end's hooks. Here, below the passes, so that a pass
can take it (``name_pass(ir, ctx) -> ir``); the compile pipeline builds it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_configs import EPConfig, PartitionConfig, TPConfig
from fxpipe.ir.program import Program
from fxpipe.schedules.schedule import Schedule

T = TypeVar("T")
MeasureFn = Callable[[Program, PartitionConfig, "CompileContext"], PartitionConfig]


@dataclass(frozen=True)
class CompileHooks:
    """What the front ends do differently (``compiler/pipeline.py``'s docstring): how costs
    are measured, the caller's check of its input, and the one collective a compile needs."""
    measure: MeasureFn | None = None
    """Returns the partition config with measured node times and link (``fxpipe/costs``);
    None: the cost model's estimate is all there is."""
    node_times: Callable[[Program, PartitionConfig, "CompileContext"], dict] | None = None
    """(forward, backward) seconds of every node, already known (the layout search's timing
    at this layout's shapes, ``fxpipe/costs/local.py``): applied whatever the partition
    method, so a one-stage layout is priced on them too; ``measure`` is not called."""
    check: Callable[[Program], None] | None = None
    """Called once the whole model's facts are known (after ``model_stats``: token inputs
    and their vocabulary) and before anything expensive; raises on bad input."""
    decide: Callable[[Callable[[], Any]], Any] | None = None
    """``decide(fn)``: global rank 0 runs ``fn`` and every rank returns its result (the mesh
    broadcasts it). For what every rank must hold identically: the partition (a
    time-limited solver need not agree with itself) and the times the vocabulary passes
    are placed on (one collective order on every rank). None: one process, ``fn()``."""

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """``fn``'s result as global rank 0 computes it (``decide``), here computed locally
        when there is no mesh."""
        return fn() if self.decide is None else self.decide(fn)


@dataclass(frozen=True)
class CompileContext:
    """The second argument of every compile pass; build it with ``CompileContext.of``."""
    config: ParallelConfig
    schedule: Schedule
    """The compute-only schedule the partition is solved for (``ParallelConfig.schedule_ir``)."""
    device: torch.device
    hooks: CompileHooks = CompileHooks()
    tensor_parallel: TPConfig = TPConfig()
    """What the tensor-parallel pass reads (``tp_config_of`` finds it here)."""
    expert_parallel: EPConfig | None = None
    partition: PartitionConfig | None = None
    """The partition's config for ``schedule``, before measured costs refine it."""

    @classmethod
    def of(cls, config: ParallelConfig, *, device: torch.device | str = "cpu",
           hooks: CompileHooks = CompileHooks()) -> "CompileContext":
        """Every pass's config, derived from ``config`` here and nowhere else."""
        schedule = config.schedule_ir()
        return cls(config=config, schedule=schedule, device=torch.device(device), hooks=hooks,
                   tensor_parallel=config.tensor_parallel,
                   expert_parallel=config.expert_parallel if config.ep > 1 else None,
                   partition=config.partition_config(schedule))
