"""The compile pipeline: model + one microbatch + ``ParallelConfig`` -> ``CompiledPipeline``.

One ordered list of passes, run by the pass driver (``passes/driver.py``) — timed,
skippable by name, linted after every pass in debug mode — and used by all three
front ends: ``fxpipe.parallelize`` (every rank), ``fxpipe compile`` (prints what it
made) and ``fxpipe run``'s preflight (stops after the cheap passes). What differs
between them is not the pipeline but two hooks: how costs are measured (the ranks
of a mesh together, this process alone, or not at all) and how the partition is
solved (rank 0 solves and broadcasts, so that ranks agree exactly) — plus a check of
the caller's input once the model's facts are known (``parallelize``: the batch's
token ids against the vocabulary, before anything is measured).

    capture                 torch.export -> Program (fxpipe/compiler/capture.py)
    canonicalize            drop asserts and dead values
    model_stats             whole-model FLOPs, parameter count, token inputs (before TP shards them)
    tensor_parallel         Megatron column/row blocks, vocabulary-parallel embedding and loss
    expert_parallel         grouped MoEs' experts owned by ep data-parallel ranks, all-to-all around them
    cost                    FLOPs and bytes per node, per tp rank
    device                  retarget device constants to the device stages run on
    split_matmul            cut ops heavier than half a stage's share into blocks
    split_loss              the cross-entropy over such blocks, block by block (opt-in)
    measure_costs           time the graph's groups on the devices (hook; costs='measure' or a profile)
    partition               stage of every node (ILP by default; hook: who solves)
    coalesce_blocks         a split's neighbouring blocks on one stage back into one
    split                   Program -> PipelinePlan: one GraphModule per stage, values between them
    vocab_head              the LM head + loss cut off the last stage for the vocabulary passes (opt-in)
    vocab_rows              each pipeline rank holds only the rows of the LM head (tied embedding) it reads
    recompute               activation recomputation regions per stage
    (place)                 vocab_passes: the S/T passes re-placed on the stages' costs (``vocab_schedule.py``)
    (lower)                 the schedule with SEND/RECV placed, per rank (``schedules/lowering.py``)

Every pass takes the one ``CompileContext``; what a pass finds that is not per node
is a typed field of the Program it returns (``Program.tensor_parallel``,
``.partition``, ...), and ``CompiledPipeline`` (``fxpipe/ir/artifact.py``) exposes them.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.compiler.capture import capture
from fxpipe.compiler.vocab_placement import placed_schedule, vocab_timing
from fxpipe.ir.artifact import CompiledPipeline, PassTiming
from fxpipe.ir.pass_results import ModelStats
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.ir.token_inputs import token_inputs
from fxpipe.passes.assign_stages import PartitionConfig, partition_pass
from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
from fxpipe.passes.device import retarget_device_pass
from fxpipe.passes.driver import DEFAULT_PASSES, PassSpec, run_passes
from fxpipe.passes.expert_parallel import expert_parallel_pass
from fxpipe.passes.node_cost import cost_pass, total_cost
from fxpipe.passes.recompute import apply_recompute
from fxpipe.passes.split import split_pass
from fxpipe.passes.split_loss import split_loss_pass
from fxpipe.passes.split_matmul import split_matmul_pass
from fxpipe.passes.vocab_head import head_nodes, vocab_head_pass, vocab_row_params
from fxpipe.passes.vocab_rows import vocab_rows_pass
from fxpipe.runtime.mixed_precision import Precision
from fxpipe.schedules.actions import Schedule
from fxpipe.schedules.lowering import lower

MeasureFn = Callable[[Program, PartitionConfig, "CompileContext"], PartitionConfig]
SolveFn = Callable[[Program, PartitionConfig], Program]


@dataclass(frozen=True)
class CompileHooks:
    """What the front ends do differently (module docstring)."""
    measure: MeasureFn | None = None
    """Returns the partition config with measured node times and link (``fxpipe/costs``);
    None: the cost model's estimate is all there is."""
    solve: SolveFn = partition_pass
    """Assigns stages (``passes/assign_stages.py``); the runtime's solves on rank 0 and broadcasts."""
    check: Callable[[Program], None] | None = None
    """Called once the whole model's facts are known (after ``model_stats``: token inputs
    and their vocabulary) and before anything expensive; raises on bad input."""
    agree: Callable[[Any], Any] | None = None
    """Global rank 0's value of its argument, on every rank (the runtime broadcasts it):
    what the vocabulary passes are placed on, so that every rank walks one collective
    order; None: one process, its own value."""


@dataclass(frozen=True)
class CompileContext:
    """The ``config`` every pipeline pass receives."""
    config: ParallelConfig
    schedule: Schedule
    device: torch.device
    hooks: CompileHooks = CompileHooks()

    @property
    def tensor_parallel(self):
        return self.config.tensor_parallel  # what the tensor-parallel pass reads


