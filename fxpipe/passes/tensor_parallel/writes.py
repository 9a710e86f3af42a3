"""Channel and layout rules for functionalized writes into a tensor: ``index_put`` (a
sliding-window mask written as ``att[:, :, mask] = -inf``) and ``select_scatter`` (a
recurrence writing one time step at a time, ``out[:, t] = y``, as RWKV's, into
``zeros_like`` of a split value).

Both leave the written tensor's other dims as they are, so the channels a tensor
carries on those dims pass through, as DTensor shards ``index_put`` and
``select_scatter`` along dims they do not index (torch/distributed/tensor/_ops/
_tensor_ops.py). Only writes along dims that carry no channel are covered; anything
else stays replicated and reported.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.fx as fx

from fxpipe.passes.tensor_parallel.graph_ops import norm_dim, shape
from fxpipe.passes.tensor_parallel.result import CollectiveKind

aten = torch.ops.aten
INDEX_PUT = aten.index_put.default
SELECT_SCATTER = aten.select_scatter.default
TARGETS = frozenset({INDEX_PUT, SELECT_SCATTER})
# The new tensor a write starts from, shaped like a split value (RWKV's
# ``zeros_like(key)``): it carries no channel, so it is spelled with its full sizes.
_NEW = {aten.zeros_like.default: aten.new_zeros.default, aten.ones_like.default: aten.new_ones.default,
        aten.full_like.default: aten.new_full.default}
LAYOUT_TARGETS = TARGETS | frozenset(_NEW)


def _indexed_dims(node: fx.Node) -> set[int]:
    """Dims of ``self`` that ``index_put``'s indices address (a bool mask covers as many
    dims as it has; an integer index one)."""
    dims, d = set(), 0
    for index in node.args[1]:
        width = 1 if index is None or index.meta["val"].dtype is not torch.bool else index.meta["val"].ndim
        if index is not None:
            dims |= set(range(d, d + width))
        d += width
    return dims


def _union_all(prov, arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0]
    for other in arrays[1:]:
        prov.union(out, other)
        out = np.broadcast_arrays(out, other)[0]
    return out


def ids(prov, node: fx.Node, inputs: dict) -> np.ndarray | None:
    """Provenance of the written tensor (``provenance._rule`` for ``TARGETS``)."""
    from fxpipe.passes.tensor_parallel import provenance as P  # it calls this module
    base, nd = node.args[0], len(shape(node))
    if node.target is INDEX_PUT:
        index, values = node.args[1], node.args[2]
        if any(isinstance(i, fx.Node) and i.name in inputs for i in index):
            raise P._Unsupported("indices that carry channels")
        if values.name in inputs:
            raise P._Unsupported("written values that carry channels")
        if base.name not in inputs:
            return None
        b = P._align(inputs[base.name], nd)
        if any(b.shape[d] > 1 for d in _indexed_dims(node)):
            raise P._Unsupported("writes along a dim that carries channels")
        return b
    src, dim = node.args[1], norm_dim(node.args[2], nd)
    parts = [P._align(inputs[base.name], nd)] if base.name in inputs else []
    if src.name in inputs:  # src lacks ``dim``: its channels go to every index along it
        parts.append(np.expand_dims(P._align(inputs[src.name], nd - 1), dim))
    if any(p.shape[dim] > 1 for p in parts):
        raise P._Unsupported("writes one index of a dim that carries channels")
    return _union_all(prov, parts) if parts else None


def layout(plan, node: fx.Node, lay, grad: set[str]) -> None:
    """Operands aligned to the written tensor's layout (``node_layouts._node_rule`` for
    ``TARGETS``)."""
    from fxpipe.passes.tensor_parallel import node_layouts as L  # it calls this module
    if node.target in _NEW:
        if L.is_sharded(lay) or min(lay.full) < 0 or node.kwargs.get("memory_format") is not None:
            raise L._Refuse(f"{node.target} of a sharded value")
        plan.new_target[node.name] = _NEW[node.target]
        plan.new_args[node.name] = (node.args[0], list(lay.full), *node.args[1:])
        return
    if node.target is INDEX_PUT:
        if _indexed_dims(node) & set(lay.sharded):
            raise L._Refuse("index_put along a sharded dim")
        values = node.args[2]
        if values.meta["val"].numel() != 1:
            raise L._Refuse("index_put of values that span the sharded dims")
        for a in (node.args[0], values):
            L._operand(plan, node, a, lay, grad)
        return
    dim = norm_dim(node.args[2], len(lay.full))
    if dim in lay.sharded:
        raise L._Refuse("select_scatter along a sharded dim")
    L._operand(plan, node, node.args[0], lay, grad)
    src = node.args[1]
    if L.is_sharded(plan.layouts[src.name]):
        return
    # A replicated src on the written tensor's dims but ``dim``: each rank writes its part.
    ssh, scatter = shape(src), None
    for d in lay.sharded:
        sd = d if d < dim else d - 1
        if ssh[sd] == 1:
            continue
        if ssh[sd] != lay.full[d] or d not in lay.blocks or scatter is not None:
            raise L._Refuse(f"replicated input {src.name} cannot be narrowed to the shard")
        scatter = sd
    if scatter is not None:
        plan.conversions[(node.name, src.name)] = [L.Conversion(CollectiveKind.SCATTER, scatter)]
    elif src.name in grad:
        plan.conversions[(node.name, src.name)] = [L.Conversion(CollectiveKind.F)]
