"""Channel provenance: which projection output channels each tensor element carries.

How the pass sees heads and channels without names (docs/tensor_parallel.md). Every output channel of every projection gets a
global integer id. The ids are pushed forward through the graph as an integer
array per tensor (``ids``: full rank, size 1 along dims that carry no channel,
so it broadcasts to the tensor). Views, transposes, splits, slices, cats and
broadcasts move ids around exactly as they move the data, which is how fused
(GPT-2 ``c_attn``, [q|k|v]) and per-head interleaved (GPT-NeoX) QKV layouts are
decoded without knowing them. Element-wise ops that combine two channels
(rotary's rotate-half, SwiGLU's gate·up) record a *union*: those channels must
live on the same rank.

Terminals record where channels are consumed:
- a projection whose input carries ids on its contraction dim (row-parallel
  candidate: the ids tell which of its input channels came from where);
- the attention core (per-head ids of q, k, v; the output gets fresh per-head ids);
- cross-entropy over the class dim (a vocabulary-parallel LM head).

Any other consumer (a norm over channels, a graph output, an op without a rule)
*poisons* the ids it reads: they stay replicated. Correct first, fast second.
"""
from __future__ import annotations

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import complex_views, graph_ops as G, mixers, writes
from fxpipe.passes.tensor_parallel.channel_ids import Provenance, _align, _compact, _Unsupported, reshape_ids
from fxpipe.passes.tensor_parallel.graph_ops import Projection, arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.provenance_ops import (_attention, _cat, _einsum, _expand, _index, _matmul,
                                                          _reduction, _slice_scatter)


def analyze(graph: fx.Graph, projections: dict[str, Projection],
            split_statistics: frozenset[str] = frozenset(), copies: frozenset[str] = frozenset(),
            constants: dict | None = None) -> Provenance:
    """One forward sweep over the graph in topological order; ``split_statistics``:
    mean/sum nodes whose channels stay split (see ``split_statistics``); ``copies``:
    expands whose copies are channels of their own (see ``shared_copies``); ``constants``:
    placeholder -> value of the graph's constants."""
    prov = Provenance(split_statistics=split_statistics, copies=copies, constants=constants or {})
    for node in graph.nodes:
        if node.op == "output":
            for a in node.all_input_nodes:
                if isinstance(prov.ids.get(a.name), np.ndarray):
                    prov.kill(prov.ids[a.name], "reach the graph output")
            continue
        if node.op != "call_function":
            continue
        inputs = {a.name: prov.ids[a.name] for a in node.all_input_nodes if a.name in prov.ids}
        proj = projections.get(node.name)
        if proj is not None:
            _projection(prov, node, proj, inputs)
            continue
        if not inputs:
            continue
        try:
            out = _rule(prov, node, inputs)
        except _Unsupported as exc:
            for ids in inputs.values():
                for arr in (ids if isinstance(ids, list) else [ids]):
                    if arr is not None:
                        prov.kill(arr, f"reach {node.target} ({node.name}): {exc}")
            continue
        if out is not None:
            prov.ids[node.name] = out
    return prov


def _projection(prov: Provenance, node: fx.Node, proj: Projection, inputs: dict) -> None:
    x = node.args[proj.input_arg]
    for name, ids in inputs.items():
        if name != x.name:
            prov.kill(ids, f"are used as the weight/bias of projection {node.name}")
    if proj.out_axis == -2:  # W @ x: a column-parallel candidate only (its rows are channels)
        if x.name in inputs:
            ids = _align(inputs[x.name], len(shape(x)))
            if any(s > 1 for i, s in enumerate(ids.shape) if i != ids.ndim - 2):
                prov.kill(ids, f"vary along non-contracted dims of projection {node.name}")
            elif ids.shape[-2] > 1:  # contracted: mixed, like a reduction's
                first = np.take(ids, [0], axis=-2)
                prov.union(ids, first)
                prov.mixers.append((int(first.flat[0]), f"{node.target} ({node.name})"))
        out_shape = shape(node)
        prov.ids[node.name] = prov.fresh(node.name, (1,) * (len(out_shape) - 2) + (out_shape[-2], 1))
        return
    if x.name in inputs:
        ids = inputs[x.name]
        if any(s > 1 for s in ids.shape[:-1]):
            prov.kill(ids, f"vary along non-contracted dims of projection {node.name}")
        elif ids.shape[-1] == shape(x)[-1]:
            prov.rows[node.name] = ids.reshape(-1)
        # ids constant along the contracted dim: one mixed class (e.g. after a norm), the
        # input is replicated and the projection cannot be row-parallel; nothing to record.
    out_shape = shape(node)
    prov.ids[node.name] = prov.fresh(node.name, (1,) * (len(out_shape) - 1) + (out_shape[-1],))


