"""Step 4 of the pass: the TP plan. Per node its local layout, rewritten constants and
the conversions its inputs need; per projection, its role.

Conversions follow one rule (Shoeybi et al. 2019 §3, generalised): a replicated
value entering a sharded consumer needs Megatron's f if its gradient flows
(each rank sees only its part of the gradient, f sums them), or a SCATTER when
the consumer holds only a slice of it; a row-parallel partial sum leaving its
block needs g (an all-reduce), placed after any views of it, with the bias
added once, after the reduction.

What each op needs is one rule per ATen op (or group of ops) in ``RULES``, the way
DTensor registers one sharding strategy per op: the shape and reduction rules are
here, the rules of ops that mix or write channels in ``plan_ops.py``. An op with no
rule refuses, and its channels are replicated.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch.fx as fx

from fxpipe.ir.program import ParamKind
from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel import complex_views, graph_ops as G, mixers, param_shards, plan_ops, writes
from fxpipe.passes.tensor_parallel.assign import ALL, Assignment
from fxpipe.passes.tensor_parallel.attention_forms import constant_values, local_index
from fxpipe.passes.tensor_parallel.channel_ids import Provenance
from fxpipe.passes.tensor_parallel.graph_ops import Projection, arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.layout import LayoutFailure, is_sharded, layout_of, replicated
from fxpipe.passes.tensor_parallel.plan_ops import operand
from fxpipe.passes.tensor_parallel.plan_record import Conversion, GraphFacts, PartialSite, Refuse, TPPlan
from fxpipe.passes.tensor_parallel.provenance_ops import index_dim

Rule = Callable[[TPPlan, Provenance, fx.Node, Any, frozenset, str], None]
"""``rule(plan, prov, node, lay, grad, where)``: checks a node whose layout or inputs are
sharded, records what its inputs need and its rewritten arguments; raises ``Refuse``."""


def _ids(prov: Provenance, name: str) -> np.ndarray:
    ids = prov.ids.get(name)
    if isinstance(ids, list):
        return np.concatenate([i.ravel() for i in ids]) if ids else np.zeros(0, dtype=np.int64)
    return np.zeros(0, dtype=np.int64) if ids is None else ids


def build_plan(facts: GraphFacts, prov: Provenance, asg: Assignment, gathered: frozenset[str] = frozenset(),
               conflict_rows: bool = False) -> TPPlan:
    """The plan for one assignment of channels to ranks; a ``LayoutFailure`` names the
    channels to replicate before the next try (``reading_search``)."""
    graph, tp, describe = facts.graph, facts.tp, facts.describe
    params = frozenset(p.node for p in facts.program.params if p.kind is not ParamKind.CONSTANT)
    plan = TPPlan(tp, gathered=gathered, conflict_rows=conflict_rows)
    plan.vocab_embedding = dict(facts.embeddings)
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
    _roles(plan, prov, asg, facts.projections, describe)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        lay = plan.layouts.get(node.name)
        inputs = [a for a in node.all_input_nodes if a.name in plan.layouts]
        if not (is_sharded(lay) or any(is_sharded(plan.layouts[a.name]) for a in inputs)
                or node.name in plan.gathered):
            continue
        try:
            _node_rule(plan, prov, node, lay, facts.grad, describe(node.name))
        except Refuse as exc:
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


def _node_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    """A projection's role first (its node name decides it, not its op), then the op's rule."""
    if node.name in plan.column:
        x = node.args[plan.column[node.name].input_arg]
        if is_sharded(plan.layouts[x.name]):
            raise Refuse("a column-parallel projection reads a sharded input")
        plan.column_inputs.add(tuple(n.name for n in hoist(plan, node, x)))
        return
    if node.name in plan.row:
        x = node.args[plan.row[node.name].input_arg]
        xl = plan.layouts[x.name]
        if xl.sharded != (len(xl.full) - 1,) or is_sharded(lay):
            raise Refuse("a row-parallel projection must read channels split on its last dim only")
        return
    rule = RULES.get(node.target)
    if rule is None:
        if not G.is_pointwise(node.target):
            raise Refuse(f"no sharding rule for {node.target}")
        rule = _pointwise
    rule(plan, prov, node, lay, grad, where)


def _same_op(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    """The same op on the shard, nothing to rewrite (a transpose, a squeeze, getitem;
    ``new_empty``: its sizes are arguments, a full replicated tensor whatever its input holds)."""


def _view(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    x = node.args[0]
    if node.target is G.aten.expand.default and is_sharded(lay) and not is_sharded(plan.layouts[x.name]):
        # Copies of a replicated value, each rank expanding to its own heads: f sums
        # the gradients of every rank's copies.
        if x.name in grad:
            plan.conversions[(node.name, x.name)] = [Conversion(CollectiveKind.F)]
    sizes = list(node.args[1])
    plan.new_args[node.name] = (node.args[0], [lay.shape[d] if d in lay.sharded and s != -1 else s
                                               for d, s in enumerate(sizes)], *node.args[2:])


_FULL_SHAPED_AS = {G.aten.view_as.default: G.aten.view.default, G.aten.reshape_as.default: G.aten.reshape.default,
                   G.aten.expand_as.default: G.aten.expand.default}


def _shaped_as(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    t = node.target
    other = plan.layouts.get(node.args[1].name)
    if not is_sharded(lay) and min(lay.full) >= 0:
        # A replicated result shaped like a shard (a mask expanded to split scores):
        # spelled with its full sizes, so every rank holds all of it.
        plan.new_target[node.name] = _FULL_SHAPED_AS[t]
        plan.new_args[node.name] = (node.args[0], list(lay.full))
        return
    if other is None or other.shape != lay.shape:
        raise Refuse(f"{t} a tensor of another local shape")
    x = plan.layouts[node.args[0].name]
    if t is G.aten.expand_as.default and is_sharded(lay) and not is_sharded(x):
        if node.args[0].name in grad:  # each rank's copies: f sums their gradients
            plan.conversions[(node.name, node.args[0].name)] = [Conversion(CollectiveKind.F)]


def _unflatten(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    dim = norm_dim(node.args[1], len(lay.full))
    sizes = [lay.shape[dim + i] if dim + i in lay.sharded and s != -1 else s
             for i, s in enumerate(node.args[2])]
    plan.new_args[node.name] = (node.args[0], node.args[1], sizes)


def _cross_entropy(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str],
                   where: str) -> None:
    if node.name not in plan.vocab_ce:
        raise Refuse("cross-entropy over sharded logits that are not a vocabulary head")


def _reduction(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    """Over a sharded dim only a split statistic (``provenance.split_statistics``): each rank's
    share of the whole, made whole by g after it."""
    t = node.target
    x = plan.layouts[node.args[0].name]
    if t in G.NORMS:
        dims = set(range(len(x.full) - len(node.args[1]), len(x.full)))
    else:
        d = arg(node, G.REDUCTIONS[t][0], "dim")
        dims = set(range(len(x.full))) if d is None or d == [] else {
            norm_dim(i, len(x.full)) for i in (d if isinstance(d, (list, tuple)) else [d])}
    if dims & set(x.sharded):
        if node.name not in prov.split_statistics:
            raise Refuse("reduces over a sharded dim")
        local, full = (int(np.prod([s[d] for d in dims])) for s in (x.shape, x.full))
        plan.statistics[node.name] = local / full if t is G.aten.mean.dim else 1.0
    for a in node.all_input_nodes[1:]:
        operand(plan, node, a, lay, grad)


def _cat(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    dim = norm_dim(arg(node, 1, "dim", 0), len(lay.full))
    for a in node.args[0]:
        if not is_sharded(plan.layouts[a.name]) and 0 not in shape(a):  # (an empty part: nothing to narrow)
            if dim in lay.sharded:
                raise Refuse("concatenates replicated values along a sharded dim")
            operand(plan, node, a, lay, grad)


def _input_dim_whole(dim_arg: Callable[[fx.Node], int], why: str) -> Rule:
    """A rule for an op that must not address its input's ``dim_arg(node)`` when sharded."""
    def rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
        x = plan.layouts[node.args[0].name]
        if norm_dim(dim_arg(node), len(x.full)) in x.sharded:
            raise Refuse(why)
    return rule


