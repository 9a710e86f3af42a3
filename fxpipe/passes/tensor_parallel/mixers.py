"""Channel rules for the mixers of state-space, linear-attention and short-convolution
layers (Mamba-1/2, gated delta nets, short convolutions): depthwise ``conv1d``, scans
and triangular masks along the sequence (``cumsum``, ``tril``), key heads repeated to
value heads (``repeat_interleave``), rows of a recurrence written in place
(``select_scatter``), a recurrence's matrix products whose rows are channels, and
values broadcast against channels they do not carry (``combine``).

Each rule has a provenance half (``*_ids``, ``combine``), called from provenance.py,
and a plan half (``*_rule``, ``narrow``) in plan_ops.py. DTensor shards
these ops alike (torch/distributed/tensor/_ops: a pointwise op with one ``Replicate``
operand keeps the other's ``Shard``; ``mm`` with ``Shard(0)`` x ``Replicate`` gives
``Shard(0)``; ``cumsum`` is sharded on any dim but the scanned one; a convolution with
``groups == channels`` is a per-channel op).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.channel_ids import Provenance, _Unsupported
from fxpipe.passes.tensor_parallel.graph_ops import arg, norm_dim, shape

CONV1D = G.aten.conv1d.default
REPEAT_INTERLEAVE = G.aten.repeat_interleave.self_int
SELECT_SCATTER = G.aten.select_scatter.default
# Ops that act independently on every index of all dims but the ones returned for
# (node, ndim): a scan or a triangular mask along them.
ALONG: dict[Any, Callable[[fx.Node, int], tuple[int, ...]]] = {
    G.aten.cumsum.default: lambda n, nd: (norm_dim(arg(n, 1, "dim"), nd),),
    G.aten.cumprod.default: lambda n, nd: (norm_dim(arg(n, 1, "dim"), nd),),
    G.aten.tril.default: lambda n, nd: (nd - 2, nd - 1),
    G.aten.triu.default: lambda n, nd: (nd - 2, nd - 1),
}


def varying(ids: np.ndarray) -> set[int]:
    """Dims along which the ids change (a channel dim of the tensor)."""
    return {d for d in range(ids.ndim) if ids.shape[d] > 1 and not (ids == np.take(ids, [0], axis=d)).all()}


def combine(prov: Any, arrays: list[np.ndarray], node: str,
            shapes: list[tuple[int, ...]] | None = None, numels: list[int] | None = None) -> np.ndarray:
    """Ids of an element-wise op's output from its operands' (aligned to one rank;
    ``shapes``: the operands' sizes, aligned alike, when known; ``numels``: for the
    operands of a product (einsum), how many elements each has).

    Operands whose channels vary along a common dim are united, element by element
    (SwiGLU's gate·up, head h of q with head h of k). An operand whose channels vary
    along none of the other's channel dims (a per-token value computed from a whole,
    replicated projection, such as Mamba's dt·B against its inner channels) is
    broadcast against them: its channels are not united with theirs but must stay
    whole on every rank (``Provenance.broadcast_whole``), as DTensor keeps a
    ``Replicate`` operand beside a ``Shard`` one. Of two such operands the one kept is
    the one of size 1 along the other's channels (the other is materialised along the
    kept one's channels: Mamba-2's B repeated to every head, times a per-head decay);
    else, of a product's operands, the larger one (the smaller is replicated: the one
    key/value head that multi-query attention's heads all read, DTensor's cheaper
    ``Replicate``); else the one with more channels."""
    out, out_shape = arrays[0], shapes[0] if shapes else None
    out_numel = numels[0] if numels else None
    for i, other in enumerate(arrays[1:], 1):
        va, vb = varying(out), varying(other)
        if va & vb or not (va or vb):
            prov.union(out, other)
            out = np.broadcast_arrays(out, other)[0]
            continue
        keep_out = len(np.unique(out)) >= len(np.unique(other))
        if numels and va and vb and out_numel != numels[i]:
            keep_out = out_numel > numels[i]
        if shapes and va and vb:
            a_thin = all(out_shape[d] == 1 for d in vb)
            b_thin = all(shapes[i][d] == 1 for d in va)
            if a_thin != b_thin:
                keep_out = a_thin
        if keep_out:
            prov.broadcast_whole.append((np.unique(other), node))
        else:
            prov.broadcast_whole.append((np.unique(out), node))
            out, out_shape = other, shapes[i] if shapes else None
            out_numel = numels[i] if numels else None
    return out


def conv1d_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    """A depthwise convolution (groups == in == out channels) keeps channels apart:
    output channel c reads input channel c only; the kernel and bias carry none."""
    x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
    if w.name in inputs or (isinstance(b, fx.Node) and b.name in inputs):
        raise _Unsupported("the convolution's kernel carries channels")
    if x.name not in inputs:
        return None
    xs, ws, groups = shape(x), shape(w), arg(node, 6, "groups", 1)
    if len(xs) != 3 or not (groups == xs[1] == ws[0] == shape(node)[1]) or ws[1] != 1:
        raise _Unsupported("a convolution that mixes channels (only a depthwise one keeps them apart)")
    ids = inputs[x.name].reshape((1,) * (3 - inputs[x.name].ndim) + inputs[x.name].shape)
    if ids.shape[0] > 1 or ids.shape[2] > 1:
        raise _Unsupported("channels vary along the batch or the convolved dim")
    return ids


def along_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """A scan or triangular mask along some dims: element-wise along the others; channels
    along a scanned dim are mixed (united, like a reduction's)."""
    x = node.args[0]
    if x.name not in inputs or len(inputs) > 1:
        raise _Unsupported("the scan's other arguments carry channels")
    nd = len(shape(node))
    ids = inputs[x.name].reshape((1,) * (nd - inputs[x.name].ndim) + inputs[x.name].shape)
    for d in ALONG[node.target](node, nd):
        if ids.shape[d] > 1:
            first = np.take(ids, [0], axis=d)
            prov.union(ids, first)
            prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
            ids = first
    return ids


def repeat_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    """``repeat_interleave(x, r, dim)``: each index along ``dim`` repeated r times (key
    heads shared by r value heads of a gated delta net, as GQA's repeat_kv)."""
    x, dim = node.args[0], arg(node, 2, "dim")
    if x.name not in inputs:
        return None
    if dim is None:
        raise _Unsupported("repeat_interleave of the flattened tensor")
    nd = len(shape(node))
    ids = inputs[x.name].reshape((1,) * (nd - inputs[x.name].ndim) + inputs[x.name].shape)
    dim = norm_dim(dim, nd)
    return np.repeat(ids, node.args[1], axis=dim) if ids.shape[dim] > 1 else ids


def select_scatter_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """``select_scatter(base, src, dim, i)``: base with index i along ``dim`` replaced by
    src (a functionalized in-place write: a recurrence filling its rows one by one).
    Positions keep their own channels; a part that carries none takes the other's."""
    base, src = node.args[:2]
    nd = len(shape(node))
    dim = norm_dim(node.args[2], nd)
    b = inputs.get(base.name)
    s = inputs.get(src.name)
    b = None if b is None else b.reshape((1,) * (nd - b.ndim) + b.shape)
    s = None if s is None else np.expand_dims(s.reshape((1,) * (nd - 1 - s.ndim) + s.shape), dim)
    if b is None or s is None or b.shape[dim] == 1:
        parts = [p for p in (b, s) if p is not None]
        return combine(prov, parts, node.name)
    out = np.array(np.broadcast_to(b, np.broadcast_shapes(b.shape, s.shape[:dim] + (b.shape[dim],) + s.shape[dim + 1:])))
    index = [slice(None)] * nd
    index[dim] = slice(norm_dim(node.args[3], shape(node)[dim]), norm_dim(node.args[3], shape(node)[dim]) + 1)
    out[tuple(index)] = np.broadcast_to(s, out[tuple(index)].shape)
    return out


# ---- the plan's half: local layouts, rewritten arguments, conversions -------------------


# *_like -> the new_* op of a given size (and how many arguments after the input it keeps).
_FULL_SIZE = {G.aten.zeros_like.default: (G.aten.new_zeros.default, 0),
              G.aten.ones_like.default: (G.aten.new_ones.default, 0),
              G.aten.empty_like.default: (G.aten.new_empty.default, 0),
              G.aten.full_like.default: (G.aten.new_full.default, 1)}
