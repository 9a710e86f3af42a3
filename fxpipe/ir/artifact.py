"""``CompiledPipeline``: the one artifact the compiler hands to the runtime.

``compile_pipeline`` (``fxpipe/compiler/pipeline.py``) returns it; ``fxpipe compile`` prints
it; the runtime (``runtime/build.py``) runs it and recomputes nothing: the stage
plan, the lowered per-rank actions, the shard specs, the partition with the costs it
balanced, the model's numbers and what every pass cost are all here, typed. This
module imports no pass, so the runtime can import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.pass_results import ModelStats, TokenInput, VocabTiming
from fxpipe.ir.program import Program
from fxpipe.ir.shard_spec import ShardSpec, expert_rank_spec, rank_specs
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.ir.state_mismatch import full_shapes
from fxpipe.ir.tp_result import TPCoverage
from fxpipe.partition.result import PartitionResult
from fxpipe.schedules.actions import Schedule


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float
    nodes_after: int


@dataclass(frozen=True)
class CompiledPipeline:
    """What the compile pipeline made for one layout (``until`` may stop it early)."""
    config: "ParallelConfig"
    """The layout it was compiled for."""
    schedule: Schedule
    """The compute-only schedule (F, B, I, W per rank) the partition was solved for; under
    vocabulary passes, with their S/T blocks placed on ``vocab_timing`` (same F/B/I/W order
    per rank: ``vocab_schedule.py``)."""
    program: Program
    """The last Program: tensor-parallel and costed; with ``stages`` once partitioned."""
    plan: PipelinePlan | None
    """One GraphModule per stage and the values between them; None when the pipeline
    stopped before ``split``."""
    actions: Schedule | None
    """``schedule`` lowered: per-rank lists with SEND/RECV placed (what each rank's
    executor walks); None without a plan."""
    timings: tuple[PassTiming, ...]
    capture_s: float = 0.0
    vocab_timing: "VocabTiming | None" = None
    """Under vocabulary passes: the per-microbatch stage, S/T and transfer times the
    passes were placed on (global rank 0's); None: placed with unit times (the partition
    balanced no times, or no vocabulary passes)."""

    @property
    def specs(self) -> Mapping[str, ShardSpec]:
        """Tensor-parallel ShardSpec per sharded parameter (empty without TP)."""
        tp = self.program.tensor_parallel
        return tp.specs if tp is not None else {}

    def rank_specs(self, pp_rank: int, ep_rank: int = 0) -> dict[str, ShardSpec]:
        """What pipeline rank ``pp_rank`` (expert-parallel rank ``ep_rank``) holds of every
        split parameter: the tensor-parallel specs with its pipeline rows folded in
        (``sharding.rank_specs``) and its experts of every expert-parallel stack."""
        ep = self.program.expert_parallel
        experts = {n: expert_rank_spec(s, ep_rank) for n, s in ep.specs.items()} if ep is not None else {}
        rows = self.plan.row_shards if self.plan is not None else {}
        if not rows:
            return {**self.specs, **experts}
        return {**rank_specs(self.specs, rows, pp_rank, full_shapes(self.program, self.specs)), **experts}

    @property
    def coverage(self) -> "TPCoverage | None":
        """What tensor parallelism left whole, and this rank's share (None without TP)."""
        tp = self.program.tensor_parallel
        return tp.coverage if tp is not None else None

    @property
    def stats(self) -> ModelStats | None:
        return self.program.model_stats

    @property
    def token_inputs(self) -> "tuple[TokenInput, ...]":
        return self.program.token_inputs

    @property
    def partition(self) -> "PartitionResult | None":
        """The partitioner's result: per-stage predicted times and memory (None before ``partition``)."""
        return self.program.partition

    @property
    def partition_config(self) -> "PartitionConfig | None":
        """What the partition balanced: modelled or measured node times, link, memory limit."""
        return self.program.partition_config