# ---- the pipeline's own passes -------------------------------------------------------------
def model_stats_pass(program: Program, ctx: CompileContext) -> Program:
    whole = total_cost(cost_pass(program))
    m, dp = ctx.config.num_microbatches, ctx.config.replicas
    stats = ModelStats(num_parameters=program.num_parameters(),
                       flops_per_step=(whole.fwd_flops + whole.bwd_flops) * m * dp)
    program = program.replace(model_stats=stats, token_inputs=token_inputs(program))
    if ctx.hooks.check is not None:
        ctx.hooks.check(program)
    return program


def expert_parallel_step(program: Program, ctx: CompileContext) -> Program:
    if ctx.config.ep == 1:
        return program

    out = expert_parallel_pass(program, ctx.config.expert_parallel)
    if not out.expert_parallel.layers:
        why = "; ".join(out.expert_parallel.skipped) or "no grouped matmul over stacked (E, ., .) weights"
        raise ValueError(f"ep={ctx.config.ep} but no MoE in the model can be expert-parallel ({why}); "
                         f"use ep=1 (expert parallelism needs experts as stacked weights run by grouped_mm)")
    return out


def device_pass(program: Program, ctx: CompileContext) -> Program:
    return retarget_device_pass(program, ctx.device)


def split_matmul_step(program: Program, ctx: CompileContext) -> Program:
    if ctx.config.vocab_passes:  # the head runs as vocabulary passes on every rank, whole per block
        return program
    if not ctx.config.balances_time:  # uniform and params ignore time: nothing to balance
        return program
    return split_matmul_pass(program, ctx.schedule.num_stages)


def split_loss_step(program: Program, ctx: CompileContext) -> Program:
    if not (ctx.config.split_loss and program.matmul_splits):
        return program
    return split_loss_pass(program)


def coalesce_blocks_step(program: Program, ctx: CompileContext) -> Program:
    return coalesce_blocks_pass(program) if program.matmul_splits else program


def measure_costs_pass(program: Program, ctx: CompileContext) -> Program:
    config = ctx.config.partition_config(ctx.schedule)
    # Not under expert parallelism: each rank times its own share of the graph, and a
    # dispatch timed on one rank would wait for peers timing something else.
    if ctx.config.costs != "model" and ctx.config.balances_time and ctx.hooks.measure is not None \
            and ctx.config.ep == 1:
        config = ctx.hooks.measure(program, config, ctx)
    return program.replace(partition_config=config)


def partition_step(program: Program, ctx: CompileContext) -> Program:
    config = program.partition_config or ctx.config.partition_config(ctx.schedule)
    if ctx.config.vocab_passes:  # the head runs on every rank's block: balance the stages without it
        away = head_nodes(program)
        config = dataclasses.replace(config, elsewhere=away, spread=vocab_row_params(program, away))
    return ctx.hooks.solve(program, config)


def split_step(program: Program, ctx: CompileContext) -> PipelinePlan:
    return split_pass(program, num_stages=ctx.schedule.num_stages)


