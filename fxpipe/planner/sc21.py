"""The SC21 paper's reference numbers (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM"), for benchmarks and tests.

Table 1 as in the project's seed (heads, hidden, layers, t, p, d, b, B, TFLOP/s per
GPU, % of 312). The interleaving v and the DDP kind are not in the table; they come
from the paper's own run script, Megatron-LM ``examples/sc21/run_table_1.sh``
(``--num-layers-per-virtual-pipeline-stage`` k gives v = l/(p·k); ``DDP=torch``
overlaps the gradient all-reduce with the backward, ``DDP=local`` does not). Every
row uses full recomputation (``--recompute-method uniform``).

The rest of the runs' settings (``Table1Row.options``) are the 2021 Megatron-LM those
scripts ran (``CONFIG.sh``: ``--fp16 --loss-scale 8192 --clip-grad 1.0``, no
``--accumulate-allreduce-grads-in-fp32``):

- fp16 gradients: accumulated and all-reduced in the parameters' dtype (2 bytes), so
  16 bytes of training state per parameter, not the 18 of an fp32 gradient;
- the gradient accumulation is its own pass (``GradAccumulation.SEPARATE``): every
  microbatch's weight gradients are written by the GEMM and then added to the gradient
  buffer (``DDP=local``: the ``main_grad.add_(grad)`` hook; ``DDP=torch``: autograd's
  accumulation and DDP's copies into and out of its buckets, about as many bytes).
  Fusing it into the weight-gradient GEMM (``--gradient-accumulation-fusion``) came to
  Megatron in 2022, so Korthikanti et al.'s runs of the same pipelines do not pay it
  (``published.py``): the paper's 1T (d = 6) takes 102.6 s where theirs (t, p, b and
  m = 512 alike, d = 1) takes 94.4 s, a gap the data-parallel all-reduce (0.3 s) does
  not explain; 512 passes over the rank's 2·10⁹ fp16 gradients are 3.5 s;
- the optimizer step of Megatron's fp16 optimizer (``Float16OptimizerWithFloat16Params``)
  moves 52 bytes per parameter (``SC21_OPTIMIZER_BYTES``).
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.options import (CandidateLayout, DPOverlap, GradAccumulation, LayerBalance, PlannerOptions,
                                    ScheduleKind)
from fxpipe.planner.shapes import TransformerShape, shape_from_registry

SC21_OPTIMIZER_BYTES = 6 + 8 + 4 + 28 + 6
"""Memory traffic per parameter of one step of Megatron 2021's fp16 optimizer: the fp16
gradient copied to an fp32 one (read 2, write 4), unscaled and checked for inf/NaN (read
and write 4), its norm for ``--clip-grad`` (read 4), apex's fused Adam (read gradient,
weight and both moments, write the last three: 28), the fp32 weights copied to the fp16
model (read 4, write 2). Clipping's rescale, when the norm exceeds 1, is not counted."""


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
        """The paper's settings: Megatron's equal layer split, its DDP kind, scatter-gather on,
        and 2021 Megatron's fp16 gradients, separate accumulation and fp16 optimizer (module
        docstring)."""
        from dataclasses import replace
        base = base or PlannerOptions()
        return replace(base, balance=LayerBalance.MEGATRON, scatter_gather=True,
                       dp_overlap=DPOverlap.BACKWARD if self.torch_ddp else DPOverlap.NONE,
                       grad_bytes=2, bytes_per_param=16.0, grad_accumulation=GradAccumulation.SEPARATE,
                       optimizer_bytes_per_param=float(SC21_OPTIMIZER_BYTES))


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
