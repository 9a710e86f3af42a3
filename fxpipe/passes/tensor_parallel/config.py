"""Configuration of the tensor-parallel pass."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TPConfig:
    tp: int = 1
    """Tensor-parallel size t: ranks that split every sharded layer."""
    sp: bool = False
    """Sequence parallelism (Korthikanti et al. 2022): norms, dropout and residuals
    run on sequence shards; reduce-scatter/all-gather replace the all-reduces."""
    scatter_gather: bool | None = None
    """SC21 §4.1 scatter-gather of replicated stage outputs; None: on when tp > 1
    and sp is off (with sp the boundary activation is already a sequence shard)."""
    strict: bool = False
    """Raise (``ValueError``) instead of keeping weight matrices whole on every rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer, got {self.tp!r}")
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over the TP group)")

    @property
    def use_scatter_gather(self) -> bool:
        if self.scatter_gather is None:
            return self.tp > 1 and not self.sp
        return self.scatter_gather and self.tp > 1


def tp_config_of(config: object) -> TPConfig:
    """The TPConfig inside a driver config: a TPConfig, an object with a
    ``tensor_parallel`` TPConfig, or one with ``tp`` (and ``sp``) attributes."""
    if config is None:
        return TPConfig()
    if isinstance(config, TPConfig):
        return config
    inner = getattr(config, "tensor_parallel", None)
    if isinstance(inner, TPConfig):
        return inner
    if hasattr(config, "tp"):
        return TPConfig(tp=int(getattr(config, "tp")), sp=bool(getattr(config, "sp", False)),
                        scatter_gather=getattr(config, "scatter_gather", None),
                        strict=bool(getattr(config, "strict_tp", False)))
    return TPConfig()
