"""The SC21 paper's reference numbers (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM"), for benchmarks and tests.

Table 1 as in the project's seed (heads, hidden, layers, t, p, d, b, B, TFLOP/s per
GPU, % of 312). The interleaving v and the DDP kind are not in the table; they come
from the paper's own run script, Megatron-LM ``examples/sc21/run_table_1.sh``
(``--num-layers-per-virtual-pipeline-stage`` k gives v = l/(p·k); ``DDP=torch``
overlaps the gradient all-reduce with the backward, ``DDP=local`` does not). Every
row uses full recomputation (``--recompute-method uniform``).
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.options import CandidateLayout, DPOverlap, LayerBalance, PlannerOptions, ScheduleKind
from fxpipe.planner.shapes import TransformerShape, shape_from_registry


@dataclass(frozen=True, kw_only=True)
class Table1Row:
    """One row of SC21 Table 1."""

    model: str
    """fxpipe registry name."""
    label: str
    """The paper's name (1.7B … 1T)."""
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    chunks: int
    """Interleaving v from run_table_1.sh (1: plain 1F1B)."""
    torch_ddp: bool
    """DDP=torch in run_table_1.sh (gradient all-reduce overlapped with the backward)."""
    tflops: float
    """Achieved TFLOP/s per GPU."""
    percent: float
    """% of the A100's 312 TFLOP/s."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def shape(self) -> TransformerShape:
        return shape_from_registry(self.model)

    def config(self) -> CandidateLayout:
        m = self.global_batch // (self.dp * self.micro_batch)
        return CandidateLayout(
            tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, num_microbatches=m,
            chunks=self.chunks,
            schedule=ScheduleKind.INTERLEAVED if self.chunks > 1 else ScheduleKind.ONE_F_ONE_B,
            recompute=RecomputeMode.FULL)

    def options(self, base: PlannerOptions | None = None) -> PlannerOptions:
        """The paper's settings: Megatron's equal layer split, its DDP kind, scatter-gather on."""
        from dataclasses import replace
        base = base or PlannerOptions()
        return replace(base, balance=LayerBalance.MEGATRON, scatter_gather=True,
                       dp_overlap=DPOverlap.BACKWARD if self.torch_ddp else DPOverlap.NONE)


def _row(model, label, t, p, d, b, B, v, torch_ddp, tflops, percent) -> Table1Row:
    return Table1Row(model=model, label=label, tp=t, pp=p, dp=d, micro_batch=b, global_batch=B,
                     chunks=v, torch_ddp=torch_ddp, tflops=tflops, percent=percent)


TABLE1: tuple[Table1Row, ...] = (
    _row("gpt-1.7b", "1.7B", 1, 1, 32, 16, 512, 1, True, 137, 44),
    _row("gpt-3.6b", "3.6B", 2, 1, 32, 16, 512, 1, True, 138, 44),
    _row("gpt-7.5b", "7.5B", 4, 1, 32, 16, 512, 1, True, 142, 46),
    _row("gpt-18b", "18B", 8, 1, 32, 8, 1024, 1, True, 135, 43),
    _row("gpt-39b", "39B", 8, 2, 32, 4, 1536, 1, False, 138, 44),
    _row("gpt-76b", "76B", 8, 4, 32, 2, 1792, 3, False, 140, 45),   # 60 layers / 4 / 5 per chunk
    _row("gpt-145b", "145B", 8, 8, 24, 2, 2304, 2, False, 148, 47),  # 80 / 8 / 5
    _row("gpt-310b", "310B", 8, 16, 15, 1, 2160, 2, False, 155, 50),  # 96 / 16 / 3
    _row("gpt-530b", "530B", 8, 35, 9, 1, 2520, 3, False, 163, 52),   # 105 / 35 / 1
    _row("gpt-1t", "1T", 8, 64, 6, 1, 3072, 1, False, 163, 52),
)
