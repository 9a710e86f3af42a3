"""Cut the LM head and its cross-entropy off the last stage, for the vocabulary passes.

With ``ParallelConfig(vocab_passes=True)`` the output layer runs on every pipeline
rank, each on its block of the vocabulary (Yeung et al., "Balancing Pipeline
Parallelism with Vocabulary Parallelism", MLSys 2025, arXiv 2411.05288; the schedule's
S / T actions, ``schedules/vocab_actions.py``). This pass takes the head out of the last
stage's graph by structure:

    linear(x, W[, b]) → [slice of a leading dim | reshape keeping the last dim |
    alias / clone / contiguous | cast | element-wise op]* → cross_entropy
    (or log_softmax → nll_loss) [→ per-token losses reduced by weights]

as ``logit_chain.match_loss`` finds it for the blockwise loss too (2-D logits, no class
weights, no label smoothing; under tensor parallelism the TP pass's
``vocab_parallel_cross_entropy`` of the TP rank's columns, whose blocks are then of
that rank's rows), where the loss is the stage's, ``W`` is a trainable parameter
[V, h] and ``b`` (if any) one of [V], each read nowhere else on the stage. So the heads
people write are taken by their data flow, never by a name:

- a sequence sliced before the loss (``logits[:, :-1]``), a reshaped, flattened or
  viewed loss, -100 targets (the loss's ``ignore_index``);
- element-wise ops: a softcap or a temperature maps each logit alone, so it commutes
  with cutting the vocabulary and every rank applies it to its block before the
  distributed softmax; a trainable parameter [V] such an op reads (a bias added after
  the head, a per-class logit scale) is split into the blocks like ``b``;
- identity autograd wrappers: ``x.view_as(x)`` is gone after canonicalize, an alias is
  passed (of the logits) or seen through (of ``W`` and ``b``);
- ``W`` and ``b`` read through a dtype cast (``F.linear(x, W.to(x.dtype))``, ``W.type_as(x)``:
  speedrun-style heads), seen through by ``weight_views.param_behind``, the finder the TP
  pass uses too; each block's rows are cast to the hidden's dtype as the cast did;
- a cross-entropy with reduction='none' whose per-token losses are reduced by weights
  free of the logits (Megatron's ``sum(losses * loss_mask) / loss_mask.sum()``, a
  mean): the last stage also outputs each token's weight (``passes/token_weights.py``).

The last stage then outputs ``x`` (the head's input) and the class indices instead of
the loss; ``PipelinePlan.vocab_head`` records the chain, the reduction and each rank's
block of rows (V split evenly). ``vocab_rows`` then gives every rank exactly its block
of each of the head's parameters (``VocabHead.params``; and of a tied embedding, whose
lookup its rows' owners do), so storage, optimizer, checkpoints and export work on the
rows as for any row-split parameter. The runtime (``runtime/head_blocks.py``) computes
each block's logits and online-softmax statistics, and their gradients, from there. A
head the passes cannot take is refused naming the op that stops it
(``logit_chain.blocking_op``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.loss_chain import Reduction
from fxpipe.ir.program import ParamKind, Program, TensorSpec
from fxpipe.ir.stage_plan import PipelinePlan, StageValue, VocabHead
from fxpipe.passes.outline_lookups import lookup_of
from fxpipe.ir.loss_chain import ChainKind, ChainOp, VocabOperand
from fxpipe.passes.logit_chain import LossMatch, blocking_op, match_loss
from fxpipe.passes.weight_views import param_behind
from fxpipe.passes.token_weights import Tail, build_weights, descendants, find_tail

aten = torch.ops.aten


def _refuse(why: str) -> ValueError:
    return ValueError(f"vocab_passes=True: {why}; the passes need the last stage's loss to be a cross-entropy "
                      f"of linear(x, W[, b]) through slices, reshapes, casts and element-wise ops, its per-token "
                      f"losses reduced by weights free of the logits (use vocab_passes=False for this model)")


def vocab_head_pass(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    """``config.vocab_passes``: the head cut off the last stage (``cut_vocab_head``)."""
    return cut_vocab_head(plan, ctx.schedule.stage_ranks) if ctx.config.vocab_passes else plan


def cut_vocab_head(plan: PipelinePlan, stage_ranks: Sequence[int]) -> PipelinePlan:
    """The plan with the head cut off its last stage (module docstring); raises a
    one-line ValueError when the head cannot be found."""
    pp = max(stage_ranks) + 1
    last = plan.num_stages - 1
    st = plan.stages[last]
    gm = fx.GraphModule(st.graph_module, _copy(st.graph_module))
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = dict(zip(placeholders[:len(st.params)], st.params))
    canon = plan.canonical
    trainable = {p.name for p in plan.program.params if p.kind is ParamKind.PARAMETER and p.requires_grad}
    out = next(n for n in graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    loss = results[-1]

    def is_param(node) -> bool:
        return node in params and params[node] in trainable

    found = _find(graph, is_param, loss)
    if found is None:
        raise _refuse(f"no LM head found on the last stage (stage {last}){_near_miss(graph, is_param)}")
    linear, w, b, m, tail = found.linear, found.weight, found.bias, found.match, found.tail
    for p in (w, b):
        if p is not None and len(p.users) != 1:
            raise _refuse(f"the head's {'weight' if p is w else 'bias'} {canon[params[p]]!r} is read elsewhere "
                          f"on the last stage")
    rows = int(w.meta["val"].shape[0])
    if rows < pp:
        raise _refuse(f"a vocabulary of {rows} rows cannot be split over pp={pp} ranks")
    x, target = linear.args[0], m.target
    head_values = [x, target]
    if tail is not None:  # per-token losses reduced with a mask: each token's weight instead
        with graph.inserting_before(out):
            head_values.append(build_weights(graph, tail, m.loss, target))
    names = [f"{linear.name}_vocab_{k}" for k in ("hidden", "target", "token_weight")][:len(head_values)]
    n_sent = len(st.outputs)
    # The stage returns its sends, then the head's input, the class indices (and the
    # tokens' weights), then its buffer updates (``Stage.call``'s layout with the loss taken out).
    out.args = (tuple(results[:n_sent]) + tuple(head_values) + tuple(results[n_sent:-1]),)
    for n in reversed(found.nodes):  # the loss first, the linear, its parameters' aliases, the parameters last
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    weight = canon[params[w]]
    keep = tuple(p for node, p in params.items() if node not in (w, b, *m.operands))
    stage = dataclasses.replace(st, graph_module=gm, params=keep, outputs=(*st.outputs, *names))
    values = dict(plan.values)
    for name, node in zip(names, head_values):
        v = node.meta["val"]
        values[name] = StageValue(name=name, producer=last, consumers=(), requires_grad=node is x,
                                  spec=TensorSpec(tuple(int(d) for d in v.shape), v.dtype))
    still = {canon[p] for p in keep}
    param_stages = {n: tuple(s for s in ss if s != last or n in still) for n, ss in plan.param_stages.items()}
    chain = _renamed(m.chain, {n.name: canon[params[n]] for n in m.operands})
    head = VocabHead(weight=weight, hidden=names[0], target=names[1], chain=chain, reduction=int(m.reduction),
                     ignore_index=m.ignore_index, vocab_size=m.vocab_size,
                     bias=canon[params[b]] if b is not None else None,
                     token_weight=names[2] if tail is not None else None,
                     blocks=tuple((r * rows // pp, (r + 1) * rows // pp) for r in range(pp)))
    stages = plan.stages[:last] + (stage,)
    return dataclasses.replace(plan, stages=stages, values=values, param_stages=param_stages, vocab_head=head)


@dataclass(frozen=True)
class _Found:
    linear: fx.Node
    weight: fx.Node
    """The weight's parameter (placeholder), seen through aliases."""
    bias: fx.Node | None
    match: LossMatch
    tail: Tail | None
    """With reduction='none': the ops reducing the per-token losses with weights."""
    aliases: tuple[fx.Node, ...]
    """Identity aliases and dtype casts between the parameters and the linear."""

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """Every node the head is, in an order that lets them go in reverse: parameters,
        their aliases, the linear to the loss."""
        params = (self.weight,) + ((self.bias,) if self.bias is not None else ()) + self.match.operands
        return (*params, *self.aliases, *self.match.removed, *(self.tail.nodes if self.tail is not None else ()))


