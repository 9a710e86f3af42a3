"""Parameters split with the channels they are applied to.

A parameter read outside a projection — a depthwise convolution's kernel, Mamba's
A_log and D, a dt bias, a gated norm's weight over split channels — reaches its
sharded consumer replicated, and each rank takes its part of it there (scatter:
its own block forward, the all-gather of the gradient backward). When every read
of the parameter, through ops that keep that dim (casts, exp/neg, squeeze,
unsqueeze, transposes), takes the same indices of one of its dims, the parameter
itself is split there instead: each rank holds only those indices, the scatters
go, and its gradient is its part's (DTensor's ``Shard`` of a parameter read by a
sharded op). The indices need not be a block: the channels of fused q|k|v rows
convolved together are each rank's heads of each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch.fx as fx

from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.graph_ops import norm_dim, shape
from fxpipe.passes.tensor_parallel.layout import Layout


@dataclass(frozen=True)
class Narrowing:
    """A replicated operand whose consumer holds, per rank, ``positions`` of its ``dim``."""
    consumer: str
    operand: str
    dim: int
    positions: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class ParamShard:
    dim: int
    positions: tuple[np.ndarray, ...]
    """Per rank, the indices along ``dim`` it holds (disjoint, covering the dim)."""
    consumers: tuple[str, ...]


def _dim_map(node: fx.Node) -> list[int | None] | None:
    """For a chain op, the input dim each output dim comes from (None: a new size-1 dim);
    None when the op is not one a parameter may be split through."""
    t, x = node.target, node.args[0] if node.args else None
    tensors = [a for a in node.all_input_nodes if isinstance(G.val(a), G.torch.Tensor)]
    if len(tensors) != 1 or tensors[0] is not x or not isinstance(G.val(node), G.torch.Tensor):
        return None  # (a higher-order op's region, a multi-output op: not a chain op)
    nin, nout = len(shape(x)), len(shape(node))
    if t in G.TRANSPOSES:
        if t is G.aten.permute.default:
            return [norm_dim(d, nin) for d in node.args[1]]
        perm = list(range(nin))
        if t in (G.aten.t.default, G.aten.numpy_T.default):
            return perm[::-1]
        d0, d1 = norm_dim(node.args[1], nin), norm_dim(node.args[2], nin)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if t is G.aten.unsqueeze.default:
        d = norm_dim(node.args[1], nout)
        return [None if i == d else (i if i < d else i - 1) for i in range(nout)]
    if t in G.SQUEEZES:
        kept = [i for i, s in enumerate(shape(x)) if s != 1 or i not in _squeezed(node, nin)]
        return kept if len(kept) == nout else None
    if G.is_pointwise(t) and shape(node) == shape(x):
        return list(range(nout))
    return None


def _squeezed(node: fx.Node, nin: int) -> set[int]:
    if node.target is G.aten.squeeze.default:
        return set(range(nin))
    dims = node.args[1] if node.target is G.aten.squeeze.dims else [node.args[1]]
    return {norm_dim(d, nin) for d in dims}


def sink(plan, graph: fx.Graph, params: set[str], fail: Callable[[Narrowing], None]) -> None:
    """Split every parameter of ``params`` (placeholders) all of whose reads narrow it
    alike (plan.conversions' scatters, plan.pending); drop those narrowings. A pending
    narrowing left over (positions that are not each rank's block, from an operand that
    is not such a parameter) is a layout failure: ``fail`` raises it."""
    tp = plan.tp
    requests: dict[tuple[str, str], Narrowing] = {}
    for (consumer, producer), convs in plan.conversions.items():
        if len(convs) == 1 and convs[0].kind is CollectiveKind.SCATTER:
            # block r of the dim, or of each of ``outer`` equal parts of it (a strided block)
            outer = convs[0].outer
            inner = plan.layouts[producer].full[convs[0].dim] // outer
            size = inner // tp
            requests[(consumer, producer)] = Narrowing(consumer, producer, convs[0].dim, tuple(
                np.concatenate([o * inner + np.arange(r * size, (r + 1) * size) for o in range(outer)])
                for r in range(tp)))
    for n in plan.pending:
        requests[(n.consumer, n.operand)] = n
    nodes = {n.name: n for n in graph.nodes}
    done: set[tuple[str, str]] = set()
    for name in params:
        found = _chain(nodes[name], requests, plan)
        if found is None:
            continue
        dims, uses = found
        wanted = {(dims[u.operand][u.dim], tuple(map(tuple, u.positions))) for u in uses}
        if len(wanted) != 1:
            continue
        pdim, positions = next(iter(wanted))
        held = np.concatenate([np.asarray(p, dtype=np.int64) for p in positions])
        if len(set(held.tolist())) != len(held) or len(held) != shape(nodes[name])[pdim]:
            continue  # indices on several ranks would get partial gradients: keep the scatter
        arrays = tuple(np.asarray(p, dtype=np.int64) for p in positions)
        blocks = all(np.array_equal(a, np.arange(r * len(a), (r + 1) * len(a))) for r, a in enumerate(arrays))
        for node, back in dims.items():
            d = back.index(pdim)
            full = plan.layouts[node].full
            local = tuple(len(arrays[0]) if i == d else s for i, s in enumerate(full))
            plan.layouts[node] = Layout(local, full, (d,), frozenset({d}) if blocks else frozenset(), (arrays,))
        for u in uses:
            plan.conversions.pop((u.consumer, u.operand), None)
            done.add((u.consumer, u.operand))
        plan.param_shards[name] = ParamShard(pdim, arrays, tuple(u.consumer for u in uses))
    for n in plan.pending:
        if (n.consumer, n.operand) not in done:
            fail(n)


def _chain(param: fx.Node, requests: dict, plan) -> tuple[dict[str, list[int]], list[Narrowing]] | None:
    """The nodes computed from ``param`` by chain ops (each: its dims -> the parameter's)
    and the narrowings that end them; None when some read is neither."""
    dims = {param.name: list(range(len(shape(param))))}
    uses, stack = [], [param]
    while stack:
        node = stack.pop()
        for user in node.users:
            if (user.name, node.name) in requests:
                uses.append(requests[(user.name, node.name)])
                continue
            m = _dim_map(user) if user.op == "call_function" else None
            lay = plan.layouts.get(user.name)
            if m is None or lay is None or isinstance(lay, list) or lay.is_sharded or user.name in dims:
                return None
            dims[user.name] = [None if i is None else dims[node.name][i] for i in m]
            stack.append(user)
    return (dims, uses) if uses else None
