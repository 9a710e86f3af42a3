"""What every compile step receives: the layout, and each pass's config derived from it
once (the schedule the partition is solved for, the tensor-parallel, expert-parallel and
partition configs), plus the front end's hooks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_configs import EPConfig, PartitionConfig, TPConfig
from fxpipe.ir.program import Program
from fxpipe.passes.assign_stages import partition_pass
from fxpipe.schedules.schedule import Schedule

MeasureFn = Callable[[Program, PartitionConfig, "CompileContext"], PartitionConfig]
SolveFn = Callable[[Program, PartitionConfig], Program]


@dataclass(frozen=True)
class CompileHooks:
    """What the front ends do differently (``compiler/pipeline.py``'s docstring)."""
    measure: MeasureFn | None = None
    """Returns the partition config with measured node times and link (``fxpipe/costs``);
    None: the cost model's estimate is all there is."""
    node_times: Callable[[Program, PartitionConfig, "CompileContext"], dict] | None = None
    """(forward, backward) seconds of every node, already known (the layout search's timing
    at this layout's shapes, ``fxpipe/costs/local.py``): applied whatever the partition
    method, so a one-stage layout is priced on them too; ``measure`` is not called."""
    solve: SolveFn = partition_pass
    """Assigns stages (``passes/assign_stages.py``); the runtime's solves on rank 0 and broadcasts."""
    check: Callable[[Program], None] | None = None
    """Called once the whole model's facts are known (after ``model_stats``: token inputs
    and their vocabulary) and before anything expensive; raises on bad input."""
    agree: Callable[[Any], Any] | None = None
    """Global rank 0's value of its argument, on every rank (the runtime broadcasts it):
    what the vocabulary passes are placed on, so that every rank walks one collective
    order; None: one process, its own value."""


@dataclass(frozen=True)
class CompileContext:
    """The ``config`` every compile step receives; build it with ``CompileContext.of``."""
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
