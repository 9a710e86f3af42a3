"""``CompiledPipeline``: the one artifact the compiler hands to the runtime.

``compile_pipeline`` (``fxpipe/compiler/pipeline.py``) returns it; ``fxpipe compile`` prints
it; the runtime (``runtime/build.py``) runs it and recomputes nothing: the stage
plan, the lowered per-rank actions, the shard specs, the partition with the costs it
balanced, the model's numbers and what every pass cost are all here, typed. This
module imports no pass, so the runtime can import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_results import VocabTiming
from fxpipe.ir.program import Program
from fxpipe.ir.shard_spec import ShardSpec, expert_rank_spec, rank_specs
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.ir.state_mismatch import full_shapes
from fxpipe.schedules.schedule import Schedule


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
    per rank: ``compiler/vocab_placement.py``)."""
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
    layout_search: str | None = None
    """When the compiler chose the layout (``planner/auto_layout.py``): the leading layouts it
    priced and why the winner won; None when the layout was given."""

    def rank_specs(self, pp_rank: int, ep_rank: int = 0) -> dict[str, ShardSpec]:
        """What pipeline rank ``pp_rank`` (expert-parallel rank ``ep_rank``) holds of every
        split parameter: the tensor-parallel specs with its pipeline rows folded in
        (``ir/shard_spec.rank_specs``) and its experts of every expert-parallel stack."""
        ep, specs = self.program.expert_parallel, self.program.tp_specs
        experts = {n: expert_rank_spec(s, ep_rank) for n, s in ep.specs.items()} if ep is not None else {}
        rows = self.plan.row_shards if self.plan is not None else {}
        if not rows:
            return {**specs, **experts}
        return {**rank_specs(specs, rows, pp_rank, full_shapes(self.program, specs)), **experts}
