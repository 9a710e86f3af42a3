"""The measure_costs pass: the partition's config with measured node times, where the
layout asks for them (``costs="measure"`` or a profile) and the partition balances time.

The measurement itself runs on the front end's devices (``CompileHooks.measure``: the
ranks of a mesh time a share of the graph each, ``fxpipe/costs``), or the times are
already known (``CompileHooks.node_times``: the layout search's timing at this layout's
shapes); with neither, the partition balances the cost model's estimate.
"""
from __future__ import annotations

import dataclasses

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program


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