def vocab_head_step(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    if not ctx.config.vocab_passes:
        return plan
    return vocab_head_pass(plan, ctx.schedule.stage_ranks)


def vocab_rows_step(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    tp = plan.program.tensor_parallel
    out = vocab_rows_pass(plan, ctx.schedule.stage_ranks, tp.specs if tp is not None else {},
                          tp=ctx.config.tp)
    head = out.vocab_head
    if head is not None:  # every rank must hold exactly its block: nothing else may read the head's rows
        held = out.row_shards[head.weight].ranks if head.weight in out.row_shards else None
        if held != tuple(((a, b),) for a, b in head.blocks):
            raise ValueError(f"vocab_passes=True: the head's weight {head.weight!r} is also read whole by a "
                             f"stage (rows held per rank: {held}); use vocab_passes=False for this model")
    return out


def recompute_step(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    mode = ctx.config.recompute
    if mode is RecomputeMode.NONE:
        return plan
    # Per stage, after the split: a layer cut across two stages is recomputed piecewise.
    stages = tuple(dataclasses.replace(s, graph_module=apply_recompute(s.graph_module, plan.program.layers, mode))
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


_GRAPH = {p.name: p for p in DEFAULT_PASSES}
PIPELINE: tuple[PassSpec, ...] = (
    _GRAPH["canonicalize"],
    PassSpec("model_stats", model_stats_pass,
             "count the whole model's FLOPs and parameters and find token inputs before TP shards them"),
    _GRAPH["tensor_parallel"],
    PassSpec("expert_parallel", expert_parallel_step,
             "config.ep > 1: each grouped MoE's experts owned by ep data-parallel ranks, tokens dispatched "
             "and combined by all-to-all; before cost, so the experts are costed at their local count"),
    _GRAPH["cost"],
    PassSpec("device", device_pass,
             "rewrite device constants captured on cpu/meta to the stages' device"),
    PassSpec("split_matmul", split_matmul_step,
             "cut ops heavier than half a stage's share (an LM head) so the partition can balance; "
             "after cost, which decides what is heavy, and re-costs the blocks"),
    PassSpec("split_loss", split_loss_step,
             "config.split_loss: the cross-entropy over split logits computed block by block (running "
             "logsumexp and target pick), so the loss spreads with its blocks and only [tokens] vectors "
             "cross stages"),
    PassSpec("measure_costs", measure_costs_pass,
             "time the graph's groups on the real devices (costs='measure' or a profile), after every "
             "rewrite the stages will run"),
    PassSpec("partition", partition_step, "assign every node to a stage (ILP over measured or modelled times)"),
    PassSpec("coalesce_blocks", coalesce_blocks_step,
             "neighbouring blocks of one split that landed on one stage merged back into one "
             "(one weight-slice backward per stage); after partition, which decides where they are"),
    PassSpec("split", split_step, "cut the Program into one GraphModule per stage and the values between them"),
    PassSpec("vocab_head", vocab_head_step,
             "config.vocab_passes: the LM head and its cross-entropy cut off the last stage, to run on "
             "every rank's block of the vocabulary (S/T passes); after split, before vocab_rows gives "
             "each rank its block"),
    PassSpec("vocab_rows", vocab_rows_step,
             "a parameter a rank's stages read only as row slices (split LM-head blocks) held as those "
             "rows only (Yeung et al. 2025); after split, which decides the stages, and before recompute "
             "outlines regions"),
    PassSpec("recompute", recompute_step,
             "activation recomputation per stage, after the split (a layer cut by a stage "
             "boundary is recomputed piecewise)"),
)


def pipeline_names() -> list[str]:
    return [p.name for p in PIPELINE]


def capture_for(model: nn.Module, microbatch: Sequence[torch.Tensor], config: ParallelConfig,
                loss_fn: Callable[..., torch.Tensor] | None = None) -> Program:
    """Capture ``model`` as it will run: a low-precision copy under bf16/fp16 (so every
    dtype in the plan is the one that runs; the user's fp32 model keeps the master
    weights), and with meta inputs for a meta-device model (deferred initialisation)."""
    traced = model if config.precision is Precision.FP32 else copy.deepcopy(model).to(config.precision.dtype)
    on_meta = any(t.is_meta for t in model.parameters())
    return capture(traced, tuple(t.to("meta") if on_meta else t for t in microbatch), loss_fn)


def compile_program(program: Program, config: ParallelConfig, *, device: torch.device | str = "cpu",
                    hooks: CompileHooks = CompileHooks(), skip: Iterable[str] = (), until: str | None = None,
                    debug: bool = False) -> CompiledPipeline:
    """Run the pipeline on a captured Program (``until``: stop after that pass)."""
    passes = PIPELINE
    if until is not None:
        if until not in pipeline_names():
            raise ValueError(f"unknown pass {until!r}; passes are: {', '.join(pipeline_names())}")
        passes = PIPELINE[:pipeline_names().index(until) + 1]
    schedule = config.schedule_ir()
    ctx = CompileContext(config=config, schedule=schedule, device=torch.device(device), hooks=hooks)
    out, timings = run_passes(program, ctx, passes=passes, skip=skip, debug=debug)
    last_program = out if isinstance(out, Program) else out.program
    plan = out if isinstance(out, PipelinePlan) else None
    timing = None
    if plan is not None and config.vocab_passes:
        # The partition and split are known: place the passes on the stages' own times,
        # rank 0's on every rank (one collective order; vocab_schedule.py).
        start = time.perf_counter()
        timing = vocab_timing(plan, config)
        if hooks.agree is not None:
            timing = hooks.agree(timing)
        schedule = placed_schedule(config, timing)
        timings.append(PassTiming("vocab_placement", time.perf_counter() - start,
                                  sum(len(s.graph_module.graph.nodes) for s in plan.stages)))
    return CompiledPipeline(config=config, schedule=schedule, program=last_program, plan=plan,
                            actions=lower(schedule) if plan is not None else None, timings=tuple(timings),
                            vocab_timing=timing)


def compile_pipeline(model: nn.Module, microbatch: Sequence[torch.Tensor], config: ParallelConfig, *,
                     loss_fn: Callable[..., torch.Tensor] | None = None, **kwargs: Any) -> CompiledPipeline:
    """Capture ``model`` on one microbatch and compile it for ``config`` (module docstring).
    Keyword arguments as ``compile_program``."""
    start = time.perf_counter()
    program = capture_for(model, microbatch, config, loss_fn)
    captured = time.perf_counter() - start
    return dataclasses.replace(compile_program(program, config, **kwargs), capture_s=captured)

