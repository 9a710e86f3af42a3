"""The compile pipeline's one list of passes, in order, each with the reason it is where it
is (``PIPELINE``); the graph passes every layout needs are the ones named in
``GRAPH_PASSES`` (``DEFAULT_PASSES``, what ``run_passes`` runs by default). A step that
only decides whether its pass applies to the layout is a small function here; the
passes themselves are in ``fxpipe/passes``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.compiler.context import CompileContext
from fxpipe.ir.pass_results import ModelStats
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.ir.token_inputs import token_inputs
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
from fxpipe.passes.device import retarget_device_pass
from fxpipe.passes.expert_parallel import expert_parallel_pass
from fxpipe.passes.node_cost import cost_pass, total_cost
from fxpipe.passes.recompute import apply_recompute
from fxpipe.passes.split import split_pass
from fxpipe.passes.split_loss import split_loss_pass
from fxpipe.passes.split_matmul import split_matmul_pass
from fxpipe.passes.tensor_parallel import tensor_parallel_pass
from fxpipe.passes.vocab_head import head_nodes, vocab_head_pass, vocab_row_params
from fxpipe.passes.vocab_rows import vocab_rows_pass

PassFn = Callable[[Any, object], Any]
"""Program -> Program, except the pipeline's last steps (split: Program -> PipelinePlan)."""


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    why: str


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

    out = expert_parallel_pass(program, ctx.expert_parallel)
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
    config = ctx.partition
    if ctx.hooks.node_times is not None:
        return program.replace(partition_config=dataclasses.replace(
            config, node_times=ctx.hooks.node_times(program, config, ctx)))
    # Not under expert parallelism: each rank times its own share of the graph, and a
    # dispatch timed on one rank would wait for peers timing something else.
    if ctx.config.costs != "model" and ctx.config.balances_time and ctx.hooks.measure is not None \
            and ctx.config.ep == 1:
        config = ctx.hooks.measure(program, config, ctx)
    return program.replace(partition_config=config)


def partition_step(program: Program, ctx: CompileContext) -> Program:
    config = program.partition_config or ctx.partition
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
    out = vocab_rows_pass(plan, ctx.schedule.stage_ranks, plan.program.tp_specs,
                          tp=ctx.config.tp)
    head = out.vocab_head
    for name in head.params if head is not None else ():  # every rank holds exactly its block: no other read
        held = out.row_shards[name].ranks if name in out.row_shards else None
        if held != tuple(((a, b),) for a, b in head.blocks):
            raise ValueError(f"vocab_passes=True: the head's parameter {name!r} is also read whole by a "
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


PIPELINE: tuple[PassSpec, ...] = (
    PassSpec("canonicalize", canonicalize_pass,
             "drop export's runtime asserts and dead values so later passes see computation only"),
    PassSpec("model_stats", model_stats_pass,
             "count the whole model's FLOPs and parameters and find token inputs before TP shards them"),
    PassSpec("tensor_parallel", tensor_parallel_pass,
             "find Megatron column/row blocks and shard them (config.tp > 1); before cost, so "
             "costs are per rank"),
    PassSpec("expert_parallel", expert_parallel_step,
             "config.ep > 1: each grouped MoE's experts owned by ep data-parallel ranks, tokens dispatched "
             "and combined by all-to-all; before cost, so the experts are costed at their local count"),
    PassSpec("cost", cost_pass,
             "FLOPs and bytes per node from shapes; after every rewrite of the whole graph, so it "
             "prices the graph as rewritten"),
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


GRAPH_PASSES = ("canonicalize", "tensor_parallel", "cost")
"""The graph passes every layout needs, by name: what ``run_passes`` runs by default."""
DEFAULT_PASSES: tuple[PassSpec, ...] = tuple(p for p in PIPELINE if p.name in GRAPH_PASSES)


def pass_names(passes: Sequence[PassSpec] = DEFAULT_PASSES) -> list[str]:
    return [p.name for p in passes]


def pipeline_names() -> list[str]:
    return pass_names(PIPELINE)
