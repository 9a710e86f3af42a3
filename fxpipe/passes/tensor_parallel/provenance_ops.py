"""Provenance rules for ops that move or reduce channels as a whole: slices and
scatters, indexing, reductions, broadcasts, matmuls, einsum, cat/stack and the
attention core (``provenance.RULES`` maps each op to its rule)."""
from __future__ import annotations

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G, mixers
from fxpipe.passes.tensor_parallel.attention_forms import constant_values
from fxpipe.passes.tensor_parallel.channel_ids import AttentionUse, Provenance, _align, _compact, _Unsupported
from fxpipe.passes.tensor_parallel.graph_ops import arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.norms import private_norm


def slice_scatter_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """base[..., start:end:step, ...] = src (a functionalized in-place write: MLA's key
    assembled in a new tensor). A part that carries no channels (the new tensor's
    unwritten positions, a replicated src) takes the ids of the other part's first
    index along ``dim``: it is held wherever that part's rows are, scattered there."""
    base, src = node.args[:2]
    nd = len(shape(node))
    dim = norm_dim(arg(node, 2, "dim", 0), nd)
    region = [slice(None)] * nd
    region[dim] = slice(arg(node, 3, "start"), arg(node, 4, "end"), arg(node, 5, "step", 1))
    b, s = (_align(inputs[a.name], nd) if a.name in inputs else None for a in (base, src))
    b = b if b is not None else np.take(s, [0], axis=dim)
    s = s if s is not None else np.take(b, [0], axis=dim)
    size = list(np.broadcast_shapes(*[tuple(1 if d == dim else n for d, n in enumerate(p.shape))
                                      for p in (b, s)]))
    if b.shape[dim] > 1 or s.shape[dim] > 1:
        size[dim] = shape(node)[dim]
    out = np.broadcast_to(b, size).copy()
    if s.shape[dim] > 1 or b.shape[dim] > 1:
        target = out[tuple(region)]
        out[tuple(region)] = np.broadcast_to(s, target.shape)
    else:
        prov.union(out, s)
    return out


def index_dim(node: fx.Node) -> int | None:
    """The dim of ``aten.index.Tensor`` indexed by its one index tensor (None: another form)."""
    indices = node.args[1]
    given = [i for i, t in enumerate(indices) if t is not None]
    return given[0] if len(given) == 1 else None


def index_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """x[..., idx, ...] with one index tensor along a dim that carries no channel: the
    output keeps x's channels on the other dims (DTensor shards them alike). Along a dim
    that carries channels, a constant index (Falcon's ``fused[..., [-2], :]``) picks
    rows: the output carries the picked rows' channels."""
    x, indices = node.args[0], node.args[1]
    p = index_dim(node)
    if p is None or x.name not in inputs or any(
            isinstance(i, fx.Node) and i.name in inputs for i in indices):
        raise _Unsupported("advanced indexing by values that carry channels or by several tensors")
    ids = _align(inputs[x.name], len(shape(x)))
    if ids.shape[p] > 1:
        picked = constant_values(indices[p], prov.constants)
        if picked is None:
            raise _Unsupported("indexes a dim that carries channels by values computed in the graph")
        n = shape(x)[p]
        if ((picked < -n) | (picked >= n)).any():
            raise _Unsupported("an index out of range")
        return _compact(np.take(ids, picked % n, axis=p))
    k = len(shape(indices[p]))
    return ids.reshape(ids.shape[:p] + (1,) * k + ids.shape[p + 1:])


