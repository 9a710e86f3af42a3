"""Channel rules for the mixers of state-space, linear-attention and short-convolution
layers (Mamba-1/2, gated delta nets, short convolutions): depthwise ``conv1d``, scans
and triangular masks along the sequence (``cumsum``, ``tril``), key heads repeated to
value heads (``repeat_interleave``), rows of a recurrence written in place
(``select_scatter``), a recurrence's matrix products whose rows are channels, and
values broadcast against channels they do not carry (``combine``).

Each rule has a provenance half (``*_ids``, ``combine``), called from provenance.py,
and a plan half (``*_rule``, ``narrow``), called from node_layouts.py. DTensor shards
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
            shapes: list[tuple[int, ...]] | None = None) -> np.ndarray:
    """Ids of an element-wise op's output from its operands' (aligned to one rank;
    ``shapes``: the operands' sizes, aligned alike, when known).

    Operands whose channels vary along a common dim are united, element by element
    (SwiGLU's gate·up, head h of q with head h of k). An operand whose channels vary
    along none of the other's channel dims (a per-token value computed from a whole,
    replicated projection, such as Mamba's dt·B against its inner channels) is
    broadcast against them: its channels are not united with theirs but must stay
    whole on every rank (``Provenance.broadcast_whole``), as DTensor keeps a
    ``Replicate`` operand beside a ``Shard`` one. Of two such operands the one kept is
    the one of size 1 along the other's channels (the other is materialised along the
    kept one's channels: Mamba-2's B repeated to every head, times a per-head decay);
    else the one with more channels."""
    out, out_shape = arrays[0], shapes[0] if shapes else None
    for i, other in enumerate(arrays[1:], 1):
        va, vb = varying(out), varying(other)
        if va & vb or not (va or vb):
            prov.union(out, other)
            out = np.broadcast_arrays(out, other)[0]
            continue
        keep_out = len(np.unique(out)) >= len(np.unique(other))
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
    return out


def conv1d_ids(node: fx.Node, inputs: dict, unsupported: type[Exception]) -> np.ndarray | None:
    """A depthwise convolution (groups == in == out channels) keeps channels apart:
    output channel c reads input channel c only; the kernel and bias carry none."""
    x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
    if w.name in inputs or (isinstance(b, fx.Node) and b.name in inputs):
        raise unsupported("the convolution's kernel carries channels")
    if x.name not in inputs:
        return None
    xs, ws, groups = shape(x), shape(w), arg(node, 6, "groups", 1)
    if len(xs) != 3 or not (groups == xs[1] == ws[0] == shape(node)[1]) or ws[1] != 1:
        raise unsupported("a convolution that mixes channels (only a depthwise one keeps them apart)")
    ids = inputs[x.name].reshape((1,) * (3 - inputs[x.name].ndim) + inputs[x.name].shape)
    if ids.shape[0] > 1 or ids.shape[2] > 1:
        raise unsupported("channels vary along the batch or the convolved dim")
    return ids


def along_ids(prov: Any, node: fx.Node, inputs: dict, unsupported: type[Exception]) -> np.ndarray:
    """A scan or triangular mask along some dims: element-wise along the others; channels
    along a scanned dim are mixed (united, like a reduction's)."""
    x = node.args[0]
    if x.name not in inputs or len(inputs) > 1:
        raise unsupported("the scan's other arguments carry channels")
    nd = len(shape(node))
    ids = inputs[x.name].reshape((1,) * (nd - inputs[x.name].ndim) + inputs[x.name].shape)
    for d in ALONG[node.target](node, nd):
        if ids.shape[d] > 1:
            first = np.take(ids, [0], axis=d)
            prov.union(ids, first)
            prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
            ids = first
    return ids


def repeat_ids(node: fx.Node, inputs: dict, unsupported: type[Exception]) -> np.ndarray | None:
    """``repeat_interleave(x, r, dim)``: each index along ``dim`` repeated r times (key
    heads shared by r value heads of a gated delta net, as GQA's repeat_kv)."""
    x, dim = node.args[0], arg(node, 2, "dim")
    if x.name not in inputs:
        return None
    if dim is None:
        raise unsupported("repeat_interleave of the flattened tensor")
    nd = len(shape(node))
    ids = inputs[x.name].reshape((1,) * (nd - inputs[x.name].ndim) + inputs[x.name].shape)
    dim = norm_dim(dim, nd)
    return np.repeat(ids, node.args[1], axis=dim) if ids.shape[dim] > 1 else ids


def select_scatter_ids(prov: Any, node: fx.Node, inputs: dict) -> np.ndarray:
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


def narrow(plan: Any, consumer: fx.Node, a: fx.Node, lay: Any, dim_of: Callable[[int], int | None],
           grad: set[str], refuse: type[Exception]) -> None:
    """A replicated operand of a sharded consumer: ``dim_of(d)`` is the operand's dim that
    indexes the positions of the consumer's sharded dim d (None: it has none). Each rank
    takes its block there (scatter; the backward all-gathers), or, indexing none, the
    operand's gradient is a partial sum over the rank's part (f)."""
    from fxpipe.passes.tensor_parallel.attention_forms import strided_blocks
    from fxpipe.passes.tensor_parallel.node_layouts import Conversion, is_sharded
    from fxpipe.passes.tensor_parallel.param_shards import Narrowing
    from fxpipe.ir.tp_result import CollectiveKind

    al = plan.layouts.get(a.name)
    if al is None or is_sharded(al):
        return
    ash, scatter_dim, outer, pending = shape(a), None, 1, None
    for d in lay.sharded:
        ad = dim_of(d)
        if ad is None or ad < 0 or ash[ad] == 1:
            continue
        if ash[ad] == lay.full[d] and scatter_dim is None and pending is None:
            # a contiguous block, or heads merged with the batch (a strided block)
            found = (1, 0) if d in lay.blocks else None if lay.vocab else strided_blocks(
                lay.positions[lay.sharded.index(d)], lay.full[d])
            if found is not None:
                scatter_dim, outer = ad, found[0]
            else:  # not each rank's block: only a parameter split alike can give it (param_shards)
                pending = Narrowing(consumer.name, a.name, ad, tuple(lay.held(d, r) for r in range(plan.tp)))
            continue
        raise refuse(f"replicated input {a.name} cannot be narrowed to the shard")
    if pending is not None:
        if scatter_dim is not None:
            raise refuse(f"replicated input {a.name} cannot be narrowed to the shard")
        plan.pending.append(pending)
        return
    if scatter_dim is not None:
        plan.conversions[(consumer.name, a.name)] = [Conversion(CollectiveKind.SCATTER, scatter_dim, outer)]
    elif a.name in grad:
        plan.conversions[(consumer.name, a.name)] = [Conversion(CollectiveKind.F)]


def conv1d_rule(plan: Any, node: fx.Node, lay: Any, grad: set[str], refuse: type[Exception]) -> None:
    """Each rank convolves its own channels with its own rows of the kernel and bias;
    ``groups`` becomes the local channel count."""
    xl = plan.layouts[node.args[0].name]
    if xl.sharded != (1,) or lay.sharded != (1,):
        raise refuse("a depthwise conv1d split along another dim than its channels")
    args = [node.args[0], node.args[1], arg(node, 2, "bias"), arg(node, 3, "stride", [1]),
            arg(node, 4, "padding", [0]), arg(node, 5, "dilation", [1]), lay.shape[1]]
    plan.new_target[node.name] = CONV1D
    plan.new_args[node.name] = tuple(args)
    for a in args[1:3]:
        if isinstance(a, fx.Node):
            narrow(plan, node, a, lay, lambda d: 0 if d == 1 else None, grad, refuse)


def along_rule(plan: Any, node: fx.Node, lay: Any, grad: set[str], refuse: type[Exception]) -> None:
    x = plan.layouts[node.args[0].name]
    if set(ALONG[node.target](node, len(x.full))) & set(x.sharded):
        raise refuse("scans or masks along a sharded dim")


def matmul_rule(plan: Any, node: fx.Node, lay: Any, grad: set[str], refuse: type[Exception]) -> None:
    """x @ y split along batch dims (heads), rows of x or columns of y (a recurrence's
    state whose rows are channels, times a replicated vector), never the contracted
    dim: the same op on smaller operands. A replicated operand takes its block of a
    split dim it indexes (scatter), or gets f: its gradient sums over every rank's part."""
    from fxpipe.passes.tensor_parallel.node_layouts import is_sharded

    ix, iy, iadd = G.BATCHED_MATMULS[node.target]
    x, y = node.args[ix], node.args[iy]
    xl, yl = plan.layouts[x.name], plan.layouts[y.name]
    nd = len(lay.full)
    if len(xl.full) - 1 in xl.sharded or len(yl.full) - 2 in yl.sharded:
        raise refuse("a batched matmul split along its contracted dim")
    if (nd - 2 in lay.sharded) != (len(xl.full) - 2 in xl.sharded) or \
            (nd - 1 in lay.sharded) != (len(yl.full) - 1 in yl.sharded):
        raise refuse("a batched matmul whose output is split unlike its operands' rows and columns")
    for a, own in ((x, nd - 2), (y, nd - 1)):
        na = len(shape(a))

        def dim_of(d: int, na: int = na, own: int = own) -> int | None:
            if d >= nd - 2:
                return na - nd + d if d == own else None
            return d - (nd - na)

        al = plan.layouts[a.name]
        if is_sharded(al):
            if any(ad + nd - na not in lay.sharded for ad in al.sharded):
                raise refuse("a batched matmul's operands are split unlike its output")
            continue
        narrow(plan, node, a, lay, dim_of, grad, refuse)
    if iadd is not None:
        a = node.args[iadd]
        narrow(plan, node, a, lay, lambda d, na=len(shape(a)): d - (nd - na), grad, refuse)


def repeat_rule(plan: Any, node: fx.Node, lay: Any, grad: set[str], refuse: type[Exception]) -> None:
    """Along a sharded dim each rank repeats its own block (key heads r·k/t.. give value
    heads r·v/t..): the same op, its ``output_size`` the local one."""
    xl = plan.layouts[node.args[0].name]
    dim = norm_dim(arg(node, 2, "dim"), len(lay.full))
    if dim not in xl.sharded and dim not in lay.sharded:
        return
    if not (dim in xl.blocks and dim in lay.blocks and lay.shape[dim] == xl.shape[dim] * node.args[1]):
        raise refuse("repeats a sharded dim into another rank's part")
    if node.kwargs.get("output_size") is not None:
        plan.new_kwargs[node.name] = {**node.kwargs, "output_size": lay.shape[dim]}


def select_scatter_rule(plan: Any, node: fx.Node, lay: Any, grad: set[str], refuse: type[Exception]) -> None:
    dim = norm_dim(node.args[2], len(lay.full))
    if dim in lay.sharded:
        raise refuse("writes one index of a sharded dim")
    narrow(plan, node, node.args[0], lay, lambda d: d, grad, refuse)
    narrow(plan, node, node.args[1], lay, lambda d: None if d == dim else (d if d < dim else d - 1),
           grad, refuse)


def like_rule(plan: Any, node: fx.Node, refuse: type[Exception]) -> None:
    """zeros_like/ones_like/... of a sharded tensor: a constant. When every reader is
    sharded it takes the input's layout (the local op makes the local shape; each rank's
    part of a constant is that constant); else it is spelled with its full size
    (``new_zeros``...), replicated, and sharded readers take their part of it."""
    from fxpipe.passes.tensor_parallel.node_layouts import is_sharded

    xl = plan.layouts[node.args[0].name]
    if not isinstance(xl, list) and all(is_sharded(plan.layouts.get(u.name)) for u in node.users):
        plan.layouts[node.name] = xl
        return
    lay = plan.layouts[node.name]
    if is_sharded(lay) or min(lay.full) < 0:
        raise refuse("a tensor shaped like a shard of data-dependent size, read by replicated ops")
    target, extra = _FULL_SIZE[node.target]
    plan.new_target[node.name] = target
    plan.new_args[node.name] = (node.args[0], list(lay.full), *node.args[1:1 + extra])
    plan.new_kwargs[node.name] = {k: v for k, v in node.kwargs.items()
                                  if k in ("dtype", "layout", "device", "pin_memory")}


# *_like -> the new_* op of a given size (and how many arguments after the input it keeps).
_FULL_SIZE = {G.aten.zeros_like.default: (G.aten.new_zeros.default, 0),
              G.aten.ones_like.default: (G.aten.new_ones.default, 0),
              G.aten.empty_like.default: (G.aten.new_empty.default, 0),
              G.aten.full_like.default: (G.aten.new_full.default, 1)}
