"""Canonicalize: leave only computation in the graph.

torch.export keeps runtime shape/dtype assertions (``_assert_tensor_metadata``,
``_assert_scalar``) and the dead values they read; later passes would have to
step around them. Nothing here changes what the graph computes.
"""
from __future__ import annotations

import copy

import torch

from fxpipe.ir.program import Program

aten = torch.ops.aten

_ASSERTS = frozenset({
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
})


def canonicalize_pass(program: Program, config: object = None) -> Program:
    gm = copy.deepcopy(program.graph_module)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    # Random ops (dropout) whose result is unused are dead too: fx only keeps
    # nodes it considers impure (in-place / side-effecting ones).
    graph.eliminate_dead_code()
    gm.recompile()
    live = {n.name for n in graph.nodes}
    return program.replace(
        graph_module=gm,
        module_paths={k: v for k, v in program.module_paths.items() if k in live},
        layers={k: v for k, v in program.layers.items() if k in live})
