"""Split oversized matmuls along their output features, so no single op outweighs a stage.

A stage is a set of whole ops, so one op heavier than the ideal stage share sets a
floor under the slowest stage that no partition can beat. The usual case is the
vocabulary projection of a vocabulary-heavy model: GPT-2 with 8 layers of
h=256 spends ~60% of its FLOPs in the 50257-way LM head, so at pp=2 one stage always
does well over half the work. (Yeung et al., "Balancing Pipeline Parallelism with
Vocabulary Parallelism", 2024, measure the same imbalance on large models.)

The rewrite is exact: ``y = x Wᵀ + b`` with W's rows (the output features) cut into
k blocks becomes ``cat([x W₀ᵀ + b₀, …, x Wₖ₋₁ᵀ + bₖ₋₁], -1)`` — each output element
is the same dot product; only the backward's sum over blocks for dx changes the
floating-point summation order. Each block is its own node (its own coarsening key),
so the partitioner may put blocks on different stages; sending a block's output
costs bytes, which the partitioner prices like any other cut.

Which ops: ``aten.linear`` (weight [out, in]) and ``aten.addmm`` / ``aten.mm`` whose
right operand is [in, out] (Conv1D-style layers), chosen by structure and cost only:
an op whose matmul FLOPs exceed 1/(2S) of the model's is cut into
ceil(share · BLOCKS_PER_SHARE · S) blocks (at most MAX_BLOCKS), so each block is at
most an eighth of a stage's share. ``Program.matmul_splits`` records each split
(``MatmulSplit``) so that later passes can rebuild any feature range of it:
``split_loss_pass`` gives each block its share of the cross-entropy, and
``coalesce_blocks_pass`` merges, after partitioning, the neighbouring blocks one stage
holds into one block again.

Why eight blocks per stage share. Every block's weight slice has its own backward,
which builds a zero gradient of the whole weight and adds its block into it (on
GPT-2's 50257×256 head, ~15-30 ms per block on this CPU), so blocks used to be few
(two per share, at most 8), and balance was capped by their size. Coalescing removes
that cost where it is paid (a stage runs one slice per run of blocks), so the count is
set by the partitioner's predicted balance alone. HF GPT-2, 8 layers of h=256,
V=50257, s=128, microbatch of 2, 1F1B, CPU cost model, with the blockwise loss, ILP
max/mean stage time (slowest stage):

    blocks per share     2              4              6              8              12
    pp=2            1.164 (488 ms) 1.005 (437 ms) 1.044 (454 ms) 1.023 (445 ms) 1.030 (448 ms)
    pp=4            1.038 (264 ms) 1.082 (236 ms) 1.038 (228 ms) 1.017 (223 ms) 1.037 (227 ms)

(the first column without the blockwise loss, as before it existed; the head whole:
1.132 (457 ms) / 2.248 (457 ms); the ideal, total / S: 435 / 219 ms.) Eight is within
3% of the ideal at both; the steps are not monotone because block edges fall against
layer edges. MAX_BLOCKS = 32 caps the graph for models whose head is almost all of
the FLOPs.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_results import MatmulBlock, MatmulSplit
from fxpipe.ir.program import Program
from fxpipe.passes.graph_edit import GraphEdit

aten = torch.ops.aten
MAX_BLOCKS = 32
BLOCKS_PER_SHARE = 8
"""Blocks per stage share: an op of share f of the matmul FLOPs gets ceil(f · 8 · S) blocks
(at most MAX_BLOCKS), each at most an eighth of a stage's share (module docstring)."""
MATMULS = (aten.linear.default, aten.addmm.default, aten.mm.default)


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    size = -(-n // k)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def fake(node: fx.Node, fn, *args) -> None:
    """Set ``node.meta["val"]`` to ``fn`` applied to the fake values of ``args``."""
    val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    vals = [[val(x) for x in a] if isinstance(a, (list, tuple)) else val(a) for a in args]
    flat = [v for v in vals if isinstance(v, torch.Tensor)] + \
        [t for v in vals if isinstance(v, (list, tuple)) for t in v if isinstance(t, torch.Tensor)]
    mode = detect_fake_mode(flat)
    with mode:
        node.meta["val"] = fn(*vals)


def call(graph: fx.Graph, op, *args, **kwargs) -> fx.Node:
    """A new ``op(*args, **kwargs)`` node with its fake value."""
    node = graph.call_function(op, args, kwargs)
    fake(node, lambda *a: op(*a, **kwargs), *args)
    return node


def build_block(graph: fx.Graph, split: MatmulSplit, start: int, end: int) -> MatmulBlock:
    """Insert the matmul of output features [start, end) at the graph's insertion point."""
    nodes = {n.name: n for n in graph.nodes if n.name in (split.x, split.weight, split.bias)}
    x, w = nodes[split.x], nodes[split.weight]
    wi = call(graph, aten.slice.Tensor, w, split.weight_dim, start, end)
    built = [wi]
    bi = None
    if split.bias is not None:
        bias = nodes[split.bias]
        bi = call(graph, aten.slice.Tensor, bias, bias.meta["val"].dim() - 1, start, end)
        built.append(bi)
    if split.target is aten.linear.default:
        args = (x, wi, bi) if bi is not None else (x, wi)
    elif split.target is aten.addmm.default:
        args = (bi, x, wi)
    else:
        args = (x, wi)
    y = call(graph, split.target, *args, **dict(split.kwargs))
    built.append(y)
    return MatmulBlock(start=start, end=end, output=y.name, nodes=tuple(n.name for n in built))


def block_key(split: MatmulSplit, first: int, last: int) -> str:
    """Coarsening key of blocks first..last (one block: ``key[i/k]``)."""
    k = len(split.blocks)
    return f"{split.key}[{first}/{k}]" if first == last else f"{split.key}[{first}:{last + 1}/{k}]"


def _split_one(graph: fx.Graph, node: fx.Node, k: int, key: str) -> tuple[MatmulSplit, fx.Node] | None:
    """Rewrite ``node`` into k output-feature blocks and a cat."""
    if node.target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        w_dim = 0
    elif node.target is aten.addmm.default:
        bias, x, w = node.args[0], node.args[1], node.args[2]
        w_dim = 1
    else:
        (x, w), bias, w_dim = node.args[:2], None, 1
    if bias is not None and not isinstance(bias, fx.Node):
        return None
    split = MatmulSplit(target=node.target, x=x.name, weight=w.name,
                        bias=bias.name if bias is not None else None, weight_dim=w_dim,
                        kwargs=tuple(node.kwargs.items()), key=key, blocks=())
    with graph.inserting_before(node):
        blocks = tuple(build_block(graph, split, a, b) for a, b in _blocks(w.meta["val"].shape[w_dim], k))
        outputs = {n.name: n for n in graph.nodes if n.name in {b.output for b in blocks}}
        cat = call(graph, aten.cat.default, [outputs[b.output] for b in blocks], -1)
    if "fxpipe_tp_replicated" in node.meta:
        cat.meta["fxpipe_tp_replicated"] = node.meta["fxpipe_tp_replicated"]
    node.replace_all_uses_with(cat)
    graph.erase_node(node)
    return MatmulSplit(**{**split.__dict__, "blocks": blocks}), cat


def split_matmul_pass(program: Program, ctx: CompileContext) -> Program:
    """Cut the matmuls too heavy for the stages of ``ctx.schedule`` (``split_matmuls``), where
    there is time to balance: not under vocabulary passes (the head runs whole per block on
    every rank), nor for a partition that ignores time (uniform, params)."""
    if ctx.config.vocab_passes or not ctx.config.balances_time:
        return program
    return split_matmuls(program, ctx.schedule.num_stages)


def split_matmuls(program: Program, num_stages: int) -> Program:
    """Cut every matmul heavier than 1/(2·num_stages) of the model's matmul FLOPs into
    output-feature blocks (module docstring). Needs the cost pass's annotations and
    returns them for the rewritten graph; ``Program.matmul_splits`` lists the splits."""
    if num_stages < 2 or not program.costs:
        return program
    costs = program.costs
    total = sum(c.fwd_flops + c.bwd_flops for c in costs.values())
    if total <= 0:
        return program
    heavy = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in MATMULS:
            continue
        c = costs.get(node.name)
        share = (c.fwd_flops + c.bwd_flops) / total if c is not None else 0.0
        if share > 1 / (2 * num_stages):
            heavy.append((node.name, min(MAX_BLOCKS, math.ceil(share * BLOCKS_PER_SHARE * num_stages))))
    if not heavy:
        return program
    edit = GraphEdit.of(program)
    paths, layers = edit.paths, edit.layers
    splits = []
    for name, k in heavy:
        node = edit.by_name[name]
        k = min(k, node.meta["val"].shape[-1])
        if k < 2:
            continue
        done = _split_one(edit.gm.graph, node, k, paths.get(name) or name)
        if done is None:
            continue
        split, cat = done
        splits.append(split)
        for i, block in enumerate(split.blocks):
            for n in block.nodes:
                paths[n] = block_key(split, i, i)
        paths[cat.name] = split.key
        for n in [cat.name, *(n for b in split.blocks for n in b.nodes)]:
            if name in layers:
                layers[n] = layers[name]
        paths.pop(name, None)
        layers.pop(name, None)
    if not splits:
        return program
    return edit.recosted(program, matmul_splits=(*program.matmul_splits, *splits))