def _find(graph: fx.Graph, is_weight, loss: fx.Node | None) -> _Found | None:
    """The head whose loss is ``loss`` (None: a value the graph's output returns), or
    None. ``is_weight`` tells a trainable parameter: the weight must be one, and so must
    the bias if there is one (each row's bias is split with its row). The loss is the
    cross-entropy, or with reduction='none' the end of the tail that reduces its
    per-token losses with weights (``passes/token_weights.py``)."""
    out = next(n for n in graph.nodes if n.op == "output")
    for node in _heads(graph, is_weight):
        m = match_loss(node, vocab_parallel=True, is_param=is_weight)
        if m is None:
            continue
        tail: Tail | None = None
        if m.reduction is Reduction.NONE:
            tail, _ = find_tail(m.loss, descendants(node))
            if tail is None:
                continue
        end = tail.nodes[-1] if tail is not None else m.loss
        if end is loss if loss is not None else out in end.users:
            (w, w_aliases), (b, b_aliases) = _param(node.args[1]), _param(_bias(node))
            return _Found(node, w, b, m, tail, (*reversed(w_aliases), *reversed(b_aliases)))
    return None


def _bias(linear: fx.Node) -> fx.Node | None:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def _param(node: fx.Node | None) -> tuple[fx.Node | None, list[fx.Node]]:
    """The value ``node`` reads through identity aliases and dtype casts (``weight_views``),
    and those views from ``node`` back: the runtime computes a block's logits with its rows
    cast to the hidden's dtype, which is what a cast before ``linear`` does."""
    return param_behind(node)


