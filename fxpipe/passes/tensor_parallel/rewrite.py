"""Rewrite the graph from a TP plan: the same graph on every rank (SPMD).

Nodes are copied in order under their own names, with constants rewritten for
the local shard; conversion ops are inserted on the edges the plan names (one
per producer and kind, shared by its consumers: one f per block input, as in
Megatron); row-parallel projections lose their bias, which is added after the
reduction; vocabulary lookups, the loss and dropout become their TP ops. Shapes
(``meta["val"]``) are propagated again afterwards (``shapes.py``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.ir.program import Program
from fxpipe.ir.tp_result import CollectiveKind, CollectiveSite
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.graph_ops import arg
from fxpipe.passes.tensor_parallel.layout import is_sharded
from fxpipe.passes.tensor_parallel.plan_record import Conversion, TPPlan
from fxpipe.passes.tensor_parallel.regions import MODE, close_regions, refresh as refresh_regions
from fxpipe.passes.tensor_parallel.shapes import refresh_shapes
from fxpipe.tp.ops import OPS

_OP = {
    CollectiveKind.F: OPS.copy_to_tp.default,
    CollectiveKind.G: OPS.reduce_from_tp.default,
    CollectiveKind.GATHER_SEQ: OPS.gather_seq.default,
    CollectiveKind.REDUCE_SCATTER_SEQ: OPS.reduce_scatter_seq.default,
    CollectiveKind.SCATTER: OPS.scatter.default,
    CollectiveKind.GATHER: OPS.gather.default,
}


@dataclass(frozen=True)
class Rewritten:
    graph_module: fx.GraphModule
    sites: list[CollectiveSite]
    module_paths: dict[str, str]
    """Annotations of the old nodes, plus the inserted ones (layer of the block served)."""
    layers: dict[str, int]


REPLICATED = "fxpipe_tp_replicated"
"""Node meta key: True when the value *and its gradient* are identical on every TP
rank, so scatter-gather may send 1/t of either between pipeline stages (SC21 §4.1).
The outputs of f and of the sequence all-gather hold replicated values but feed
column-parallel ops, whose gradients are per-rank partial sums: not eligible."""
_REPLICATING = frozenset({CollectiveKind.G, CollectiveKind.GATHER})
PARTIAL_GRAD = "fxpipe_tp_partial_grad"
"""Node meta key: the output of f (or of the SP gather) and the replicated-layout values
computed from it on the way to the column-parallel op (an ``alias`` export puts there):
identical values, per-rank partial gradients, so never ``REPLICATED`` (a pipeline cut just
before an LM head sent such a view as 1/t chunks and lost the other ranks' share of its
gradient)."""
_UNINITIALISED = frozenset({G.aten.new_empty.default, G.aten.empty_like.default,
                            G.aten.empty.memory_format})


class _Builder:
    def __init__(self, program: Program, plan: TPPlan, reduce_kind: dict[str, Conversion],
                 sharded_params: set[str] = frozenset()) -> None:
        self.program, self.plan, self.reduce_kind = program, plan, reduce_kind
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.after_f: set[str] = set()
        self.shard_views: set[str] = set(sharded_params)
        self.sites: list[CollectiveSite] = []
        self.paths = dict(program.module_paths)
        self.nodes = {n.name: n for n in program.graph.nodes}
        self.modes = {n.name: n.meta[MODE] for n in program.graph.nodes if MODE in n.meta}
        self.layers = dict(program.layers)
        # Under sequence parallelism the "replicated" regions of the plan hold sequence
        # shards, so no copied value is identical across TP ranks.
        self.sequence_parallel = any(c.kind is CollectiveKind.REDUCE_SCATTER_SEQ for c in reduce_kind.values())

    def note(self, new: fx.Node, like: str, kind: CollectiveKind | None = None, purpose: str = "",
             dim: int | None = None) -> None:
        self.paths[new.name] = self.program.module_paths.get(like, "")
        if like in self.modes:  # an op added for one inside an autocast block runs in it too
            new.meta[MODE] = self.modes[like]
        layer = self.program.layers.get(like)
        if layer is not None:
            self.layers[new.name] = layer
        if kind is not None:
            self.sites.append(CollectiveSite(new.name, kind, layer, purpose, dim))

    def collective(self, value: fx.Node, conv: Conversion, producer: str, consumer: str,
                   purpose: str | None = None) -> fx.Node:
        if conv.outer > 1:  # heads merged with the batch: keep block r of each batch row
            value = self.graph.create_node("call_function", G.aten.unflatten.int,
                                           (value, conv.dim, [conv.outer, -1]), name=f"tp_rows_{producer}")
            self.note(value, consumer)
        args = (value,) if conv.dim is None else (value, conv.dim + (conv.outer > 1), self.plan.tp)
        node = self.graph.create_node("call_function", _OP[conv.kind], args,
                                      name=f"tp_{conv.kind.value}_{producer}")
        # A collective belongs to the layer of the block it serves: its consumer for
        # ops entering a block, its producer for reductions leaving one.
        entering = conv.kind in (CollectiveKind.F, CollectiveKind.GATHER_SEQ, CollectiveKind.SCATTER,
                                 CollectiveKind.GATHER)
        where = self.program.module_paths.get(consumer) or consumer
        self.note(node, consumer if entering else producer, conv.kind,
                  purpose or f"{producer} -> {where}", conv.dim)
        node.meta[REPLICATED] = conv.kind in _REPLICATING
        node.meta[PARTIAL_GRAD] = conv.kind in (CollectiveKind.F, CollectiveKind.GATHER_SEQ)
        if conv.outer > 1:
            node = self.graph.create_node("call_function", G.aten.flatten.using_ints,
                                          (node, conv.dim, conv.dim + 1), name=f"tp_merged_{producer}")
            self.note(node, consumer)
        return node

    def convert(self, producer: fx.Node, consumer: fx.Node) -> fx.Node:
        value = self.env[producer.name]
        convs = self.plan.conversions.get((consumer.name, producer.name), [])
        for i in range(len(convs)):
            key = (producer.name, tuple(convs[:i + 1]))
            if key not in self.cache:
                self.cache[key] = self.collective(value, convs[i], producer.name, consumer.name)
            value = self.cache[key]
        return value

    def map(self, args: Any, consumer: fx.Node) -> Any:
        return fx.node.map_arg(args, lambda a: self.convert(a, consumer))

    def copy(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            new = self.graph.placeholder(node.name)
        elif node.op == "get_attr":
            new = self.graph.get_attr(node.target)
        elif node.op == "output":
            new = self.graph.output(self.map(node.args[0], node))
        else:
            target, args, kwargs = self.call(node)
            new = self.graph.create_node("call_function", target, self.map(args, node),
                                         self.map(kwargs, node), name=node.name)
        new.meta = copy.copy(node.meta)
        lay = self.plan.layouts.get(node.name)
        # A view between an f and the column-parallel op it serves (f hoisted above the
        # views, plan.hoist) holds a replicated value whose gradient is partial.
        after_f = any(a.target is _OP[CollectiveKind.F] or a.name in self.after_f
                      for a in new.all_input_nodes)
        if after_f and node.op == "call_function" and node.target in G.VIEWS:
            self.after_f.add(new.name)
        # A view of a sharded weight (a stacked expert weight transposed) holds each rank's
        # shard, whatever its channel layout says; so does an uninitialised tensor.
        local = node.name in self.shard_views or node.target in _UNINITIALISED or any(
            a.name in self.shard_views for a in new.all_input_nodes)
        if local and node.op == "call_function" and (node.target in G.TRANSPOSES or
                                                     node.target in G.VIEWS or node.target is G.SELECT):
            self.shard_views.add(new.name)
        # Identical on every TP rank, value and gradient: a replicated layout that is not
        # a partial sum (nor a statistic before its all-reduce), not after an f.
        replicated = lay is not None and not isinstance(lay, list) and not is_sharded(lay) and \
            node.name not in self.plan.partial
        new.meta[PARTIAL_GRAD] = replicated and any(a.meta.get(PARTIAL_GRAD) for a in new.all_input_nodes)
        new.meta[REPLICATED] = replicated and not new.meta[PARTIAL_GRAD] and \
            node.name not in self.plan.statistics and not after_f and not local and \
            not self.sequence_parallel
        self.env[node.name] = new
        if node.name in self.plan.shared_columns:
            new.meta[REPLICATED] = False  # each rank's block until the all-gather after it
            self.gather_shared(node)
        if node.name in self.plan.partial:
            self.reduce(node)
        if node.name in self.plan.statistics:
            self.reduce_statistic(node)

    def call(self, node: fx.Node) -> tuple[Any, tuple, dict]:
        name, plan = node.name, self.plan
        target = plan.new_target.get(name, node.target)
        args, kwargs = plan.new_args.get(name, node.args), dict(plan.new_kwargs.get(name, node.kwargs))
        if name in plan.row:  # Shoeybi et al. §3: the bias is added once, after the reduction
            if node.target is G.ADDMM:
                return G.MM, (args[1], args[2]), {}
            if node.target is G.LINEAR:
                return G.LINEAR, tuple(args[:2]), {}
            return target, args, kwargs
        if name in plan.vocab_embedding:
            return OPS.vocab_parallel_embedding.default, (args[0], args[1], arg(node, 2, "padding_idx", -1)), {}
        if name in plan.vocab_ce:
            return OPS.vocab_parallel_cross_entropy.default, (
                args[0], args[1], plan.vocab_ce[name], arg(node, 4, "ignore_index", -100),
                arg(node, 3, "reduction", 1)), {}
        if node.target is G.DROPOUT and arg(node, 2, "train", False) and arg(node, 1, "p", 0.0) > 0:
            return OPS.dropout.default, (args[0], float(arg(node, 1, "p")), name in plan.sharded_dropout), {}
        return target, tuple(args), kwargs

    def gather_shared(self, node: fx.Node) -> None:
        """[before | this rank's block of the shared channels | after] -> [before | all
        of them | after]: the layout the plan gave the projection's output."""
        shared, value = self.plan.shared_columns[node.name], self.env[node.name]
        dim = len(G.shape(node)) - 1
        size = self.plan.layouts[node.name].shape[dim] - shared.total + shared.chunk  # computed here
        parts = []
        for a, b, block in ((0, shared.start, False), (shared.start, shared.start + shared.chunk, True),
                            (shared.start + shared.chunk, size, False)):
            if a == b:
                continue
            part = value
            if (a, b) != (0, size):
                part = self.graph.create_node("call_function", G.aten.slice.Tensor, (value, dim, a, b),
                                              name=f"tp_part_{node.name}")
                self.note(part, node.name)
            if block:
                part = self.collective(part, Conversion(CollectiveKind.GATHER, dim), node.name, node.name,
                                       f"channels every rank uses whole ({node.name})")
                part.meta[REPLICATED] = False  # conservative: never sent as 1/t chunks
            parts.append(part)
        if len(parts) > 1:
            joined = self.graph.create_node("call_function", G.aten.cat.default, (parts, dim),
                                            name=f"tp_joined_{node.name}")
            self.note(joined, node.name)
            parts = [joined]
        self.env[node.name] = parts[0]

    def reduce_statistic(self, node: fx.Node) -> None:
        """Each rank's share of a mean/sum over split channels, summed by g (forward
        all-reduce). Its readers on split channels get f from the plan, whose backward
        all-reduce sums their partial gradients, as DTensor's Partial -> Replicate."""
        value, scale = self.env[node.name], self.plan.statistics[node.name]
        if node.target is G.VECTOR_NORM:
            self.env[node.name] = self.norm_of_norms(node, value)
            return
        if scale != 1.0:
            value = self.graph.create_node("call_function", G.aten.mul.Tensor, (value, scale),
                                           name=f"tp_share_{node.name}")
            self.note(value, node.name)
        value = self.collective(value, Conversion(CollectiveKind.G), node.name, node.name,
                                f"statistic over split channels ({node.name})")
        self.env[node.name] = value

    def norm_of_norms(self, node: fx.Node, value: fx.Node) -> fx.Node:
        """A p-norm over split channels: the p-norm of every rank's p-norm, each rank
        computing it from all of them (gathered). Not an all-reduce of Σ|x|^p under a
        root: the root's gradient at 0 is ∞·0 = NaN, where autograd's norm gives 0;
        norms of norms keep that exact (the gather's backward keeps this rank's part,
        and the readers' f has summed their partial gradients before)."""
        dim = len(G.shape(node))
        part = self.graph.create_node("call_function", G.aten.unsqueeze.default, (value, dim),
                                      name=f"tp_part_{node.name}")
        self.note(part, node.name)
        parts = self.collective(part, Conversion(CollectiveKind.GATHER, dim), node.name, node.name,
                                f"norm over split channels ({node.name})")
        parts.meta[REPLICATED] = False  # conservative: never sent as 1/t chunks
        whole = self.graph.create_node("call_function", G.VECTOR_NORM,
                                       (parts, arg(node, 1, "ord", 2), [dim], False),
                                       name=f"tp_norm_{node.name}")
        self.note(whole, node.name)
        return whole

    def reduce(self, node: fx.Node) -> None:
        site = self.plan.partial[node.name]
        conv = self.reduce_kind[node.name]
        value = self.collective(self.env[node.name], conv, node.name, node.name,
                                f"after {self.program.module_paths.get(site.source) or site.source}")
        if site.bias is not None:
            bias = self.env[site.bias]
            bias_conv = self.plan.conversions.get((node.name, site.bias), [])
            for c in bias_conv:  # sequence parallel: the bias gradient is a per-shard sum
                bias = self.collective(bias, c, site.bias, node.name)
            replicated = value.meta.get(REPLICATED, False)
            dtype, bias_dtype = (getattr(G.val(n), "dtype", None) for n in (self.nodes[site.source],
                                                                            self.nodes[site.bias]))
            if dtype is not None and bias_dtype is not None and dtype != bias_dtype:
                # Under autocast the projection added its bias in its own (low) precision.
                bias = self.graph.create_node("call_function", G.aten.to.dtype, (bias, dtype),
                                              name=f"tp_bias_cast_{node.name}")
                self.note(bias, node.name)
            value = self.graph.create_node("call_function", G.aten.add.Tensor, (value, bias),
                                           name=f"tp_bias_{node.name}")
            value.meta[REPLICATED] = replicated
            self.note(value, node.name)
        self.env[node.name] = value


def rewrite(program: Program, plan: TPPlan, reduce_kind: dict[str, Conversion],
            local_params: dict[str, tuple[int, ...]]) -> Rewritten:
    """The rewritten GraphModule (with refreshed shapes) and its collective sites.

    ``reduce_kind``: sink node -> the reduction after it (g, or a reduce-scatter
    under sequence parallelism); ``local_params``: placeholder -> local shape."""
    sharded = {p.node for p in program.params if tuple(local_params.get(p.node, p.shape)) != tuple(p.shape)}
    b = _Builder(program, plan, reduce_kind, sharded)
    for node in program.graph.nodes:
        b.copy(node)
    for name in plan.vocab_ce:
        b.sites.append(CollectiveSite(name, CollectiveKind.VOCAB_CROSS_ENTROPY,
                                      program.layers.get(name), "vocab-parallel cross-entropy"))
    gm = fx.GraphModule(program.graph_module, b.graph)
    close_regions(gm, b.paths, b.layers)  # autocast blocks opened for the analysis (regions.py)
    refresh_shapes(gm, local_params, program.graph)
    refresh_regions(gm)
    return Rewritten(gm, b.sites, b.paths, b.layers)
