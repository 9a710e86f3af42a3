"""The (pp, dp, tp) device mesh and its process groups.

Rank layout, as in Megatron-LM (``initialize_model_parallel``): tensor parallel is
innermost — the tp ranks of one stage are consecutive global ranks, so they share
a node and its NVLink — then data parallel, then pipeline parallel outermost:

    global_rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

Example, tp=2, dp=2, pp=2 (8 ranks): tp groups {0,1} {2,3} {4,5} {6,7};
dp groups {0,2} {1,3} {4,6} {5,7}; pp groups {0,4} {1,5} {2,6} {3,7}.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int
    pp: int

    def __post_init__(self) -> None:
        for axis in ("tp", "dp", "pp"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(pp=p, dp=d, tp=t) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(pp=p, dp=d, tp=t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(pp=p, dp=d, tp=t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]


@dataclass
class MeshGroups:
    """This rank's coordinates and the process groups it belongs to."""
    mesh: Mesh
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    tp_group: Any
    dp_group: Any
    pp_group: Any

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the same (dp, tp) position in another pipeline stage."""
        return self.mesh.rank(pp=pp_rank, dp=self.dp_rank, tp=self.tp_rank)


def _new_groups(groups: Iterable[list[int]], rank: int, timeout: timedelta) -> Any:
    """Create every group (all ranks must call new_group for each, in one order);
    return the one containing ``rank``."""
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks=ranks, timeout=timeout)
        if rank in ranks:
            mine = g
    return mine


def build_groups(mesh: Mesh, timeout: timedelta) -> MeshGroups:
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = mesh.coords(rank)
    return MeshGroups(mesh=mesh, rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                      tp_group=_new_groups(mesh.tp_groups(), rank, timeout),
                      dp_group=_new_groups(mesh.dp_groups(), rank, timeout),
                      pp_group=_new_groups(mesh.pp_groups(), rank, timeout))


def subgroup(ranks_by_group: Iterable[list[int]], rank: int, timeout: timedelta) -> Any:
    """A family of groups created collectively (e.g. the tied-embedding groups)."""
    return _new_groups(ranks_by_group, rank, timeout)