def _heads(graph: fx.Graph, is_weight) -> list[fx.Node]:
    """The linears of trainable parameters (weight, and bias if any), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is aten.linear.default
            and is_weight(_param(n.args[1])[0]) and (_bias(n) is None or is_weight(_param(_bias(n))[0]))]


def _near_miss(graph: fx.Graph, is_weight) -> str:
    """Why the last linear of a trainable weight (the likely head) is not taken: the op
    its logits, or its per-token losses, stop at (empty when the graph has no such linear)."""
    heads = _heads(graph, is_weight)
    if not heads:
        return ""
    m = match_loss(heads[-1], vocab_parallel=True, is_param=is_weight)
    if m is None:
        return f": {blocking_op(heads[-1], is_weight)}"
    if m.reduction is not Reduction.NONE:
        return f": its cross-entropy ({m.loss.name}) is not the stage's loss"
    _, stop = find_tail(m.loss, descendants(heads[-1]))
    readers = ", ".join(sorted(str(u.target) for u in stop.users)) or "the output"
    return f": its per-token losses (reduction='none') reach {readers}, which is no view, product or quotient " \
           f"by a value free of the logits, sum or mean"


def head_nodes(program: Program) -> frozenset[str]:
    """The whole graph's nodes the vocabulary passes run instead of the last stage (the
    head's linear, the ops to the loss, the cross-entropy and a per-token reduction's
    ops): the partition balances
    the stages without them (``PartitionConfig.elsewhere``). Empty when there is none
    (``vocab_head_pass`` refuses that model after the split)."""
    trainable = {p.node for p in program.params if p.kind is ParamKind.PARAMETER and p.requires_grad}
    found = _find(program.graph, lambda w: isinstance(w, fx.Node) and w.name in trainable, None)
    return frozenset(n.name for n in found.nodes if n.op != "placeholder") if found is not None else frozenset()


def _renamed(chain: tuple[ChainOp, ...], names: dict[str, str]) -> tuple[ChainOp, ...]:
    """``chain`` with its operands' parameters named by ``names`` (graph node -> canonical)."""
    def rename(a):
        return VocabOperand(names[a.param], a.chain) if isinstance(a, VocabOperand) else a
    return tuple(ChainOp(c.kind, (c.args[0], tuple(map(rename, c.args[1])), c.args[2]))
                 if c.kind is ChainKind.POINTWISE else c for c in chain)


def _copy(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def vocab_row_params(program: Program, elsewhere: frozenset[str]) -> frozenset[str]:
    """Canonical names of the trainable parameters that every pipeline rank holds an
    even block of rows of under vocabulary passes, decided before the partition: the
    weights the head nodes (``elsewhere``) read, split into one block per rank
    (``VocabHead.blocks``), and each table that an embedding lookup of batch token ids
    reads, which ``vocab_rows`` gives the head's rows when tied and splits evenly where
    the head is split when untied (``passes/outline_lookups.py``; under TP of each TP
    rank's rows). The partition charges their state evenly per rank instead of to the
    stage that reads them (``PartitionConfig.spread``)."""

    if not elsewhere:
        return frozenset()
    params = {p.node: p for p in program.params if p.kind is ParamKind.PARAMETER and p.requires_grad}
    nodes = {n.name: n for n in program.graph.nodes}
    out = {params[a.name].canonical for e in elsewhere for a in nodes[e].all_input_nodes if a.name in params}
    batch = {nodes[name]: i for i, name in enumerate(program.inputs)}
    for node in program.graph.nodes:
        table = node.args[0] if node.op == "call_function" and node.args else None
        if isinstance(table, fx.Node) and table.name in params and lookup_of(node, table, batch) is not None:
            out.add(params[table.name].canonical)
    return frozenset(out)
