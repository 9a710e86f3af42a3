"""Channel and layout rules for ``index_put`` of a scalar at a mask (a sliding-window
mask written as ``att[:, :, mask] = -inf``).

The write leaves the tensor's other dims as they are, so the channels it carries on
those dims pass through, as DTensor shards ``index_put`` along dims it does not index
(torch/distributed/tensor/_ops/_tensor_ops.py). Only writes along dims that carry no
channel are covered; anything else stays replicated and reported. (A recurrence's
``select_scatter`` and the ``zeros_like`` it writes into are ``mixers``' rules.)
"""
from __future__ import annotations

import numpy as np
import torch
import torch.fx as fx

from fxpipe.passes.tensor_parallel.channel_ids import _align, _Unsupported
from fxpipe.passes.tensor_parallel.graph_ops import shape

aten = torch.ops.aten
INDEX_PUT = aten.index_put.default


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


def ids(prov, node: fx.Node, inputs: dict) -> np.ndarray | None:
    """Provenance of the written tensor (``provenance._rule`` for ``INDEX_PUT``)."""
    base, nd = node.args[0], len(shape(node))
    index, values = node.args[1], node.args[2]
    if any(isinstance(i, fx.Node) and i.name in inputs for i in index):
        raise _Unsupported("indices that carry channels")
    if values.name in inputs:
        raise _Unsupported("written values that carry channels")
    if base.name not in inputs:
        return None
    b = _align(inputs[base.name], nd)
    if any(b.shape[d] > 1 for d in _indexed_dims(node)):
        raise _Unsupported("writes along a dim that carries channels")
    return b


