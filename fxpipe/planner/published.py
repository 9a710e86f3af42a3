"""Published measured training runs with their layouts (``/work/shared/published_runs.md``),
for pricing with the published layout pinned (``benchmarks/paper_table1.py``,
``tests/planner/test_plan_cluster.py``).

- Megatron-LM's README "Performance Benchmarking" table (H100 80GB SXM, July 2024, Megatron-
  Core r0.8.0): V = 131072, s = 4096, data-, tensor- and pipeline-parallel communication
  overlap on. The iteration time is the row's model FLOPs (72·B·s·l·h²(1 + s/6h + V/12lh),
  no recomputation counted) / (TFLOP/s per GPU × GPUs). Micro-batch size, interleaving,
  recompute and SP are not published: they are searched with the rest pinned. Megatron-Core
  runs attention through Transformer Engine's fused (flash) kernel, reduces gradients with its
  distributed optimizer (``--use-distributed-optimizer``, which its DP overlap builds on),
  keeps Megatron's default dropout (0.1) and offers 1F1B and interleaving: all pinned as
  the setting of the runs, not as a fit.
- Korthikanti et al. 2023 (MLSys), Tables 3 and 5: A100 80GB, s = 2048, d = 1, seconds per
  iteration for full recompute and for SP + selective recompute; interleaving v = 3 for
  175B and 530B. 2022 Megatron: unfused attention with dropout 0.1 (the reason selective
  recompute exists), no TP overlap, no distributed optimizer (d = 1 makes it moot).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fxpipe.base.hardware import A100, H100, Hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.options import DPOverlap, LayerBalance, LayoutPins, PlannerOptions, ScheduleKind
from fxpipe.planner.shapes import TransformerShape, model_flops_formula


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published measurement with the layout it ran."""

    source: str
    label: str
    heads: int
    hidden: int
    layers: int
    seq: int
    vocab: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    iteration_s: float
    """Measured seconds per iteration (derived from TFLOP/s for the Megatron table)."""
    micro_batch: int | None = None
    """Published micro-batch size (None: not published, searched)."""
    chunks: int | None = None
    """Published interleaving v (None: not published, searched)."""
    recompute: RecomputeMode | None = None
    """Published recompute (None: searched)."""
    sequence_parallel: bool | None = None
    """Published SP (None: searched)."""
    hardware: Hardware = A100
    fused_attention: bool = False
    dropout: bool = True
    zero: int = 0
    tp_overlap: bool = False
    dp_overlap: DPOverlap = DPOverlap.NONE
    schedules: tuple[ScheduleKind, ...] = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED)
    """What the run's framework offers (Megatron: 1F1B and interleaved); the search's own
    choice beside it may use every schedule fxpipe runs."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def shape(self) -> TransformerShape:
        """A GPT stack of the row's shape (learned or rotary positions do not change the FLOPs)."""
        return TransformerShape(name=f"gpt-{self.label}", layers=self.layers, hidden=self.hidden, heads=self.heads,
                                seq=self.seq, vocab=self.vocab, dropout=self.dropout,
                                fused_attention=self.fused_attention)

    def options(self, pinned: bool = True) -> PlannerOptions:
        """The run's settings; ``pinned``: its published layout fixed, the rest searched."""
        schedule = None if self.chunks is None or self.pp == 1 else (
            ScheduleKind.INTERLEAVED if self.chunks > 1 else ScheduleKind.ONE_F_ONE_B)
        pins = LayoutPins(tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch,
                          chunks=self.chunks if self.pp > 1 else None, schedule=schedule) if pinned else LayoutPins()
        base = PlannerOptions(hardware=self.hardware, balance=LayerBalance.MEGATRON, dp_overlap=self.dp_overlap,
                              tp_overlap=self.tp_overlap, zeros=(self.zero,), pins=pins, sequence_parallel=None)
        if pinned:
            base = replace(base, recomputes=(self.recompute,) if self.recompute else base.recomputes,
                           sequence_parallel=self.sequence_parallel, schedules=self.schedules)
        return base


def _megatron(label: str, a: int, h: int, l: int, t: int, p: int, d: int, B: int, tflops: float) -> PublishedRun:  # noqa: E741
    s, V = 4096, 131072
    seconds = model_flops_formula(B, s, l, h, V) / (tflops * 1e12 * t * p * d)
    return PublishedRun(source="Megatron-LM README (H100)", label=label, heads=a, hidden=h, layers=l, seq=s, vocab=V,
                        tp=t, pp=p, dp=d, global_batch=B, iteration_s=seconds, hardware=H100,
                        fused_attention=True, dropout=True, zero=1, tp_overlap=True, dp_overlap=DPOverlap.BACKWARD)


def _korthikanti(label: str, a: int, h: int, l: int, t: int, p: int, B: int, b: int, v: int,  # noqa: E741
                 full_s: float, selective_s: float) -> tuple[PublishedRun, PublishedRun]:
    common = dict(source="Korthikanti et al. 2023, Table 5 (A100)", heads=a, hidden=h, layers=l, seq=2048,
                  vocab=51200, tp=t, pp=p, dp=1, global_batch=B, micro_batch=b, chunks=v)
    return (PublishedRun(label=f"{label} full", iteration_s=full_s, recompute=RecomputeMode.FULL,
                         sequence_parallel=False, **common),
            PublishedRun(label=f"{label} sp+selective", iteration_s=selective_s, recompute=RecomputeMode.SELECTIVE,
                         sequence_parallel=True, **common))


MEGATRON_H100: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    _megatron("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    _megatron("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    _megatron("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    _megatron("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    _megatron("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    _megatron("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
)

KORTHIKANTI_TABLE5: tuple[PublishedRun, ...] = (
    *_korthikanti("22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.42, 1.10),
    *_korthikanti("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13, 13.75),
    *_korthikanti("530B", 128, 20480, 105, 8, 35, 280, 1, 3, 49.05, 37.83),
    *_korthikanti("1T", 160, 25600, 128, 8, 64, 512, 1, 1, 94.42, 71.49),
)

PUBLISHED: tuple[PublishedRun, ...] = MEGATRON_H100 + KORTHIKANTI_TABLE5
