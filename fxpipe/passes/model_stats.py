"""The model_stats pass: the whole model's facts, counted before tensor parallelism
shards them — its parameters, its FLOPs per step (Megatron's model-FLOPs convention,
``passes/cost.py``) and its token inputs (``ir/token_inputs.py``) — then the front
end's check of its input against them (``CompileHooks.check``: parallelize refuses token
ids past the vocabulary before anything expensive runs)."""
from __future__ import annotations

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_results import ModelStats
from fxpipe.ir.program import Program
from fxpipe.ir.token_inputs import token_inputs
from fxpipe.passes.cost import cost_pass, total_cost


def model_stats_pass(program: Program, ctx: CompileContext) -> Program:
    whole = total_cost(cost_pass(program))
    m, dp = ctx.config.num_microbatches, ctx.config.replicas
    stats = ModelStats(num_parameters=program.num_parameters(),
                       flops_per_step=(whole.fwd_flops + whole.bwd_flops) * m * dp)
    program = program.replace(model_stats=stats, token_inputs=token_inputs(program))
    if ctx.hooks.check is not None:
        ctx.hooks.check(program)
    return program
