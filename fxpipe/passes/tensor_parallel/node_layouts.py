"""The TP plan: per node, its local layout, rewritten constants and the
conversions its inputs need; per projection, its role.

Conversions follow one rule (Shoeybi et al. 2019 §3, generalised): a replicated
value entering a sharded consumer needs Megatron's f if its gradient flows
(each rank sees only its part of the gradient, f sums them), or a SCATTER when
the consumer holds only a slice of it; a row-parallel partial sum leaving its
block needs g (an all-reduce), placed after any views of it, with the bias
added once, after the reduction.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch.fx as fx

from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel import complex_views, graph_ops as G, layout_rules, mixers, param_shards, writes
from fxpipe.passes.tensor_parallel.assign import ALL, Assignment
from fxpipe.passes.tensor_parallel.attention_forms import constant_values, local_index
from fxpipe.passes.tensor_parallel.channel_ids import Provenance
from fxpipe.passes.tensor_parallel.graph_ops import Projection, arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.layout import LayoutFailure, layout_of, replicated
from fxpipe.passes.tensor_parallel.layout_rules import _attention, _einsum, _operand, _slice, _split
from fxpipe.passes.tensor_parallel.provenance_ops import index_dim
from fxpipe.passes.tensor_parallel.tp_plan import Conversion, PartialSite, TPPlan, _Refuse, is_sharded


def _ids(prov: Provenance, name: str) -> np.ndarray:
    ids = prov.ids.get(name)
    if isinstance(ids, list):
        return np.concatenate([i.ravel() for i in ids]) if ids else np.zeros(0, dtype=np.int64)
    return np.zeros(0, dtype=np.int64) if ids is None else ids


def build_plan(graph: fx.Graph, prov: Provenance, asg: Assignment, projections: dict[str, Projection],
               embeddings: dict[str, str], grad: set[str], tp: int,
               describe: Callable[[str], str], gathered: frozenset[str] = frozenset(),
               params: frozenset[str] = frozenset(), conflict_rows: bool = False) -> TPPlan:
    plan = TPPlan(tp, gathered=gathered, conflict_rows=conflict_rows)
    plan.vocab_embedding = dict(embeddings)
    plan.vocab_ce = dict(asg.vocab)
    for node in graph.nodes:
        v = G.val(node)
        ids = prov.ids.get(node.name)
        if isinstance(ids, list):
            plan.layouts[node.name] = [layout_of(i, tuple(G._dim(s) for s in t.shape), asg, tp,
                                                 describe(node.name)) for i, t in zip(ids, v)]
        elif ids is not None:
            plan.layouts[node.name] = layout_of(ids, shape(node), asg, tp, describe(node.name))
        elif isinstance(v, G.torch.Tensor):
            plan.layouts[node.name] = replicated(shape(node))
    _roles(plan, prov, asg, projections, describe)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        lay = plan.layouts.get(node.name)
        inputs = [a for a in node.all_input_nodes if a.name in plan.layouts]
        if not (is_sharded(lay) or any(is_sharded(plan.layouts[a.name]) for a in inputs)
                or node.name in plan.gathered):
            continue
        try:
            _node_rule(plan, prov, node, lay, grad, describe(node.name))
        except _Refuse as exc:
            raise LayoutFailure(np.concatenate([_ids(prov, node.name).ravel()] +
                                               [_ids(prov, a.name).ravel() for a in inputs]),
                                f"{describe(node.name)}: {exc}") from None
    nodes = {n.name: n for n in graph.nodes}

    def fail(n) -> None:
        raise LayoutFailure(np.concatenate([_ids(prov, n.consumer).ravel()] + [
            _ids(prov, a.name).ravel() for a in nodes[n.consumer].all_input_nodes]),
            f"{describe(n.consumer)}: replicated input {n.operand} cannot be narrowed to the shard")

    param_shards.sink(plan, graph, params, fail)
    for name, proj in plan.row.items():
        sink = _sink(nodes[name])
        plan.partial[sink] = PartialSite(name, sink, proj.bias)
    for name in plan.vocab_embedding:
        sink = _sink(nodes[name])
        plan.partial[sink] = PartialSite(name, sink, None)
    return plan


class Conflict(LayoutFailure):
    """A projection whose input channels and output channels both want to be split."""


def _roles(plan: TPPlan, prov: Provenance, asg: Assignment, projections: dict[str, Projection],
           describe: Callable[[str], str] = str) -> None:
    for name, proj in projections.items():
        first, count = prov.sources[name]
        out_ids = np.arange(first, first + count)
        is_column = bool((asg.owner(out_ids) != ALL).any()) or name in plan.gathered
        if is_column and name in asg.rows:
            # Either side may give way: b's outputs (b row-parallel, as in a plain MLP
            # before a vocabulary head) or its inputs (a low-rank pair x -> a -> b, b's
            # outputs split by heads: the bottleneck a stays whole, as Megatron keeps MLA's
            # latent projections whole). The search plans both (``Conflict.rows``).
            raise Conflict(prov.rows[name] if plan.conflict_rows else out_ids,
                           f"{describe(name)} would be both row- and column-parallel")
        if is_column:
            plan.column[name] = proj
        elif name in asg.rows:
            plan.row[name] = proj


def _sink(node: fx.Node) -> str:
    last = shape(node)[-1]  # the bias is added after the sink: it must still broadcast
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op != "call_function" or user.target not in G.VIEWS or shape(user)[-1] != last:
            break
        node = user
    return node.name


def hoist(plan: TPPlan, consumer: fx.Node, producer: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Move an input conversion up through single-use views, so it acts on the
    tensor the views start from (sequence parallelism needs the unflattened one)."""
    while (producer.op == "call_function" and producer.target in G.VIEWS and len(producer.users) == 1
           and not is_sharded(plan.layouts.get(producer.name))):
        consumer, producer = producer, producer.args[0]
    return consumer, producer


