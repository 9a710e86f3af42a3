"""Blockwise cross-entropy over split logits, so no op reads the whole vocabulary.

After ``split_matmul_pass`` cuts the LM head into output-feature blocks, the
cross-entropy still reads the ``cat`` of all of them: one indivisible op over the
[tokens, V] logits, which must sit on one stage with every block's output sent to
it. Cross-entropy needs only two numbers per token from the vocabulary,

    loss_t = logsumexp_v(l_tv) − l_t,y_t,

and both decompose over blocks of v: ``lse_t = logsumexp_k(lse_tk)`` with
``lse_tk = logsumexp_{v∈k}(l_tv)``, and ``l_t,y_t = Σ_k pick_tk`` where ``pick_tk``
is the target's logit if ``y_t`` falls in block k and 0 otherwise. That is the
vocabulary-parallel cross-entropy of Megatron (Shoeybi et al. 2019, §3: "fuse the
output GEMM with the cross-entropy loss, which reduces the dimension to b×s") and of
Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism" (2024,
§4), applied here across pipeline blocks instead of tensor ranks. Each block computes
its ``lse`` and ``pick`` from its own logits under its own coarsening key (the block's
matmul key), and folds them into a running ``acc = [lse, pick]`` of shape (2, tokens):
``lse ← logaddexp(lse, lse_k)``, ``pick ← pick + pick_k``; the last block's ``acc``
gives the loss. Two reasons for a fold instead of one logsumexp over all blocks at the
end: where the next block sits on a later stage exactly one (2, tokens) tensor crosses
(not two vectors per block, each paying a transfer's latency), and since ``acc_k``
feeds ``acc_k+1`` the stages hold blocks in feature order, so each stage holds one
contiguous run that ``coalesce_blocks_pass`` turns into one slice. The block's nodes
are placed right after its matmul (the target's batch-only computation is hoisted
above the first block) so the chain-DP warm start of the ILP, which cuts one
topological order, sees a block's matmul and loss share side by side.

Per block, ``lse`` is computed as the block's own cross-entropy at the clamped target
index plus the logit there (``_log_softmax`` + ``nll_loss_forward``, fused kernels)
rather than by ``logsumexp``, whose composite backward makes three passes over the
block (measured on this CPU for [254, 50257] fp32 logits, fwd+bwd of the loss part:
~130 ms this way, ~210 ms with logsumexp, ~80 ms for the whole ``cross_entropy``).
The cost pass prices the new ops by their bytes like any element-wise op, so the
partitioner sees the loss divided among the blocks in proportion to their width.

The rewrite is exact up to floating-point order: the gradient of each block's lse is
its softmax (log_softmax's minus the one-hot of nll, plus the gather's one-hot),
weighted by ``exp(lse_k − lse)`` through the fold, and the pick's is the one-hot
target: the cross-entropy's gradient. What matches, by structure only, is what
``logit_chain.match_loss`` finds between the ``cat`` and a cross-entropy (slices and
reshapes of leading dims, casts, element-wise ops: a softcap, a temperature, a bias or
scale [V] parameter, whose rows each block slices); anything else is left as is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.loss_chain import ChainKind, ChainOp, Reduction, Slot, VocabOperand
from fxpipe.ir.pass_results import BlockwiseLoss, LossBlock
from fxpipe.ir.program import ParamKind, Program
from fxpipe.passes.logit_chain import LossMatch, match_loss
from fxpipe.passes.graph_edit import GraphEdit
from fxpipe.passes.split import side_values
from fxpipe.passes.split_matmul import MatmulSplit, call

aten = torch.ops.aten


def build_loss_block(graph: fx.Graph, logits: fx.Node, target: fx.Node, start: int, end: int,
                     chain: tuple[ChainOp, ...], acc: fx.Node | None) -> LossBlock:
    """Insert one block's share for vocabulary entries [start, end) at the insertion point:
    its logsumexp and target pick, folded into ``acc`` (the blocks before it; None: first)."""
    built: list[fx.Node] = []

    def op(target_op, *args, **kwargs) -> fx.Node:
        built.append(call(graph, target_op, *args, **kwargs))
        return built[-1]

    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}

    def replay(chain: tuple[ChainOp, ...], cur: fx.Node) -> fx.Node:  # ir/loss_chain.replay, as graph nodes
        for c in chain:
            if c.kind is ChainKind.SLICE:
                cur = op(aten.slice.Tensor, cur, *c.args)
            elif c.kind is ChainKind.RESHAPE:
                cur = op(aten.reshape.default, cur, [*c.args, width])
            elif c.kind is ChainKind.CAST:
                cur = op(aten._to_copy.default, cur, dtype=c.args[0])
            elif c.kind is ChainKind.POINTWISE:  # an operand [V]: the block's rows of its parameter
                target_op, args, kwargs = c.args
                cur = op(target_op, *(cur if a is Slot.VALUE else replay(a.chain, op(
                    aten.slice.Tensor, placeholders[a.param], 0, start, end)) if isinstance(a, VocabOperand) else a
                    for a in args), **dict(kwargs))
        return cur

    width = end - start
    cur = replay(chain, logits)
    # The target's index in this block, clamped, and whether it falls in it (batch-only
    # values: every stage recomputes them).
    local = op(aten.sub.Tensor, target, start)
    inside = op(aten.bitwise_and.Tensor, op(aten.ge.Scalar, local, 0), op(aten.lt.Scalar, local, width))
    index = op(aten.clamp.default, local, 0, width - 1)  # (N,)
    # lse over the block as the block's own cross-entropy at that index plus the logit
    # there: ce = lse − l[index]. The fused log_softmax / nll_loss kernels cost about
    # 0.6x of logsumexp's composite backward (sub, exp, mul over the block) on CPU.
    ce = op(operator.getitem, op(aten.nll_loss_forward.default, op(aten._log_softmax.default, cur, 1, False),
                                 index, None, int(Reduction.NONE), -100), 0)  # (N,)
    picked = op(aten.squeeze.dim, op(aten.gather.default, cur, -1, op(aten.unsqueeze.default, index, -1)), -1)
    lse = op(aten.add.Tensor, ce, picked)
    pick = op(aten.where.ScalarOther, inside, picked, 0.0)  # the target's logit, or 0
    if acc is not None:  # logsumexp over the union = logaddexp of the two; picks add
        lse = op(aten.logaddexp.default, op(aten.select.int, acc, 0, 0), lse)
        pick = op(aten.add.Tensor, op(aten.select.int, acc, 0, 1), pick)
    # One (2, N) tensor: where the next block sits on a later stage, one transfer.
    out = op(aten.stack.default, [lse, pick], 0)
    return LossBlock(logits=logits.name, acc=out.name, nodes=tuple(n.name for n in built))


def _finish(graph: fx.Graph, acc: fx.Node, m: LossMatch) -> fx.Node:
    """The loss from the running (lse, pick), with nll_loss's reduction semantics."""
    per = call(graph, aten.sub.Tensor, call(graph, aten.select.int, acc, 0, 0),
               call(graph, aten.select.int, acc, 0, 1))  # (N,) = −log p(target)
    valid = call(graph, aten.ne.Scalar, m.target, m.ignore_index)
    per = call(graph, aten.where.ScalarOther, valid, per, 0.0)
    if m.reduction is Reduction.NONE:
        return per
    if m.reduction is Reduction.SUM:
        return call(graph, aten.sum.default, per)
    # mean over the targets that count (0/0 = nan when none does, as nll_loss)
    return call(graph, aten.div.Tensor, call(graph, aten.sum.default, per), call(graph, aten.sum.default, valid))


