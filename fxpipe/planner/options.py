"""What the planner chooses (``CandidateLayout``) and what it is told (``PlannerOptions``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from fxpipe.base.hardware import A100, Hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.base.train_state import state_bytes
from fxpipe.schedules.registry import ScheduleKind

PLANNED: tuple[ScheduleKind, ...] = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED, ScheduleKind.ZB_H1)
"""The schedules the planner prices (SC21's two and zero bubble H1); GPipe and ZB-V run
in fxpipe but have no per-layer memory model here."""


@dataclass(frozen=True, kw_only=True)
class CandidateLayout:
    """One point of the search space: a full training layout."""

    tp: int
    """Tensor-parallel size t."""
    pp: int
    """Pipeline-parallel size p (ranks)."""
    dp: int
    """Data-parallel size d = N/(t·p)."""
    micro_batch: int
    """Sequences per microbatch b."""
    num_microbatches: int
    """Microbatches per pipeline per iteration m = B/(d·b)."""
    chunks: int = 1
    """Stages per pipeline rank v (interleaving)."""
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    recompute: RecomputeMode = RecomputeMode.NONE
    sequence_parallel: bool = False
    """Korthikanti et al. 2022 sequence parallelism (only meaningful with t > 1)."""
    vocab_passes: bool = False
    """The LM head and cross-entropy run as vocabulary passes on every pipeline rank
    (``VocabPasses``); needs p >= 2."""
    zero: int = 0
    """1: ZeRO stage 1 / Megatron's distributed optimizer (``fxpipe run --zero 1``): the fp32
    masters and Adam moments sharded over the d replicas; the gradient all-reduce becomes a
    reduce-scatter, and the updated weights come back by an all-gather."""

    def __post_init__(self) -> None:
        if self.zero not in (0, 1):
            raise ValueError(f"CandidateLayout.zero must be 0 or 1, got {self.zero}")
        for f in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "chunks"):
            if getattr(self, f) < 1:
                raise ValueError(f"CandidateLayout.{f} must be >= 1, got {getattr(self, f)}")
        planned_schedule(self.schedule)
        if self.chunks > 1 and self.schedule is not ScheduleKind.INTERLEAVED:
            raise ValueError(f"chunks={self.chunks} needs the interleaved schedule, not "
                             f"{self.schedule.value}")
        if self.vocab_passes and self.pp < 2:
            raise ValueError(f"vocab_passes=True with pp={self.pp}: they split the head over pipeline ranks, "
                             f"use pp >= 2")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def label(self) -> str:
        sp = " sp" if self.sequence_parallel and self.tp > 1 else ""
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        vocab = " vocab-passes" if self.vocab_passes else ""
        zero = " zero1" if self.zero else ""
        return (f"t={self.tp} p={self.pp} d={self.dp} b={self.micro_batch} m={self.num_microbatches}"
                f"{v} {self.schedule.value} recompute={self.recompute.value}{sp}{vocab}{zero}")


@dataclass(frozen=True, kw_only=True)
class LayoutPins:
    """Layout fields the user fixed (``fxpipe plan --tp 8 --pp 2 ...``, the flags ``fxpipe run``
    takes); None leaves a field to the search. All given: the search prices that one layout."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    num_microbatches: int | None = None
    chunks: int | None = None
    schedule: ScheduleKind | None = None

    def admits(self, cfg: "CandidateLayout") -> bool:
        return all(want is None or getattr(cfg, f) == want for f, want in vars(self).items())


class LayerBalance(enum.Enum):
    """How the l layers are dealt to the p·v stages."""
    MEGATRON = "megatron"
    """l/(p·v) layers per stage; l must divide (Megatron's rule). The embedding sits on the
    first stage and the LM head on the last, on top of their layers."""
    FXPIPE = "fxpipe"
    """Whole layers, any l: each layer goes to the stage whose predicted time is least so
    far (optimal for identical layers), so the stages holding the embedding or the LM head
    get fewer layers. fxpipe's ILP partitioner balances the captured graph the same way
    (it may even cut inside a layer, which this model does not)."""


class DPOverlap(enum.Enum):
    """When the data-parallel gradient all-reduce runs."""
    NONE = "none"
    """After the rank's last backward (``bucket_mb=0``; Megatron's ``DDP=local``)."""
    BACKWARD = "backward"
    """Bucketed during the last microbatch's backward (fxpipe's runtime by default, torch
    DDP; Megatron's ``DDP=torch``): only what outlasts that backward is exposed
    (``dp_overlap.py``)."""


class GradAccumulation(enum.Enum):
    """How each microbatch's weight gradient joins the gradient the step reduces."""
    FUSED = "fused"
    """The weight-gradient GEMM accumulates into the gradient buffer itself (Megatron's
    ``--gradient-accumulation-fusion``, on by default since 2022, Megatron-Core): no pass
    of its own."""
    SEPARATE = "separate"
    """The GEMM writes a fresh gradient and an element-wise pass adds it to the
    accumulator, every microbatch, on every parameter the rank holds: Megatron 2021's
    ``main_grad.add_(grad)`` hook (``DDP=local``), autograd's ``AccumulateGrad``. It reads
    the new gradient (compute dtype) and reads and writes the accumulator (``grad_bytes``)."""


class VocabPasses(enum.Enum):
    """Which layouts run the LM head as vocabulary passes (Yeung et al., MLSys 2025;
    ``ParallelConfig(vocab_passes=True)``): every pipeline rank owns V/(t·p) rows of the
    head and the tied embedding and runs its block's S and T per microbatch."""
    OFF = "off"
    """The head on the last stage, the embedding on the first (SC21's layout)."""
    ON = "on"
    """Every layout runs them; layouts with p = 1 (nothing to split over) are not searched."""
    SEARCH = "search"
    """Both variants of every layout with p >= 2 are candidates."""


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """The cost model's settings and the search space's bounds."""

    hardware: Hardware = A100
    dtype_bytes: int = 2
    """Bytes per activation/weight element in compute (fp16/bf16: 2; fp32 CPU runs: 4)."""
    bytes_per_param: float = 18.0
    """Training state per parameter: fp16 weight 2 + fp32 gradient 4 + fp32 master weight 4
    + Adam moments 8 (Megatron's mixed precision), sharded over t·p only (``StateBytes``
    splits it by kind; ZeRO-1 divides the last two by d)."""
    grad_bytes: int = 4
    """Bytes per gradient element in the data-parallel all-reduce (the fp32 gradient the
    18-byte count holds)."""
    optimizer_bytes_per_param: float = 32.0
    """Memory traffic of the Adam step per parameter (read gradient, read/write master
    weight and both moments, write the fp16 copy)."""
    grad_accumulation: GradAccumulation = GradAccumulation.FUSED
    """Whether each microbatch's weight gradients cost an element-wise pass
    (``GradAccumulation``; the SC21 runs' 2021 Megatron: ``SEPARATE``)."""
    optimizer: bool = True
    """Count the optimizer step in the iteration (False: compare with ``train_step`` only)."""
    fused_attention: bool = False
    """Flash-style attention: no s×s tensor is stored or streamed (the 5as/h activation term
    and the softmax/dropout traffic vanish). The paper (2021) had none."""
    scatter_gather: bool = True
    """SC21 §4.1: each TP rank sends 1/t of a stage boundary, the receiver all-gathers."""
    dp_overlap: DPOverlap = DPOverlap.NONE
    balance: LayerBalance = LayerBalance.FXPIPE
    schedules: tuple[ScheduleKind, ...] = PLANNED
    recomputes: tuple[RecomputeMode, ...] = tuple(RecomputeMode)
    sequence_parallel: bool | None = False
    """Use sequence parallelism in every layout with t > 1 (True), in none (False), or price
    every t > 1 layout both ways (None: searched)."""
    zeros: tuple[int, ...] = (0,)
    """ZeRO stages to search (``CandidateLayout.zero``): (0,), (1,) or (0, 1)."""
    pins: LayoutPins = LayoutPins()
    """Layout fields fixed by the user."""
    tp_overlap: bool = False
    """TP collectives overlapped with the GEMMs beside them (Megatron-Core's
    ``--tp-comm-overlap``, Transformer Engine's userbuffers): a layer's TP time is exposed
    only where it outlasts the layer's GEMMs of the same pass."""

    vocab_passes: VocabPasses = VocabPasses.OFF
    """Price the head on the last stage, as vocabulary passes, or both (``VocabPasses``).
    OFF by default, as ``ParallelConfig.vocab_passes`` is: the plan describes what
    ``fxpipe run`` does without the flag."""
    max_tp: int | None = None
    """Largest t to try (None: any divisor of the heads; t > gpus_per_node crosses nodes)."""
    max_chunks: int = 4
    """Largest v for the interleaved schedule."""
    max_micro_batch: int = 16
    """Largest b to try."""
    simulate_budget: int = 8000
    """Pipelines with p·m·v above this are simulated at two smaller m and extrapolated
    (exact for 1F1B and ZB-H1; see ``pipeline.py``)."""

    @property
    def accumulation_bytes_per_param(self) -> float:
        """Memory traffic per parameter and microbatch of accumulating its gradient outside
        the GEMM: read the new gradient, read and write the accumulator (0 when fused)."""
        if self.grad_accumulation is GradAccumulation.FUSED:
            return 0.0
        return float(self.dtype_bytes + 2 * self.grad_bytes)

    def state_bytes(self, zero: int, dp: int) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes per parameter on one GPU: the weights in
        the compute dtype, the gradients as reduced (``grad_bytes``), the rest of
        ``bytes_per_param`` (fp32 masters + Adam moments: 12 of 18) sharded over d by ZeRO-1
        (the ZeRO paper's accounting; Megatron's distributed optimizer: 6 + 12/d)."""
        return state_bytes(self.dtype_bytes, self.grad_bytes, self.bytes_per_param, zero=bool(zero), dp=dp)

    def __post_init__(self) -> None:
        if any(z not in (0, 1) for z in self.zeros) or not self.zeros:
            raise ValueError(f"zeros must be a non-empty subset of (0, 1), got {self.zeros}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if not self.schedules or not self.recomputes:
            raise ValueError("give at least one schedule and one recompute mode to search")
        for kind in self.schedules:
            planned_schedule(kind)
        if self.max_chunks < 1 or self.max_micro_batch < 1:
            raise ValueError(f"max_chunks and max_micro_batch must be >= 1, got "
                             f"{self.max_chunks}, {self.max_micro_batch}")


def planned_schedule(name: "str | ScheduleKind") -> ScheduleKind:
    """A schedule the planner prices, or a ValueError listing them."""
    kind = ScheduleKind.parse(name)
    if kind not in PLANNED:
        raise ValueError(f"schedule {kind.value!r} is not priced by the planner; valid: "
                         f"{', '.join(k.value for k in PLANNED)}")
    return kind
