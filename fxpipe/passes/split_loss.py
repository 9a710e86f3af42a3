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
target: the cross-entropy's gradient. What matches, by structure only:

    cat(blocks, -1) → [slice of a leading dim | reshape keeping the last dim |
    alias / clone / contiguous | cast to the same dtype or up to fp32 |
    element-wise op of the logits and scalars]* → cross_entropy_loss
    (or _log_softmax(-1) → nll_loss_forward / nll_loss_nd / nll_loss)

with 2-D logits, no class weights and no label smoothing; reduction none / mean
(over non-ignored targets) / sum, and ``ignore_index``. An element-wise op (ATen's
``pointwise`` tag, every other argument a Python scalar: a softcap ``c·tanh(l / c)``,
a temperature ``l / T``) maps each logit alone, so it commutes with cutting the
vocabulary and each block replays it. Anything else is left as is.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.ir.loss_chain import ChainKind, ChainOp, Reduction
from fxpipe.ir.pass_results import BlockwiseLoss, LossBlock
from fxpipe.ir.program import Program
from fxpipe.passes.node_cost import cost_pass
from fxpipe.passes.split import side_values
from fxpipe.passes.split_matmul import MatmulSplit, call
from fxpipe.tp.ops import OPS

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
_IDENTITY = (aten.alias.default, aten.clone.default, aten.contiguous.default)
_CASTS = (aten._to_copy.default, aten.to.dtype)
_NLL = (aten.nll_loss_forward.default, aten.nll_loss_nd.default, aten.nll_loss.default)
_LOG_SOFTMAX = (aten._log_softmax.default, aten.log_softmax.int)


@dataclass(frozen=True)
class _Match:
    chain: tuple[ChainOp, ...]
    removed: tuple[fx.Node, ...]
    """Nodes the rewrite makes dead, in graph order (cat first)."""
    loss: fx.Node
    """The node whose value the new loss replaces."""
    target: fx.Node
    reduction: Reduction
    ignore_index: int
    vocab_size: int | None = None
    """The vocabulary-parallel cross-entropy's (unpadded) vocabulary: the logits are one
    tensor-parallel rank's columns. None: an ATen cross-entropy of whole logits."""


def _bound(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _chain_op(cur: fx.Node, user: fx.Node) -> ChainOp | None:
    """The ChainOp ``user`` applies to ``cur`` if it commutes with cutting the last dim,
    None when it does not."""
    vin, vout = cur.meta["val"], user.meta["val"]
    if not isinstance(vout, torch.Tensor) or user.args[0] is not cur or vout.dim() == 0:
        return None
    if user.target is aten.slice.Tensor:
        a = _bound(user)
        dim = a["dim"] % vin.dim()
        if dim == vin.dim() - 1:
            return None
        return ChainOp(ChainKind.SLICE, (dim, a["start"], a["end"], a["step"]))
    if user.target in _RESHAPES and vout.shape[-1] == vin.shape[-1]:
        # Rows stay rows when the last dim is kept: any regrouping of leading dims.
        return ChainOp(ChainKind.RESHAPE, tuple(int(d) for d in vout.shape[:-1]))
    if user.target in _IDENTITY and vout.shape == vin.shape:
        return ChainOp(ChainKind.IDENTITY, ())
    if user.target in _CASTS and vout.device == vin.device and vout.shape == vin.shape and \
            (vout.dtype == vin.dtype or (vout.dtype == torch.float32 and vin.dtype.is_floating_point)):
        return ChainOp(ChainKind.CAST, (vout.dtype,))
    if _elementwise(user) and vout.shape == vin.shape and vout.dtype == vin.dtype:
        return ChainOp(ChainKind.POINTWISE, (user.target, tuple(user.args[1:]), tuple(user.kwargs.items())))
    return None


def _elementwise(node: fx.Node) -> bool:
    """An op that maps each logit alone: ATen tags it pointwise, draws no random number,
    and reads nothing but the logits (its first argument) and scalars, so a block's
    results are the whole's at the block's columns."""
    tags = getattr(node.target, "tags", ())
    scalar = (int, float, bool, type(None))
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and \
        all(isinstance(a, scalar) for a in (*node.args[1:], *node.kwargs.values()))


def _walk(cat: fx.Node) -> tuple[list[ChainOp], list[fx.Node], fx.Node]:
    """Follow ``cat``'s logits through ChainOps while each value has one reader:
    (the ops to replay, the nodes passed, the last of them)."""
    cur, chain, removed = cat, [], [cat]
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        op = _chain_op(cur, user)
        if op is None:
            break
        if op.kind is not ChainKind.IDENTITY:
            chain.append(op)
        removed.append(user)
        cur = user
    return chain, removed, cur


def blocking_op(cat: fx.Node) -> str:
    """What stops ``cat``'s logits from reaching a cross-entropy ``_match`` takes, in
    words naming the op: for an error message."""
    _chain, _removed, cur = _walk(cat)
    readers = sorted(str(u.target) for u in cur.users)
    if len(readers) != 1:
        return f"the logits ({cur.target}) are read by {len(readers)} ops ({', '.join(readers) or 'none'})"
    logits, reader = cur.meta["val"], next(iter(cur.users))
    if logits.dim() != 2 and reader.target in (aten.cross_entropy_loss.default, *_LOG_SOFTMAX):
        return f"the logits reach {readers[0]} as a {logits.dim()}-D tensor (2-D [tokens, V] wanted)"
    return f"the logits reach {readers[0]}, which is no element-wise op of the logits and scalars, slice or " \
           f"reshape of leading dims, cast, nor a cross-entropy without class weights or label smoothing"


def _match(cat: fx.Node, vocab_parallel: bool = False) -> _Match | None:
    """The cross-entropy that ``cat``'s logits reach through a chain of ChainOps. With
    ``vocab_parallel``, also the tensor-parallel pass's vocabulary-parallel cross-entropy
    (``fxpipe_tp.vocab_parallel_cross_entropy``; the vocabulary passes run it per block,
    the blockwise loss here does not)."""
    chain, removed, cur = _walk(cat)
    if len(cur.users) != 1:
        return None
    user = next(iter(cur.users))
    logits = cur.meta["val"]
    if logits.dim() != 2:
        return None
    if user.target is aten.cross_entropy_loss.default:
        a = _bound(user)
        if a["self"] is not cur or a["weight"] is not None or a["label_smoothing"] != 0.0:
            return None
        loss, target = user, a["target"]
        removed.append(user)
    elif vocab_parallel and user.target is OPS.vocab_parallel_cross_entropy.default:
        logits_arg, target, vocab_size, ignore_index, reduction = user.args
        if logits_arg is not cur or tuple(target.meta["val"].shape) != (logits.shape[0],):
            return None
        return _Match(chain=tuple(chain), removed=(*removed, user), loss=user, target=target,
                      reduction=Reduction(reduction), ignore_index=int(ignore_index), vocab_size=int(vocab_size))
    elif user.target in _LOG_SOFTMAX and user.args[1] in (-1, 1) and len(user.users) == 1:
        ls = _bound(user)
        if ls.get("half_to_float") or ls.get("dtype") is not None:
            return None
        nll = next(iter(user.users))
        if nll.target not in _NLL:
            return None
        a = _bound(nll)
        if a["self"] is not user or a["weight"] is not None:
            return None
        removed += [user, nll]
        loss, target = nll, a["target"]
        if nll.target is aten.nll_loss_forward.default:  # (output, total_weight)
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in nll.users) or len(nll.users) != 1:
                return None
            loss = next(iter(nll.users))
            removed.append(loss)
    else:
        return None
    if tuple(target.meta["val"].shape) != (logits.shape[0],):
        return None
    return _Match(chain=tuple(chain), removed=tuple(removed), loss=loss, target=target,
                  reduction=Reduction(a["reduction"]), ignore_index=int(a["ignore_index"]))