def _hoist(graph: fx.Graph, target: fx.Node, before: fx.Node, side: set[str]) -> bool:
    """Move the target's computation above ``before`` (the first block), so each block's
    loss share can follow its matmul in graph order: the chain-DP warm start of the ILP
    cuts one topological order, and must find a block's matmul and loss share side by
    side to put both on one stage. Only side values (batch-only, deterministic) move."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, stack = set(), [target]
    while stack:
        n = stack.pop()
        if order[n] > order[before] and n not in late:
            late.add(n)
            stack += n.all_input_nodes
    if any(n.name not in side for n in late):
        return False
    for n in sorted(late, key=order.__getitem__):
        before.prepend(n)
    return True


def _rewrite(gm: fx.GraphModule, split: MatmulSplit, m: LossMatch, paths: dict, layers: dict,
             side: set[str]) -> BlockwiseLoss:
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    beside = _hoist(graph, m.target, nodes[split.blocks[0].nodes[0]], side)
    blocks: list[LossBlock] = []
    for block in split.blocks:
        out = nodes[block.output]
        acc = nodes[blocks[-1].acc] if blocks else None
        with graph.inserting_before(out.next if beside else m.loss):
            lb = build_loss_block(graph, out, m.target, block.start, block.end, m.chain, acc)
        nodes.update((n.name, n) for n in graph.nodes if n.name in lb.nodes)
        blocks.append(lb)
        for n in lb.nodes:
            paths[n] = paths[block.output]
            if block.output in layers:
                layers[n] = layers[block.output]
    known = {n.name for n in graph.nodes}
    with graph.inserting_before(m.loss):
        loss = _finish(graph, nodes[blocks[-1].acc], m)
    for n in (n for n in graph.nodes if n.name not in known):  # the final ops
        paths[n.name] = paths.get(m.loss.name, "")
        if m.loss.name in layers:
            layers[n.name] = layers[m.loss.name]
    m.loss.replace_all_uses_with(loss)
    replaced = tuple(n.name for n in m.removed)
    for n in reversed(m.removed):
        assert not n.users, n
        graph.erase_node(n)
        paths.pop(n.name, None)
        layers.pop(n.name, None)
    return BlockwiseLoss(chain=m.chain, target=m.target.name, blocks=tuple(blocks), replaced=replaced)


def split_loss_pass(program: Program, ctx: CompileContext) -> Program:
    """``config.split_loss``: the cross-entropy over split logits block by block (``blockwise_loss``)."""
    return blockwise_loss(program) if ctx.config.split_loss else program


def blockwise_loss(program: Program) -> Program:
    """Rewrite each cross-entropy over the cat of a split matmul's blocks into per-block
    logsumexp and target picks (module docstring). Run right after ``split_matmuls``;
    ``Program.loss_splits`` lists the rewrites, and the costs are recomputed."""
    splits = program.matmul_splits
    if not splits:
        return program
    edit = GraphEdit.of(program)
    by_name = edit.by_name
    done = []
    side = side_values(program)
    trainable = {p.node for p in program.params if p.kind is ParamKind.PARAMETER and p.requires_grad}
    for split in splits:
        first = by_name.get(split.blocks[0].output)
        outputs = [by_name.get(b.output) for b in split.blocks]
        cats = [u for u in (first.users if first is not None else ())
                if u.target is aten.cat.default and list(u.args[0]) == outputs
                and (len(u.args) < 2 or u.args[1] in (-1, u.meta["val"].dim() - 1))]
        m = match_loss(cats[0], is_param=lambda n: n.op == "placeholder" and n.name in trainable) \
            if len(cats) == 1 else None
        if m is not None:
            done.append(_rewrite(edit.gm, split, m, edit.paths, edit.layers, side))
    if not done:
        return program
    return edit.recosted(program, loss_splits=(*program.loss_splits, *done))