def reduction_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """A reduction (or a norm, or softmax) mixes every channel along the dims it
    reduces: they are united, so the dims can only stay whole on one rank."""
    x = node.args[0]
    if len(inputs) > 1 or x.name not in inputs:
        raise _Unsupported("parameters of a reduction carry channels")
    ids = inputs[x.name]
    nd = ids.ndim
    if node.target in G.NORMS:
        dims = list(range(nd - len(node.args[1]), nd))
        keepdim = True
    else:
        dim_index, keep_index = G.REDUCTIONS[node.target]
        d = arg(node, dim_index, "dim")
        dims = list(range(nd)) if d is None or d == [] else [norm_dim(i, nd) for i in (
            d if isinstance(d, (list, tuple)) else [d])]
        keepdim = keep_index is None or bool(arg(node, keep_index, "keepdim", False))
    if G.is_statistic(node) and all(ids.shape[d] == 1 for d in range(nd) if d not in dims):
        prov.statistics[node.name] = np.unique(ids)
        if private_norm(node):
            prov.private.add(node.name)
        if node.name in prov.split_statistics:
            return None  # the all-reduced statistic is whole on every rank: it carries no channel
    for d in dims:
        if ids.shape[d] > 1:
            first = np.take(ids, [0], axis=d)
            prov.union(ids, first)
            prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
            ids = first
    return ids if keepdim else np.squeeze(ids, axis=tuple(dims))


def expand_ids(prov: Provenance, node: fx.Node, ids: np.ndarray) -> np.ndarray:
    """Broadcast ids; an expand in ``prov.copies`` gives each copy ids of its own."""
    x_shape, out_shape = shape(node.args[0]), shape(node)
    x_shape = (1,) * (len(out_shape) - len(x_shape)) + x_shape
    copied = [d for d in range(len(out_shape) - 1) if x_shape[d] == 1 and out_shape[d] > 1]
    if not copied or any(s > 1 for s in ids.shape[:-1]) or ids.shape[-1] == 1:
        return ids
    prov.broadcasts[node.name] = np.unique(ids)
    if node.name not in prov.copies:
        return ids
    size = [out_shape[d] if d in copied else 1 for d in range(len(out_shape) - 1)] + [ids.shape[-1]]
    return prov.fresh(node.name, tuple(size))


def matmul_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """x @ y over batch dims (attention as matmuls: q·kᵀ, then p·v). The contracted
    channels are summed together: united, like a reduction's. The output's batch dims
    carry both operands' channels, united element-wise (head h of q with head h of k,
    then of v), as DTensor's bmm strategy shards batch dims of both operands alike
    (torch/distributed/tensor/_ops/_matrix_ops.py)."""
    ix, iy, iadd = G.BATCHED_MATMULS[node.target]
    nd = len(shape(node))
    parts = []
    for operand, contract in ((node.args[ix], -1), (node.args[iy], -2)):
        if len(shape(operand)) < 2:
            raise _Unsupported("a matrix-vector product")
        if operand.name not in inputs:
            continue
        ids = _align(inputs[operand.name], len(shape(operand)))
        d = ids.ndim + contract
        if ids.shape[d] > 1:
            first = np.take(ids, [0], axis=d)
            prov.union(ids, first)
            prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
            ids = first
        parts.append(_align(ids, nd))
    if iadd is not None and node.args[iadd].name in inputs:
        parts.append(_align(inputs[node.args[iadd].name], nd))
    if not parts:
        return None
    return mixers.combine(prov, parts, node.name)


def einsum_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """The general form of ``_matmul`` (DTensor's einsum strategy classifies letters the
    same way, torch/distributed/tensor/_ops/_einsum_strategy.py): letters summed away
    unite their channels; letters kept unite the operands' channels element-wise."""
    letters = G.einsum_letters(node)
    if letters is None:
        raise _Unsupported("an einsum with an ellipsis")
    subs, out_subs = letters
    parts, numels = [], []
    for sub, operand in zip(subs, node.args[1]):
        if operand.name not in inputs:
            continue
        numels.append(int(np.prod(shape(operand))))
        ids = _align(inputs[operand.name], len(sub))
        for d, letter in enumerate(sub):
            if letter not in out_subs and ids.shape[d] > 1:
                first = np.take(ids, [0], axis=d)
                prov.union(ids, first)
                prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
                ids = first
        kept = [d for d, letter in enumerate(sub) if letter in out_subs]
        order = sorted(kept, key=lambda d: out_subs.index(sub[d]))
        ids = np.transpose(ids.reshape([ids.shape[d] for d in kept]), order and
                           [kept.index(d) for d in order])
        shape_out = [ids.shape[order.index(sub.index(c))] if c in sub else 1 for c in out_subs]
        parts.append(ids.reshape(shape_out))
    if not parts:
        return None
    return mixers.combine(prov, parts, node.name, numels=numels)