def _pad(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    if set(G.padded_dims(node)) & set(plan.layouts[node.args[0].name].sharded):
        raise Refuse("pads a sharded dim")


def _slice_scatter(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str],
                   where: str) -> None:
    if norm_dim(arg(node, 2, "dim", 0), len(lay.full)) in lay.sharded:
        raise Refuse("writes a slice of a sharded dim")
    for a in node.args[:2]:
        operand(plan, node, a, lay, grad)


def _index(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    x, p = plan.layouts[node.args[0].name], index_dim(node)
    if p in x.sharded:
        # constant rows of a sharded dim (fused QKV picked by index): one local slice
        picked = constant_values(node.args[1][p], prov.constants)
        found = None if picked is None or x.vocab else local_index(
            picked, x.full[p], x.positions[x.sharded.index(p)],
            lay.positions[lay.sharded.index(p)] if p in lay.sharded else None)
        if found is None:
            raise Refuse("indexes a sharded dim")
        plan.new_target[node.name] = G.aten.slice.Tensor
        plan.new_args[node.name] = (node.args[0], p, *found)


def _index_add(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    if norm_dim(node.args[1], len(lay.full)) in lay.sharded:
        raise Refuse("index_add along a sharded dim")
    for a in (node.args[0], node.args[3]):
        operand(plan, node, a, lay, grad)


def _type_as(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    operand(plan, node, node.args[0], lay, grad)


def _pointwise(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any, grad: frozenset[str], where: str) -> None:
    """Element-wise (torch's ``pointwise`` tag, or ``graph_ops.SAME_LAYOUT``): every operand
    aligned to the output; dropout over a shard draws each rank's own mask."""
    if node.target is G.DROPOUT and is_sharded(lay):
        plan.sharded_dropout.add(node.name)
    for a in node.all_input_nodes:
        operand(plan, node, a, lay, grad)


RULES: dict[Any, Rule] = G.op_table(
    (G.GETITEM, _same_op),
    (G.NEW_EMPTY, _same_op),
    ((G.aten.view.default, G.aten._unsafe_view.default, G.aten.reshape.default, G.aten.expand.default), _view),
    (G.SHAPED_AS, _shaped_as),
    (G.TYPE_AS, _type_as),
    (G.aten.unflatten.int, _unflatten),
    (G.SPLITS, plan_ops.split_rule),
    (G.aten.slice.Tensor, plan_ops.slice_rule),
    (G.CROSS_ENTROPY, _cross_entropy),
    (G.SDPA, plan_ops.attention_rule),
    (G.REDUCTIONS, _reduction),
    (G.NORMS, _reduction),
    (G.aten.cat.default, _cat),
    (G.TRANSPOSES | G.SQUEEZES | {G.aten.unsqueeze.default, G.aten.flatten.using_ints, G.STACK}, _same_op),
    (G.BATCHED_MATMULS, plan_ops.matmul_rule),
    (mixers.CONV1D, plan_ops.conv1d_rule),
    (mixers.ALONG, plan_ops.along_rule),
    (G.LIKE, plan_ops.like_rule),
    (mixers.REPEAT_INTERLEAVE, plan_ops.repeat_rule),
    (mixers.SELECT_SCATTER, plan_ops.select_scatter_rule),
    (G.EINSUM, plan_ops.einsum_rule),
    (complex_views.VIEWS, complex_views.view_rule),
    (G.SELECT, _input_dim_whole(lambda n: n.args[1], "selects one index of a sharded dim")),
    (G.UNBIND, _input_dim_whole(lambda n: arg(n, 1, "dim", 0), "unbinds a sharded dim")),
    (G.PADS, _pad),
    (G.SLICE_SCATTER, _slice_scatter),
    (G.INDEX, _index),
    (G.INDEX_ADD, _index_add),
    (writes.INDEX_PUT, plan_ops.index_put_rule),
)
"""ATen op -> its plan rule; in the order the rules were written, an op in two groups
takes the first (``graph_ops.op_table``). Element-wise ops not named here take
``_pointwise``; any other op refuses."""