def _node_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: set[str], where: str) -> None:
    t = node.target
    if node.name in plan.column:
        x = node.args[plan.column[node.name].input_arg]
        if is_sharded(plan.layouts[x.name]):
            raise _Refuse("a column-parallel projection reads a sharded input")
        plan.column_inputs.add(tuple(n.name for n in hoist(plan, node, x)))
        return
    if node.name in plan.row:
        x = node.args[plan.row[node.name].input_arg]
        xl = plan.layouts[x.name]
        if xl.sharded != (len(xl.full) - 1,) or is_sharded(lay):
            raise _Refuse("a row-parallel projection must read channels split on its last dim only")
        return
    if G.is_getitem(node):
        return
    if t in (G.aten.view.default, G.aten._unsafe_view.default, G.aten.reshape.default,
             G.aten.expand.default):
        x = node.args[0]
        if t is G.aten.expand.default and is_sharded(lay) and not is_sharded(plan.layouts[x.name]):
            # Copies of a replicated value, each rank expanding to its own heads: f sums
            # the gradients of every rank's copies.
            if x.name in grad:
                plan.conversions[(node.name, x.name)] = [Conversion(CollectiveKind.F)]
        sizes = list(node.args[1])
        plan.new_args[node.name] = (node.args[0], [lay.shape[d] if d in lay.sharded and s != -1 else s
                                                   for d, s in enumerate(sizes)], *node.args[2:])
    elif t in G.SHAPED_AS:
        other = plan.layouts.get(node.args[1].name)
        if not is_sharded(lay) and min(lay.full) >= 0:
            # A replicated result shaped like a shard (a mask expanded to split scores):
            # spelled with its full sizes, so every rank holds all of it.
            plan.new_target[node.name] = {G.aten.view_as.default: G.aten.view.default,
                                          G.aten.reshape_as.default: G.aten.reshape.default,
                                          G.aten.expand_as.default: G.aten.expand.default}[t]
            plan.new_args[node.name] = (node.args[0], list(lay.full))
            return
        if other is None or other.shape != lay.shape:
            raise _Refuse(f"{t} a tensor of another local shape")
        x = plan.layouts[node.args[0].name]
        if t is G.aten.expand_as.default and is_sharded(lay) and not is_sharded(x):
            if node.args[0].name in grad:  # each rank's copies: f sums their gradients
                plan.conversions[(node.name, node.args[0].name)] = [Conversion(CollectiveKind.F)]
    elif t is G.aten.unflatten.int:
        dim = norm_dim(node.args[1], len(lay.full))
        sizes = [lay.shape[dim + i] if dim + i in lay.sharded and s != -1 else s
                 for i, s in enumerate(node.args[2])]
        plan.new_args[node.name] = (node.args[0], node.args[1], sizes)
    elif t in G.SPLITS:
        _split(plan, node, where)
    elif t is G.aten.slice.Tensor:
        _slice(plan, node, where)
    elif t is G.CROSS_ENTROPY:
        if node.name not in plan.vocab_ce:
            raise _Refuse("cross-entropy over sharded logits that are not a vocabulary head")
    elif t is G.SDPA:
        _attention(plan, node, lay, grad)
    elif t in G.REDUCTIONS or t in G.NORMS:
        x = plan.layouts[node.args[0].name]
        if t in G.NORMS:
            dims = set(range(len(x.full) - len(node.args[1]), len(x.full)))
        else:
            d = arg(node, G.REDUCTIONS[t][0], "dim")
            dims = set(range(len(x.full))) if d is None or d == [] else {
                norm_dim(i, len(x.full)) for i in (d if isinstance(d, (list, tuple)) else [d])}
        if dims & set(x.sharded):
            if node.name not in prov.split_statistics:
                raise _Refuse("reduces over a sharded dim")
            local, full = (int(np.prod([s[d] for d in dims])) for s in (x.shape, x.full))
            plan.statistics[node.name] = local / full if t is G.aten.mean.dim else 1.0
        for a in node.all_input_nodes[1:]:
            _operand(plan, node, a, lay, grad)
    elif t is G.aten.cat.default:
        dim = norm_dim(arg(node, 1, "dim", 0), len(lay.full))
        for a in node.args[0]:
            if not is_sharded(plan.layouts[a.name]) and 0 not in shape(a):  # (an empty part: nothing to narrow)
                if dim in lay.sharded:
                    raise _Refuse("concatenates replicated values along a sharded dim")
                _operand(plan, node, a, lay, grad)
    elif t in G.TRANSPOSES or t in G.SQUEEZES or t in (G.aten.unsqueeze.default,
                                                         G.aten.flatten.using_ints, G.STACK):
        return
    elif t in G.BATCHED_MATMULS:
        layout_rules.matmul_rule(plan, node, lay, grad, _Refuse)
    elif t is mixers.CONV1D:
        layout_rules.conv1d_rule(plan, node, lay, grad, _Refuse)
    elif t in mixers.ALONG:
        layout_rules.along_rule(plan, node, lay, grad, _Refuse)
    elif t in G.LIKE:
        layout_rules.like_rule(plan, node, _Refuse)
    elif t is mixers.REPEAT_INTERLEAVE:
        layout_rules.repeat_rule(plan, node, lay, grad, _Refuse)
    elif t is mixers.SELECT_SCATTER:
        layout_rules.select_scatter_rule(plan, node, lay, grad, _Refuse)
    elif t is G.EINSUM:
        _einsum(plan, node, lay, grad)
    elif t in complex_views.VIEWS:
        complex_views.view_rule(plan, node, _Refuse)
    elif t is G.SELECT:
        if norm_dim(node.args[1], len(plan.layouts[node.args[0].name].full)) in \
                plan.layouts[node.args[0].name].sharded:
            raise _Refuse("selects one index of a sharded dim")
    elif t is G.UNBIND:
        if norm_dim(arg(node, 1, "dim", 0), len(plan.layouts[node.args[0].name].full)) in \
                plan.layouts[node.args[0].name].sharded:
            raise _Refuse("unbinds a sharded dim")
    elif t in G.PADS:
        if set(G.padded_dims(node)) & set(plan.layouts[node.args[0].name].sharded):
            raise _Refuse("pads a sharded dim")
    elif t is G.NEW_EMPTY:
        return  # its sizes are arguments: a full, replicated tensor, whatever its input holds
    elif t is G.SLICE_SCATTER:
        if norm_dim(arg(node, 2, "dim", 0), len(lay.full)) in lay.sharded:
            raise _Refuse("writes a slice of a sharded dim")
        for a in node.args[:2]:
            _operand(plan, node, a, lay, grad)
    elif t is G.INDEX:
        x, p = plan.layouts[node.args[0].name], index_dim(node)
        if p in x.sharded:
            # constant rows of a sharded dim (fused QKV picked by index): one local slice
            picked = constant_values(node.args[1][p], prov.constants)
            found = None if picked is None or x.vocab else local_index(
                picked, x.full[p], x.positions[x.sharded.index(p)],
                lay.positions[lay.sharded.index(p)] if p in lay.sharded else None)
            if found is None:
                raise _Refuse("indexes a sharded dim")
            plan.new_target[node.name] = G.aten.slice.Tensor
            plan.new_args[node.name] = (node.args[0], p, *found)
    elif t is G.INDEX_ADD:
        if norm_dim(node.args[1], len(lay.full)) in lay.sharded:
            raise _Refuse("index_add along a sharded dim")
        for a in (node.args[0], node.args[3]):
            _operand(plan, node, a, lay, grad)
    elif t is G.TYPE_AS:
        _operand(plan, node, node.args[0], lay, grad)
    elif t is writes.INDEX_PUT:
        layout_rules.index_put_rule(plan, node, lay, grad)
    elif G.is_pointwise(t):
        if t is G.DROPOUT and is_sharded(lay):
            plan.sharded_dropout.add(node.name)
        for a in node.all_input_nodes:
            _operand(plan, node, a, lay, grad)
    else:
        raise _Refuse(f"no sharding rule for {t}")


