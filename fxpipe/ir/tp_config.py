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
    scatter_gather: bool = False
    """Whether the runtime sends replicated stage outputs as 1/tp chunks (SC21 §4.1):
    decided by ``ParallelConfig`` (its one default), reported by the pass, not used by it."""
    strict: bool = False
    """Raise (``ValueError``) instead of keeping weight matrices whole on every rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer, got {self.tp!r}")
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over the TP group)")


def tp_config_of(config: object) -> TPConfig:
    """The TPConfig inside a driver config: a TPConfig, or an object whose
    ``tensor_parallel`` is one (``ParallelConfig`` builds it, the pipeline's context
    passes it on); None: no tensor parallelism."""
    if config is None:
        return TPConfig()
    if isinstance(config, TPConfig):
        return config
    inner = getattr(config, "tensor_parallel", None)
    if not isinstance(inner, TPConfig):
        raise TypeError(f"the tensor-parallel pass takes a TPConfig or a config with a tensor_parallel "
                        f"TPConfig (ParallelConfig), got {type(config).__name__}")
    return inner
