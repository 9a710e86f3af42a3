"""One finder of the parameter behind the casts and identity aliases a graph reads it through.

Training code often reads a weight through a dtype cast: ``F.linear(x, w.to(x.dtype))``,
``w.type_as(x)``, ``w.float()`` (speedrun-style heads, mixed-precision layers), or through an
identity autograd wrapper at size 1 that exports as ``aten.alias``. Both keep the weight's
shape, so a shard or a block of rows of the weight is cast or aliased alike: the TP pass's
projection finder (``tensor_parallel/graph_ops.py``) and the vocabulary passes' head finder
(``vocab_head.py``) look through them with the functions here, so the two never disagree on
what a weight is.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxpipe.ir.op_tables import CASTS

aten = torch.ops.aten


def _dims(node: fx.Node) -> tuple | None:
    """Sizes to compare: a data-dependent size (routed tokens) by its symbol, so comparing
    never guards on it."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(str(s.node.expr) if isinstance(s, torch.SymInt) and s.node.hint is None else int(s)
                 for s in val.shape)


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    da = _dims(a)
    return da is not None and da == _dims(b)


def is_cast(node: Any) -> bool:
    """A dtype cast of a node that keeps its shape (``CASTS``)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS and \
        isinstance(node.args[0], fx.Node) and _same_shape(node, node.args[0])


def uncast(node: Any) -> Any:
    """``node`` with the dtype casts it is read through taken off."""
    while is_cast(node):
        node = node.args[0]
    return node


def param_behind(node: Any) -> tuple[Any, list[fx.Node]]:
    """The value ``node`` reads through casts and ``aten.alias`` wrappers, and those
    views from ``node`` back. Each view must have ``node``'s chain as its only reader, so
    taking the chain out of a graph removes nothing else reads."""
    views = []
    while isinstance(node, fx.Node) and len(node.users) == 1 and (
            node.target is aten.alias.default or is_cast(node)):
        views.append(node)
        node = node.args[0]
    return node, views
