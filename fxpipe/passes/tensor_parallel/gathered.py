"""Projections whose output a norm reads whole: rows split, output all-gathered.

A projection that writes the residual stream outside any Megatron block (ELECTRA's
and RemBERT's embedding projection, a BERT head's transform before its LayerNorm)
has no row-parallel partner: the norm after it mixes all its output channels, so
they stay replicated. Rather than every rank holding the whole weight, each rank
computes a block of the output channels and an all-gather makes them whole:
Megatron's ``ColumnParallelLinear(gather_output=True)`` (Shoeybi et al. 2019 §3).
The all-gather's backward keeps the rank's block of the (replicated, hence whole)
output gradient, so each rank's rows get their whole gradient; the input gradient
is a per-rank share, summed by the f in front of the projection like any
column-parallel input's. The output is replicated, so nothing downstream changes.
The all-gather is the price of the memory: one per such projection.
"""
from __future__ import annotations

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.assign import ALL, Assignment
from fxpipe.passes.tensor_parallel.graph_ops import Projection
from fxpipe.passes.tensor_parallel.provenance import Provenance


def gathered_projections(graph: fx.Graph, prov: Provenance, asg: Assignment,
                         projections: dict[str, Projection], weights_2d: set[str], tp: int,
                         refused: list[tuple[np.ndarray, str]]) -> frozenset[str]:
    """Replicated projections with a replicated input whose every output channel class
    a LayerNorm/RMSNorm mixes, and nothing else does (a router's logits, mixed by a
    softmax, stay whole as Megatron keeps them; so do latents normed by a written-out
    mean); ``refused``: (ids, reason) of layout checks that failed in earlier rounds (a
    projection among them stays replicated)."""
    normed = np.zeros(len(asg.class_rank), dtype=bool)
    mixed = np.zeros(len(asg.class_rank), dtype=bool)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        norm = node.target in G.NORMS
        if not (norm or node.target in G.REDUCTIONS or node.target in G.BATCHED_MATMULS
                or node.target is G.EINSUM):
            continue
        for a in (node.args[0],) if norm else node.all_input_nodes:
            ids = prov.ids.get(a.name)
            if isinstance(ids, np.ndarray):
                (normed if norm else mixed)[asg.labels[ids.ravel()]] = True
    normed &= ~mixed
    failed = np.unique(np.concatenate([ids for ids, _ in refused] or [np.zeros(0, dtype=np.int64)]))
    nodes = {n.name: n for n in graph.nodes}
    out = set()
    for name, proj in projections.items():
        first, count = prov.sources[name]
        ids = np.arange(first, first + count)
        if (count % tp or proj.weight not in weights_2d or name in asg.rows
                or (asg.owner(ids) != ALL).any() or not normed[asg.labels[ids]].all()
                or np.isin(ids, failed).any()):
            continue
        x = prov.ids.get(nodes[name].args[proj.input_arg].name)
        if isinstance(x, np.ndarray) and (asg.owner(x.ravel()) != ALL).any():
            continue  # reads split channels: not a replicated input
        out.add(name)
    return frozenset(out)
