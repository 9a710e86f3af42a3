"""The configs the layout's passes take (tensor parallel, expert parallel, partition),
derived from a ``ParallelConfig`` in one place (``compiler/context.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fxpipe.base.hardware import CPU, Hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.partition.result import Method


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


@dataclass(frozen=True, kw_only=True)
class EPConfig:
    ep: int
    """Expert-parallel ranks: each owns E/ep experts of every MoE layer."""
    dp: int
    """Data-parallel replicas; ep must divide it (an expert group is ep consecutive dp ranks)."""

    def __post_init__(self) -> None:
        for name in ("ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            divisors = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}: the experts are owned by data-parallel "
                             f"ranks, choose ep among {divisors}")


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    num_stages: int
    """S = p·v."""
    stage_to_rank: tuple[int, ...]
    inflight: tuple[int, ...]
    """Peak microbatches whose activations each stage holds (``stage_inflight``)."""
    method: Method = Method.ILP
    """ilp | uniform | params | dp (a name is parsed by ``Method.parse``)."""
    memory_limit_bytes: int | None = None
    hardware: Hardware = CPU
    state_bytes_per_param_byte: float = 4.0
    """Bytes held per byte of parameter: the parameter, its gradient, and Adam's two
    moments, all in the parameter's dtype (fp32: 4 × 4 = 16 bytes per parameter)."""
    activation_scale: float = 1.0
    """Multiplies every activation estimate: e.g. 1/tp for a model that will be
    tensor-parallel with sequence parallelism (Korthikanti et al. 2022), 0.5 for
    bf16 activations of an fp32 capture."""
    allow_over_limit: bool = False
    """Return a plan over ``memory_limit_bytes`` instead of raising (uniform, params and dp
    may produce one: the first two ignore memory, dp falls back to the memory-blind
    optimum); for comparison tables. The ILP always honours the limit or raises."""
    node_times: Mapping[Any, tuple[float, float]] | None = None
    """Measured (fwd, bwd) seconds per fine node (``fxpipe.costs``); None: the hardware
    model's estimate from FLOPs and bytes."""
    elsewhere: frozenset[str] = frozenset()
    """Nodes that run outside the stages (the LM head and its loss under vocabulary passes,
    ``passes/vocab_head.py``: split over every rank): no time, no parameter memory and no
    activation for the stage holding them; their outputs still cost their bytes if cut."""
    spread: frozenset[str] = frozenset()
    """Canonical names of parameters that every pipeline rank holds an even share of rows
    of after ``vocab_rows`` (the LM head and its embedding table under vocabulary passes,
    ``vocab_head.vocab_row_params``): their state is charged ceil(bytes / ranks) to every
    rank rather than whole to the stage whose op reads them."""
    link: tuple[float, float] | None = None
    """Measured (latency s, bandwidth B/s) between pipeline ranks; None: the hardware's."""
    recompute: RecomputeMode = RecomputeMode.NONE
    """The recompute pass's mode, priced here: a recomputed region keeps only its inputs
    for backward and runs its forward again in backward (``passes/recompute.py``)."""
    recompute_runs: int = 1
    """How many times backward runs a region's forward again: 2 under a split backward
    (the input-gradient and the weight-gradient pass each recompute it)."""
    max_groups: int = 256
    memory_tiebreak: float = 0.03
    """ILP: among cuts within this share of the best bottleneck (what measurement noise
    cannot tell apart), the one whose fullest rank holds the least memory is taken."""
    time_limit_s: float = 10.0
    seed: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.num_stages or len(self.inflight) != self.num_stages:
            raise ValueError("stage_to_rank and inflight need one entry per stage")
        object.__setattr__(self, "method", Method.parse(self.method))  # frozen
