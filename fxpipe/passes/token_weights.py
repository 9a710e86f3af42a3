"""A per-token loss reduced by weights that do not depend on the logits: each token's weight.

Training code often asks the cross-entropy for one loss per token and reduces them
itself, with a mask along the sequence (Megatron's ``loss_mask``):

    losses = cross_entropy(logits, target, reduction="none")      # (N,)
    loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()

Such a loss is linear in the per-token losses, loss = Σ_t c_t·ce_t, with coefficients
c_t read off the ops after the cross-entropy: views, casts, products and quotients
with values that do not depend on the logits, a sum over every token, a mean. The
vocabulary passes need no more than c (``VocabHead.token_weight``): the loss is the
weighted sum of the distributed softmax's per-token losses and each token's gradient
is scaled by c_t, so ``find_tail`` matches the ops and ``build_weights`` computes c in
the graph, from the same operands, where the loss was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpipe.passes.split_matmul import call

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.alias.default, aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype)
_SCALE = (aten.mul.Tensor, aten.div.Tensor)
_SUM = (aten.sum.default, aten.sum.dim_IntList)


@dataclass(frozen=True)
class Tail:
    """The ops from the per-token losses to the loss, in graph order (the loss last)."""
    nodes: tuple[fx.Node, ...]


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that reads ``node``'s value, directly or not (``node`` included)."""
    seen, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def find_tail(per: fx.Node, dependent: set[fx.Node]) -> tuple[Tail | None, fx.Node]:
    """The ops from ``per`` (the (N,) per-token losses) to a scalar loss that is linear in
    them with coefficients free of ``dependent`` (the nodes that read the logits), or
    None; and the last node the walk reached (whose reader stopped it, for an error)."""
    cur, nodes, summed = per, [], False
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if user.op != "call_function" or (user.args[0] is not cur and user.target is not aten.mul.Tensor):
            break  # only a product may take the loss second (a quotient by a loss is no weight)
        vin, vout = cur.meta["val"], user.meta["val"]
        if user.target in _VIEWS:
            if vout.numel() != vin.numel() or not vout.dtype.is_floating_point:
                break
        elif user.target in _SCALE:
            other = user.args[1] if user.args[0] is cur else user.args[0]
            if other is cur or isinstance(other, fx.Node) and (other in dependent or other.meta["val"].dim() and
                                                               (summed or vout.shape != vin.shape)):
                break  # a product of two losses, or one that spreads a loss over more values
        elif user.target in _SUM and not summed and vout.dim() == 0 and not user.kwargs.get("dtype"):
            summed = True
        elif user.target is aten.mean.default and not summed:
            summed = True
        else:
            break
        nodes.append(user)
        cur = user
    return (Tail(tuple(nodes)) if summed and cur.meta["val"].dim() == 0 else None), cur


def build_weights(graph: fx.Graph, tail: Tail, per: fx.Node, like: fx.Node) -> fx.Node:
    """Insert, at the insertion point, the coefficient of every token's loss in the
    tail's loss: the tail's products and quotients applied to ones, in the per-token
    losses' shape (``like``: a node of that shape that reads no logit, the targets)."""
    val = per.meta["val"]
    weight = call(graph, aten.ones_like.default, like, dtype=val.dtype)  # (N,)
    cur = per
    for node in tail.nodes:
        if node.target in _VIEWS:
            weight = call(graph, node.target, weight, *node.args[1:], **node.kwargs)
        elif node.target in _SCALE:
            other = node.args[1] if node.args[0] is cur else node.args[0]
            weight = call(graph, node.target, weight, other)
        elif node.target is aten.mean.default:
            weight = call(graph, aten.div.Tensor, weight, cur.meta["val"].numel())
        cur = node
    return call(graph, aten.reshape.default, weight, list(val.shape))
