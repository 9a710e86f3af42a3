"""Canonicalize: leave only computation in the graph.

torch.export keeps runtime shape/dtype assertions (``_assert_tensor_metadata``,
``_assert_scalar``) and the dead values they read; later passes would have to
step around them. ``a.type_as(b)`` becomes ``a.to(b's dtype)``: export knows the dtype,
and ``b`` is no input of the value (a weight cast to an activation's dtype would
otherwise read that activation, to every data-flow pass). Nothing here changes what the
graph computes. ``x.view_as(x)`` (an identity autograd function, as exported) is x.
``torch.linalg.norm`` over one dim is the vector norm it computes (``linalg_vector_norm``,
what ``Tensor.norm`` exports as), so one op carries every spelling of a vector norm.
"""
from __future__ import annotations

import copy

import torch

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program

aten = torch.ops.aten

_ASSERTS = frozenset({
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
})


def canonicalize_pass(program: Program, ctx: CompileContext | None = None) -> Program:
    gm = copy.deepcopy(program.graph_module)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.view_as.default and node.args[0] is node.args[1]:
            # x.view_as(x): what an identity autograd function (a model-parallel helper at
            # size 1) exports as; the value is x, and every pass should see x.
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.type_as.default:
            other = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
            own = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if other is not None and own is not None and own.dtype == other.dtype:  # type_as returns self
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
            elif other is not None:
                node.target, node.args, node.kwargs = aten._to_copy.default, (node.args[0],), {"dtype": other.dtype}
        elif node.op == "call_function" and node.target is aten.linalg_norm.default:
            _vector_norm(node)
    # Random ops (dropout) whose result is unused are dead too: fx only keeps
    # nodes it considers impure (in-place / side-effecting ones).
    graph.eliminate_dead_code()
    gm.recompile()
    live = {n.name for n in graph.nodes}
    return program.replace(
        graph_module=gm,
        module_paths={k: v for k, v in program.module_paths.items() if k in live},
        layers={k: v for k, v in program.layers.items() if k in live})


def _vector_norm(node: torch.fx.Node) -> None:
    """``linalg_norm(x, ord, [d], keepdim, dtype)`` -> ``linalg_vector_norm`` (ord None:
    2) when it is a vector norm: one dim, a numeric ord (torch.linalg.norm's own rule)."""
    names = ("ord", "dim", "keepdim")
    ord_, dim, keepdim = (node.args[i + 1] if len(node.args) > i + 1 else node.kwargs.get(n, d)
                          for i, (n, d) in enumerate(zip(names, (None, None, False))))
    if isinstance(dim, (list, tuple)) and len(dim) == 1 and not isinstance(ord_, str):
        dtype = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
        node.target = aten.linalg_vector_norm.default
        node.args, node.kwargs = (node.args[0], 2 if ord_ is None else ord_, list(dim), keepdim), dtype