def build_loss_block(graph: fx.Graph, logits: fx.Node, target: fx.Node, start: int, end: int,
                     chain: tuple[ChainOp, ...], acc: fx.Node | None) -> LossBlock:
    """Insert one block's share for vocabulary entries [start, end) at the insertion point:
    its logsumexp and target pick, folded into ``acc`` (the blocks before it; None: first)."""
    built: list[fx.Node] = []

    def op(target_op, *args, **kwargs) -> fx.Node:
        built.append(call(graph, target_op, *args, **kwargs))
        return built[-1]

    cur, width = logits, end - start
    for c in chain:
        if c.kind is ChainKind.SLICE:
            cur = op(aten.slice.Tensor, cur, *c.args)
        elif c.kind is ChainKind.RESHAPE:
            cur = op(aten.reshape.default, cur, [*c.args, width])
        elif c.kind is ChainKind.CAST:
            cur = op(aten._to_copy.default, cur, dtype=c.args[0])
        elif c.kind is ChainKind.POINTWISE:
            target_op, rest, kwargs = c.args
            cur = op(target_op, cur, *rest, **dict(kwargs))
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


def _finish(graph: fx.Graph, acc: fx.Node, m: _Match) -> fx.Node:
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


def _rewrite(gm: fx.GraphModule, split: MatmulSplit, m: _Match, paths: dict, layers: dict,
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
    for n in reversed(m.removed):
        assert not n.users, n
        graph.erase_node(n)
        paths.pop(n.name, None)
        layers.pop(n.name, None)
    return BlockwiseLoss(chain=m.chain, target=m.target.name, blocks=tuple(blocks))


def split_loss_pass(program: Program) -> Program:
    """Rewrite each cross-entropy over the cat of a split matmul's blocks into per-block
    logsumexp and target picks (module docstring). Run right after ``split_matmul_pass``;
    ``Program.loss_splits`` lists the rewrites, and the costs are recomputed."""
    splits = program.matmul_splits
    if not splits:
        return program
    gm = copy.deepcopy(program.graph_module)
    by_name = {n.name: n for n in gm.graph.nodes}
    paths, layers = dict(program.module_paths), dict(program.layers)
    done = []
    side = side_values(program)
    for split in splits:
        first = by_name.get(split.blocks[0].output)
        outputs = [by_name.get(b.output) for b in split.blocks]
        cats = [u for u in (first.users if first is not None else ())
                if u.target is aten.cat.default and list(u.args[0]) == outputs
                and (len(u.args) < 2 or u.args[1] in (-1, u.meta["val"].dim() - 1))]
        m = _match(cats[0]) if len(cats) == 1 else None
        if m is not None:
            done.append(_rewrite(gm, split, m, paths, layers, side))
    if not done:
        return program
    gm.graph.lint()
    gm.recompile()
    return cost_pass(program.replace(graph_module=gm, module_paths=paths, layers=layers, costs={},
                                     loss_splits=(*program.loss_splits, *done)))