def cat_ids(prov: Provenance, node: fx.Node, inputs: dict, stack: bool = False) -> np.ndarray:
    """cat, or stack (= cat of the inputs unsqueezed at ``dim``)."""
    tensors = node.args[0]
    nd = len(shape(node))
    dim = norm_dim(arg(node, 1, "dim", 0), nd)
    carrying = [t for t in tensors if t.name in inputs]
    if not carrying:
        return None
    if len(carrying) < len(tensors):
        # Replicated values beside channels (gpt-oss's per-head sinks as an extra score
        # column): they go where the first index along ``dim`` of the channels goes,
        # each rank taking its part of them (scatter), or the layout check refuses.
        if stack:
            raise _Unsupported("stacks channels with replicated values")
        like = np.take(_align(inputs[carrying[0].name], nd), [0], axis=dim)
        inputs = {**inputs, **{t.name: like for t in tensors if t.name not in inputs}}
    if not stack and all(_align(inputs[t.name], nd).shape[dim] == 1 for t in tensors):
        # Rows of several tensors stacked along a dim that carries no channel (the tokens
        # of every expert, one after another): channel j of each is column j of the result.
        out = _align(inputs[tensors[0].name], nd)
        for t in tensors[1:]:
            other = _align(inputs[t.name], nd)
            prov.union(out, other)
            out = np.broadcast_arrays(out, other)[0]
        return out
    parts = []
    for t in tensors:
        ids = np.expand_dims(_align(inputs[t.name], nd - 1), dim) if stack else _align(inputs[t.name], nd)
        size = list(ids.shape)
        size[dim] = 1 if stack else shape(t)[dim]
        parts.append(np.broadcast_to(ids, size))
    common = list(np.broadcast_shapes(*[tuple(1 if d == dim else s for d, s in enumerate(p.shape))
                                        for p in parts]))
    full = []
    for p in parts:
        size = list(common)
        size[dim] = p.shape[dim]
        full.append(np.broadcast_to(p, size))
    return np.concatenate(full, axis=dim)


def _heads(ids: np.ndarray, what: str) -> np.ndarray:
    # (B, H, T, D) ids -> (H, D): they must not vary along batch or sequence.
    if ids.ndim != 4 or ids.shape[0] > 1 or ids.shape[2] > 1:
        raise _Unsupported(f"{what} channels vary along batch or sequence")
    return ids[0, :, 0, :]


def attention_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node) and mask.name in inputs:
        # A mask computed from projections (Doge's dynamic mask, from the values of all
        # heads): its channels stay replicated, each rank scattering its heads' part;
        # q, k and v still split by heads.
        prov.kill(inputs[mask.name], f"are the attention mask of {node.name}")
    gqa = bool(node.kwargs.get("enable_gqa", False))
    if q.name not in inputs or (gqa and any(x.name not in inputs for x in (k, v))):
        raise _Unsupported("q, k and v must all come from projections")
    qs, ks, vs = shape(q), shape(k), shape(v)
    # k/v that carry no channels (computed by ops without a channel rule, e.g. heads
    # tiled by ``repeat``) are replicated: each rank takes its query heads' share (scatter).
    heads = [np.broadcast_to(_heads(inputs[x.name], n), (s[1], s[3])) if x.name in inputs
             else np.zeros((s[1], 0), dtype=np.int64)
             for x, s, n in ((q, qs, "query"), (k, ks, "key"), (v, vs, "value"))]
    out = prov.fresh(node.name, (1, qs[1], 1, vs[3]))
    prov.attention[node.name] = AttentionUse(node.name, heads[0], heads[1], heads[2], out[0, :, 0, :], gqa)
    return out