def _rule(prov: Provenance, node: fx.Node, inputs: dict) -> object:
    t = node.target
    if G.is_getitem(node):
        ids = inputs[node.args[0].name]
        if not isinstance(ids, list):
            raise _Unsupported("indexing a tensor")
        return ids[node.args[1]]
    if t in G.LIKE or t is G.NEW_EMPTY:
        return None
    if any(isinstance(v, list) for v in inputs.values()):
        raise _Unsupported("a multi-output value used directly")
    x = node.args[0] if node.args else None
    if t in G.RESHAPES:
        if x.name not in inputs:
            return None  # view_as / reshape_as read only the shape of ``other``
        if 0 in shape(x):
            raise _Unsupported("an empty tensor")
        return reshape_ids(inputs[x.name], shape(x), shape(node))
    if t in G.TRANSPOSES:
        nd = len(shape(x))
        if t is G.aten.permute.default:
            perm = [norm_dim(d, nd) for d in node.args[1]]
        elif t is G.aten.numpy_T.default:
            perm = list(reversed(range(nd)))
        else:
            perm = list(range(nd))
            d0, d1 = (0, nd - 1) if t is G.aten.t.default else (norm_dim(node.args[1], nd),
                                                               norm_dim(node.args[2], nd))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        return np.transpose(inputs[x.name], perm)
    if t is G.aten.unsqueeze.default:
        return np.expand_dims(inputs[x.name], norm_dim(node.args[1], len(shape(node))))
    if t is G.aten.expand_as.default:
        if node.args[1].name in inputs and x.name not in inputs:
            return None  # only the shape of ``other`` is read
        return _align(inputs[x.name], len(shape(node)))
    if t is G.aten.expand.default:  # only size-1 dims expand, and they carry no channel
        return _expand(prov, node, _align(inputs[x.name], len(shape(node))))
    if t in G.SQUEEZES:
        return reshape_ids(inputs[x.name], shape(x), shape(node))
    if t is G.aten.slice.Tensor:
        ids = inputs[x.name]
        dim = norm_dim(arg(node, 1, "dim", 0), ids.ndim)
        if ids.shape[dim] == 1:
            return ids
        index = [slice(None)] * ids.ndim
        index[dim] = slice(arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1))
        return ids[tuple(index)]
    if t in G.SPLITS:
        ids = inputs[x.name]
        dim = norm_dim(arg(node, 2, "dim", 0), ids.ndim)
        if ids.shape[dim] == 1:  # pieces of a dim without channels (sizes may be data-dependent)
            return [ids] * len(G.val(node))
        outs, start = [], 0
        for v in G.val(node):
            n = int(v.shape[dim])
            outs.append(ids if ids.shape[dim] == 1 else np.take(ids, range(start, start + n), axis=dim))
            start += n
        return outs
    if t is G.aten.cat.default:
        return _cat(prov, node, inputs)
    if t is G.STACK:  # interleaved rotary: stack(..., dim=-1) then flatten pairs
        # (a scan's steps stacked along the sequence carry the same ids: size 1 there)
        out = _cat(prov, node, inputs, stack=True)
        return None if out is None else _compact(out)
    if t is G.SELECT:  # fused QKV picked by index along a dim that carries no head
        ids = inputs[x.name]
        dim = norm_dim(node.args[1], ids.ndim)
        index = node.args[2] if ids.shape[dim] > 1 else 0
        return np.take(ids, norm_dim(index, shape(x)[dim]) if ids.shape[dim] > 1 else 0, axis=dim)
    if t is G.UNBIND:  # q, k, v = qkv.unbind(dim) along a dim that carries no head
        ids = inputs[x.name]
        dim = norm_dim(arg(node, 1, "dim", 0), ids.ndim)
        return [np.take(ids, i if ids.shape[dim] > 1 else 0, axis=dim) for i in range(len(G.val(node)))]
    if t in G.PADS:  # padded positions hold a constant: they go where their row's channels go
        ids = _align(inputs[x.name], len(shape(node)))
        if node.target is G.aten.pad.default and arg(node, 2, "mode", "constant") != "constant":
            raise _Unsupported("a reflecting or replicating pad")
        widths = [(0, 0) if ids.shape[d] == 1 else p for d, p in
                  ((d, G.padded_dims(node).get(d, (0, 0))) for d in range(ids.ndim))]
        if any(a < 0 or b < 0 for a, b in widths):
            raise _Unsupported("a negative pad (a crop)")
        return np.pad(ids, widths, mode="edge")
    if t is G.SLICE_SCATTER:
        return _slice_scatter(prov, node, inputs)
    if t is G.INDEX:  # rows gathered by an index tensor (tokens routed to experts)
        return _index(prov, node, inputs)
    if t is G.INDEX_ADD:  # a dropless MoE's combine: expert outputs added at their tokens' rows
        dim = norm_dim(node.args[1], len(shape(node)))
        arrays = [_align(inputs[a.name], len(shape(node))) for a in (x, node.args[3]) if a.name in inputs]
        if any(a.shape[dim] > 1 for a in arrays):
            raise _Unsupported("rows indexed along a dim that carries channels")
        out = arrays[0]
        for other in arrays[1:]:
            prov.union(out, other)
            out = np.broadcast_arrays(out, other)[0]
        return out
    if t is G.TYPE_AS:  # the second operand gives only its dtype
        if x.name not in inputs:
            return None
        return inputs[x.name]
    if t is writes.INDEX_PUT:
        return writes.ids(prov, node, inputs)
    if t is G.SDPA:
        return _attention(prov, node, inputs)
    if t is G.CROSS_ENTROPY:
        return _loss(prov, node, inputs)
    if t in G.PAIRED_REDUCTIONS:  # values and indices, both reduced alike
        out = _reduction(prov, node, inputs)
        return [out, out]
    if t in G.REDUCTIONS or t in G.NORMS:
        return _reduction(prov, node, inputs)
    if t in G.BATCHED_MATMULS:
        return _matmul(prov, node, inputs)
    if t is mixers.CONV1D:
        return mixers.conv1d_ids(node, inputs, _Unsupported)
    if t in mixers.ALONG:
        return mixers.along_ids(prov, node, inputs, _Unsupported)
    if t is mixers.REPEAT_INTERLEAVE:
        return mixers.repeat_ids(node, inputs, _Unsupported)
    if t is mixers.SELECT_SCATTER:
        return mixers.select_scatter_ids(prov, node, inputs)
    if t is G.EINSUM:
        return _einsum(prov, node, inputs)
    if t in complex_views.VIEWS:
        return complex_views.view_ids(prov, node, inputs)
    if G.is_pointwise(t):
        nd = len(shape(node))
        sizes = {a.name: (1,) * (nd - len(shape(a))) + shape(a) for a in node.all_input_nodes}
        return mixers.combine(prov, [_align(a, nd) for a in inputs.values()], node.name,
                              [sizes[n] for n in inputs])
    raise _Unsupported("no channel rule for this op")


