"""Which norms over split channels keep them split (their statistic all-reduced).

A mean or sum over channels whose input is used by nothing but its own norm (the
statistic and the multiply that applies it) is a *private* norm: a sub-norm over
an FFN's or attention's inner channels (BitNet's sub-norms), a gated RMSNorm
over a Mamba mixer's channels, a QK-norm over all heads. Its channels may stay
split: each rank sums its own, one all-reduce of the (B, T, 1) statistic makes
it whole (DTensor's ``Partial`` -> ``Replicate``). The residual stream's norms
are not private (the residual add reads the same tensor) and keep uniting their
channels, or the residual would look like a row-parallel input.
"""
from __future__ import annotations

import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G

_MAX_CHAIN = 8


def _unary(node: fx.Node) -> bool:
    """A pointwise op of one tensor (pow, to, abs, add of a scalar, rsqrt...)."""
    return node.op == "call_function" and G.is_pointwise(node.target) and \
        len([a for a in node.all_input_nodes if isinstance(G.val(a), G.torch.Tensor)]) == 1


def _derived(node: fx.Node, stat: fx.Node) -> bool:
    """``node`` is the statistic after single-tensor pointwise ops (eps, rsqrt, to)."""
    for _ in range(_MAX_CHAIN):
        if node is stat:
            return True
        if not _unary(node):
            return False
        node = node.all_input_nodes[0]
    return False


def private_norm(stat: fx.Node) -> bool:
    """The input chain of ``stat`` (pow/to... up to the normalised tensor) is read only
    by the chain itself and by pointwise ops that combine it with the statistic."""
    chain, x = [], stat.args[0]
    while isinstance(x, fx.Node) and len(chain) < _MAX_CHAIN:
        chain.append(x)
        if not _unary(x):
            break
        x = x.all_input_nodes[0]
    names = {n.name for n in chain} | {stat.name}
    for node in chain:
        for user in node.users:
            if user.name in names or (user.target in (G.TYPE_AS, G.aten.view_as.default)
                                      and user.args[0] is not node):
                continue  # type_as(y, x) / view_as(y, x) read only x's dtype / shape
            others = [a for a in user.all_input_nodes if a.name not in names]
            if not (G.is_pointwise(user.target) and others and
                    all(_derived(a, stat) or not isinstance(G.val(a), G.torch.Tensor) for a in others)):
                return False
    return True
