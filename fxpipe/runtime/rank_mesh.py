"""``RankMesh``: this rank's place in the mesh, joined once — the process group, the layout
with ``dp`` resolved against the world, the pp/dp/tp groups, the device, the
tensor-parallel group and dropout streams, and the context stage code runs in. The
compile hooks and the runtime both read it (``fxpipe/parallel.py``)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from fxpipe.ep import expert_group_context
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.runtime.experts import ExpertGroups, build_expert_groups
from fxpipe.runtime.launch import init_distributed
from fxpipe.runtime.mesh import Mesh, MeshGroups, build_groups
from fxpipe.tp import DropoutRNG, ProcessGroupTP, TPGroup, tp_group_context


@dataclass(frozen=True)
class RankMesh:
    config: ParallelConfig
    """The layout, ``dp`` resolved against the world size."""
    groups: MeshGroups
    device: torch.device
    tp_group: TPGroup
    tp_rng: DropoutRNG
    """The tensor-parallel dropout streams (Megatron's RNG tracker)."""
    context: Callable[[], ContextManager]
    """Entered around stage code: the tensor-parallel group and dropout streams (and,
    under expert parallelism, the expert group)."""
    experts: ExpertGroups | None = None

    @classmethod
    def join(cls, config: ParallelConfig, device: torch.device | None = None) -> "RankMesh":
        """Join (or reuse) the process group and build this rank's groups: collective."""
        timeout = timedelta(seconds=config.timeout_s)
        device = init_distributed(timeout, device)
        config = config.with_world(dist.get_world_size())
        groups = build_groups(Mesh(tp=config.tp, dp=config.dp, pp=config.pp), timeout)
        tp_group, rng = ProcessGroupTP(groups.tp_group), DropoutRNG(config.seed, groups.tp_rank)
        context = (lambda: tp_group_context(tp_group, rng)) if config.tp > 1 else contextlib.nullcontext
        return cls(config, groups, device, tp_group, rng, context)

    def with_experts(self, expert_params: frozenset[str]) -> "RankMesh":
        """The expert groups for the parameters the expert-parallel pass found (every rank
        creates them in one order), their context around the tensor-parallel one."""
        experts = build_expert_groups(self.groups, self.config.ep, expert_params,
                                      timedelta(seconds=self.config.timeout_s))
        return dataclasses.replace(self, experts=experts,
                                   context=functools.partial(_expert_context, experts, self.context))


@contextlib.contextmanager
def _expert_context(experts: ExpertGroups, inner: Callable[[], Any]):
    """The expert group's context (``fxpipe/ep``) around the tensor-parallel one."""
    with expert_group_context(experts.group, experts.context), inner():
        yield
