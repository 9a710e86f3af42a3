"""The partition pass: every node of the Program assigned to a pipeline stage.

The stage assignment itself (the fine DAG, coarsening, the solver) is
``passes/assign_stages.py``; this pass chooses what it balances and who solves.
Global rank 0 solves and every rank takes its answer (``CompileHooks.decide``, the
mesh's broadcast): a time-limited solver need not return the same assignment on every
rank, and the ranks must split one plan.
"""
from __future__ import annotations

import dataclasses

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program
from fxpipe.passes.assign_stages import solve_partition
from fxpipe.passes.vocab_head import head_nodes, vocab_row_params


def partition_pass(program: Program, ctx: CompileContext) -> Program:
    """``program.stages`` and ``program.partition`` for the stages of ``ctx.schedule``, on
    the costs measured (``measure_costs``) or modelled (``cost``)."""
    config = program.partition_config or ctx.partition
    if ctx.config.vocab_passes:  # the head runs on every rank's block: balance the stages without it
        away = head_nodes(program)
        config = dataclasses.replace(config, elsewhere=away, spread=vocab_row_params(program, away))
    assignment, result = ctx.hooks.on_rank0(lambda: solve_partition(program, config))
    return program.replace(stages=assignment, partition=result)