def shared_copies(prov: Provenance) -> frozenset[str]:
    """Expands that copy a key (or value) part shared by all heads to every head — the
    decoupled rotary key of multi-head latent attention — so that copy h belongs to
    head h, and the shared part stays replicated (each rank expands to its own heads;
    f sums the copies' gradients), instead of uniting every head into one class."""
    kv = np.concatenate([np.concatenate([u.k.ravel(), u.v.ravel()]) for u in prov.attention.values()]
                        or [np.zeros(0, dtype=np.int64)])
    return frozenset(node for node, ids in prov.broadcasts.items() if np.isin(ids, kv).any())


def split_statistics(prov: Provenance, private: bool = True) -> frozenset[str]:
    """Means/sums over the query/key channels of all heads (OLMo 2's QK-norm): kept split
    by heads, each rank sums its own channels and one all-reduce of the statistic
    (a DTensor ``Partial`` sum) makes it whole — rather than one class of all heads, which
    would keep q and k replicated. Only query/key channels: a norm over the residual
    stream must unite its channels, or they would look like row-parallel inputs."""
    qk = np.concatenate([np.concatenate([u.q.ravel(), u.k.ravel()]) for u in prov.attention.values()]
                        or [np.zeros(0, dtype=np.int64)])
    return frozenset(node for node, ids in prov.statistics.items()
                     if ids.size > 1 and (np.isin(ids, qk).all() or (private and node in prov.private)))


def _loss(prov: Provenance, node: fx.Node, inputs: dict) -> None:
    logits, target = node.args[:2]
    if target.name in inputs or logits.name not in inputs:
        raise _Unsupported("the target carries channels")
    if arg(node, 2, "weight") is not None or arg(node, 5, "label_smoothing", 0.0):
        raise _Unsupported("class weights / label smoothing are not vocab-parallel")
    ids = inputs[logits.name]
    if len(shape(logits)) != 2 or ids.shape[0] > 1 or ids.shape[1] != shape(logits)[1]:
        raise _Unsupported("logits must be (N, C) with channels on C")
    prov.losses[node.name] = ids.reshape(-1)
    return None
