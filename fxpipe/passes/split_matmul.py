"""Split oversized matmuls along their output features, so no single op outweighs a stage.

A stage is a set of whole ops, so one op heavier than the ideal stage share sets a
floor under the slowest stage that no partition can beat. The usual case is the
vocabulary projection of a small-vocabulary-heavy model: GPT-2 with 8 layers of
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
ceil(share · 2S) blocks (at most 8), so each block is at most half a stage's share.
Finer blocks balance better but cost more here: every block's weight slice has its
own backward, which builds a zero gradient of the whole weight and adds its block
into it (measured on GPT-2's 50257×256 head at pp=2: 3 blocks, imbalance 1.14 and a
1.52x speed-up; 10 blocks, imbalance 1.04 but the profile's work per microbatch
743 ms instead of 576 and a 1.21x speed-up). Coalescing the blocks each stage was
given into one slice after partitioning would keep both; not built yet.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpipe.passes.node_cost import cost_pass
from fxpipe.program import Program

aten = torch.ops.aten
MAX_BLOCKS = 8


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    size = -(-n // k)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _fake(node: fx.Node, fn, *args):
    val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    vals = [[val(x) for x in a] if isinstance(a, (list, tuple)) else val(a) for a in args]
    flat = [v for v in vals if isinstance(v, torch.Tensor)] + \
        [t for v in vals if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
    mode = detect_fake_mode(flat)
    with mode:
        node.meta["val"] = fn(*vals)


def _split_one(graph: fx.Graph, node: fx.Node, k: int, names: dict, src: str) -> list[fx.Node]:
    """Rewrite ``node`` into k output-feature blocks and a cat; returns the new nodes."""
    if node.target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        out_dim, w_dim = w.meta["val"].shape[0], 0
    elif node.target is aten.addmm.default:
        bias, x, w = node.args[0], node.args[1], node.args[2]
        out_dim, w_dim = w.meta["val"].shape[1], 1
    else:  # aten.mm
        x, w = node.args[0], node.args[1]
        bias, out_dim, w_dim = None, w.meta["val"].shape[1], 1
    new: list[fx.Node] = []
    parts = []
    with graph.inserting_before(node):
        for i, (a, b) in enumerate(_blocks(out_dim, k)):
            wi = graph.call_function(aten.slice.Tensor, (w, w_dim, a, b))
            _fake(wi, aten.slice.Tensor, w, w_dim, a, b)
            bi = None
            if isinstance(bias, fx.Node):
                bdim = bias.meta["val"].dim() - 1
                bi = graph.call_function(aten.slice.Tensor, (bias, bdim, a, b))
                _fake(bi, aten.slice.Tensor, bias, bdim, a, b)
            if node.target is aten.linear.default:
                args = (x, wi, bi) if bi is not None else (x, wi)
            elif node.target is aten.addmm.default:
                args = (bi if bi is not None else bias, x, wi)
            else:
                args = (x, wi)
            yi = graph.call_function(node.target, args, dict(node.kwargs))
            _fake(yi, node.target, *args)
            names[yi.name] = f"{src}[{i}/{k}]"
            for n in (wi, bi, yi):
                if n is not None:
                    names.setdefault(n.name, f"{src}[{i}/{k}]")
                    new.append(n)
            parts.append(yi)
        cat = graph.call_function(aten.cat.default, (parts, -1))
        _fake(cat, lambda ps, d: aten.cat.default(ps, d), parts, -1)
        names[cat.name] = src
        new.append(cat)
    for key in ("fxpipe_tp_replicated",):
        if key in node.meta:
            cat.meta[key] = node.meta[key]
    node.replace_all_uses_with(cat)
    graph.erase_node(node)
    return new


def split_matmul_pass(program: Program, num_stages: int) -> Program:
    """Cut every matmul heavier than 1/(2·num_stages) of the model's matmul FLOPs into
    output-feature blocks (module docstring). Needs the cost pass's annotations and
    returns them for the rewritten graph."""
    if num_stages < 2 or not program.costs:
        return program
    costs = program.costs
    total = sum(c.fwd_flops + c.bwd_flops for c in costs.values())
    if total <= 0:
        return program
    heavy = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.linear.default, aten.addmm.default,
                                                             aten.mm.default):
            continue
        c = costs.get(node.name)
        share = (c.fwd_flops + c.bwd_flops) / total if c is not None else 0.0
        if share > 1 / (2 * num_stages):
            heavy.append((node.name, min(MAX_BLOCKS, math.ceil(share * 2 * num_stages))))
    if not heavy:
        return program
    gm = copy.deepcopy(program.graph_module)
    by_name = {n.name: n for n in gm.graph.nodes}
    paths, layers = dict(program.module_paths), dict(program.layers)
    for name, k in heavy:
        node = by_name[name]
        out = node.meta["val"].shape[-1]
        k = min(k, out)
        if k < 2:
            continue
        src = paths.get(name) or name
        names: dict[str, str] = {}
        new = _split_one(gm.graph, node, k, names, src)
        for n in new:
            paths[n.name] = names.get(n.name, src)
            if name in layers:
                layers[n.name] = layers[name]
        paths.pop(name, None)
        layers.pop(name, None)
    gm.graph.lint()
    gm.recompile()
    return cost_pass(program.replace(graph_module=gm, module_paths=paths, layers=layers, costs={}))
