"""Sequence parallelism (Korthikanti et al. 2022, §4.2.2) on top of a TP plan.

Between TP blocks the activations are replicated; with sp they are split along
the sequence instead, so norms, dropout and residual adds run on s/t tokens.
Megatron's g becomes a reduce-scatter along the sequence (the partial sums are
summed and split in one collective) and f becomes an all-gather (whose backward
is a reduce-scatter). What the pass does, node by node after each reduction:

- a position-wise op (element-wise, dropout, a norm or reduction over other
  dims, a view keeping the leading dims) of a sequence shard is a sequence shard;
  a replicated operand of it is narrowed to the shard (SCATTER) if it varies
  along the sequence (position embeddings), and otherwise, if it has a gradient,
  passes through f: its gradient is a per-shard sum, all-reduced over the TP
  group in backward (norm weights, row-parallel biases);
- a column-parallel input gets GATHER_SEQ instead of f;
- any other consumer gets GATHER (all-gather forward, own chunk backward).

The sequence dim is the one before the hidden dim of the reduced tensor
((B, T, h) -> 1). Any token dim would be correct (every op in the shard region
is position-wise); this one matches Megatron's split of the sequence.
"""
from __future__ import annotations

import torch.fx as fx

from fxpipe.ir.program import Program
from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.graph_ops import arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.layout import is_sharded
from fxpipe.passes.tensor_parallel.plan_record import Conversion, TPPlan

K = CollectiveKind


def plan_sequence_parallel(program: Program, plan: TPPlan, grad: set[str]
                           ) -> tuple[dict[str, Conversion], int | None]:
    """Fill ``plan`` with the sequence-parallel conversions; return the reduction
    after every partial-sum sink and the sequence dim (None if nothing was split)."""
    tp = plan.tp
    seq: dict[str, int] = {}  # node -> its sequence dim, for values held as sequence shards
    reduce_kind: dict[str, Conversion] = {}
    nodes = {n.name: n for n in program.graph.nodes}
    for sink, site in plan.partial.items():
        node_shape = shape(nodes[sink])
        if len(node_shape) < 3:  # a flattened (tokens, h) value has no sequence dim to split
            reduce_kind[sink] = Conversion(K.G)
            continue
        dim = len(node_shape) - 2
        if node_shape[dim] % tp:
            raise ValueError(
                f"sequence parallelism: {program.module_paths.get(site.source) or site.source} "
                f"produces {node_shape}, whose sequence length {node_shape[dim]} (dim {dim}) is not "
                f"divisible by tp={tp}; use a sequence length that is a multiple of {tp} or sp=False")
        reduce_kind[sink] = Conversion(K.REDUCE_SCATTER_SEQ, dim)
        seq[sink] = dim
        if site.bias is not None and site.bias in grad:
            plan.conversions[(sink, site.bias)] = [Conversion(K.F)]
    column_inputs: dict[str, set[str]] = {}
    for consumer, producer in plan.column_inputs:
        column_inputs.setdefault(consumer, set()).add(producer)
    for node in program.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        into_column = column_inputs.get(node.name, set())
        for producer in into_column - seq.keys():  # replicated input: Megatron's f, as without sp
            if producer in grad:
                plan.conversions[(node.name, producer)] = [Conversion(K.F)]
        inputs = [a for a in node.all_input_nodes if a.name in seq]
        if not inputs:
            continue
        if (node.op == "call_function" and not into_column and not is_sharded(plan.layouts.get(node.name))
                and node.name not in plan.column and node.name not in plan.partial):
            dim = _position_wise(node, {a.name: seq[a.name] for a in inputs})
            if dim is not None:
                _enter(plan, node, dim, seq, grad)
                continue
        for a in inputs:  # leave the sequence shards
            if a.name in into_column:
                plan.conversions[(node.name, a.name)] = [Conversion(K.GATHER_SEQ, seq[a.name])]
            else:
                rest = plan.conversions.get((node.name, a.name), [])
                plan.conversions[(node.name, a.name)] = [Conversion(K.GATHER, seq[a.name]), *rest]
    return reduce_kind, next(iter(seq.values()), None)


def _enter(plan: TPPlan, node: fx.Node, dim: int, seq: dict[str, int], grad: set[str]) -> None:
    """``node`` runs on sequence shards: narrow or f its replicated operands, fix its constants."""
    seq[node.name] = dim
    nd = len(shape(node))
    for a in node.all_input_nodes:
        if a.name in seq or not isinstance(G.val(a), G.torch.Tensor):
            continue
        ad = dim - (nd - len(shape(a)))
        if ad >= 0 and shape(a)[ad] > 1:
            plan.conversions[(node.name, a.name)] = [Conversion(K.SCATTER, ad)]
        elif a.name in grad:
            plan.conversions[(node.name, a.name)] = [Conversion(K.F)]
    if node.target is G.DROPOUT:
        plan.sharded_dropout.add(node.name)
    if node.target in G.VIEWS and node.target is not G.aten.alias.default:
        sizes = list(node.args[1])
        if sizes[dim] != -1:
            sizes[dim] //= plan.tp
        plan.new_args[node.name] = (node.args[0], sizes)


def _position_wise(node: fx.Node, seq_in: dict[str, int]) -> int | None:
    """The sequence dim of ``node``'s output if it acts on each position alone, else None."""
    t = node.target
    out = shape(node) if isinstance(G.val(node), G.torch.Tensor) else None
    if out is None:
        return None
    x = node.args[0] if node.args else None
    if t in G.NORMS:
        s = seq_in.get(x.name)
        return s if s is not None and s < len(out) - len(node.args[1]) else None
    if t in G.REDUCTIONS:
        s = seq_in.get(x.name)
        nd = len(shape(x))
        d = arg(node, G.REDUCTIONS[t][0], "dim")
        if s is None or d is None or d == []:
            return None
        dims = {norm_dim(i, nd) for i in (d if isinstance(d, (list, tuple)) else [d])}
        if s in dims:
            return None
        keep = G.REDUCTIONS[t][1] is None or arg(node, G.REDUCTIONS[t][1], "keepdim", False)
        return s if keep else s - sum(1 for i in dims if i < s)
    if t in G.VIEWS:
        s = seq_in.get(x.name)
        return s if s is not None and shape(x)[:s + 1] == out[:s + 1] else None
    if G.is_pointwise(t):
        dims = {s + len(out) - len(shape(a)) for a in node.all_input_nodes if a.name in seq_in
                for s in [seq_in[a.name]]}
        return dims.pop() if len(dims) == 1 else None
    return None
