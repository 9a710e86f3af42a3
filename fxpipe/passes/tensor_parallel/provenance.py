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
from fxpipe.passes.tensor_parallel.provenance_ops import (attention_ids, cat_ids, einsum_ids, expand_ids, index_ids,
                                                          matmul_ids, reduction_ids, slice_scatter_ids)


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
    """The ids of ``node``'s output by its op's rule (``RULES``; an element-wise op not named
    there combines its operands'); raises ``_Unsupported`` where no rule applies."""
    rule = RULES.get(node.target)
    if rule is None and G.is_pointwise(node.target):
        rule = _pointwise
    if rule not in _READS_LISTS and any(isinstance(v, list) for v in inputs.values()):
        raise _Unsupported("a multi-output value used directly")
    if rule is None:
        raise _Unsupported("no channel rule for this op")
    return rule(prov, node, inputs)


def _getitem(prov: Provenance, node: fx.Node, inputs: dict) -> object:
    ids = inputs[node.args[0].name]
    if not isinstance(ids, list):
        raise _Unsupported("indexing a tensor")
    return ids[node.args[1]]


def _no_channels(prov: Provenance, node: fx.Node, inputs: dict) -> None:
    """A new tensor (``zeros_like``, ``new_empty``): its values carry none of its input's channels."""
    return None


def _reshape(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    x = node.args[0]
    if x.name not in inputs:
        return None  # view_as / reshape_as read only the shape of ``other``
    if 0 in shape(x):
        raise _Unsupported("an empty tensor")
    return reshape_ids(inputs[x.name], shape(x), shape(node))


def _transpose(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    t, x = node.target, node.args[0]
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


def _unsqueeze(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    return np.expand_dims(inputs[node.args[0].name], norm_dim(node.args[1], len(shape(node))))


def _expand_as(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    x = node.args[0]
    if node.args[1].name in inputs and x.name not in inputs:
        return None  # only the shape of ``other`` is read
    return _align(inputs[x.name], len(shape(node)))


def _expand(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    # only size-1 dims expand, and they carry no channel
    return expand_ids(prov, node, _align(inputs[node.args[0].name], len(shape(node))))


def _squeeze(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    x = node.args[0]
    return reshape_ids(inputs[x.name], shape(x), shape(node))


def _slice(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    ids = inputs[node.args[0].name]
    dim = norm_dim(arg(node, 1, "dim", 0), ids.ndim)
    if ids.shape[dim] == 1:
        return ids
    index = [slice(None)] * ids.ndim
    index[dim] = slice(arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1))
    return ids[tuple(index)]


def _split(prov: Provenance, node: fx.Node, inputs: dict) -> list[np.ndarray]:
    ids = inputs[node.args[0].name]
    dim = norm_dim(arg(node, 2, "dim", 0), ids.ndim)
    if ids.shape[dim] == 1:  # pieces of a dim without channels (sizes may be data-dependent)
        return [ids] * len(G.val(node))
    outs, start = [], 0
    for v in G.val(node):
        n = int(v.shape[dim])
        outs.append(ids if ids.shape[dim] == 1 else np.take(ids, range(start, start + n), axis=dim))
        start += n
    return outs


def _stack(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    """Interleaved rotary: stack(..., dim=-1) then flatten pairs (a scan's steps stacked
    along the sequence carry the same ids: size 1 there)."""
    out = cat_ids(prov, node, inputs, stack=True)
    return None if out is None else _compact(out)


def _select(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """Fused QKV picked by index along a dim that carries no head."""
    x = node.args[0]
    ids = inputs[x.name]
    dim = norm_dim(node.args[1], ids.ndim)
    index = node.args[2] if ids.shape[dim] > 1 else 0
    return np.take(ids, norm_dim(index, shape(x)[dim]) if ids.shape[dim] > 1 else 0, axis=dim)


def _unbind(prov: Provenance, node: fx.Node, inputs: dict) -> list[np.ndarray]:
    """q, k, v = qkv.unbind(dim) along a dim that carries no head."""
    ids = inputs[node.args[0].name]
    dim = norm_dim(arg(node, 1, "dim", 0), ids.ndim)
    return [np.take(ids, i if ids.shape[dim] > 1 else 0, axis=dim) for i in range(len(G.val(node)))]


def _pad(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """Padded positions hold a constant: they go where their row's channels go."""
    ids = _align(inputs[node.args[0].name], len(shape(node)))
    if node.target is G.aten.pad.default and arg(node, 2, "mode", "constant") != "constant":
        raise _Unsupported("a reflecting or replicating pad")
    widths = [(0, 0) if ids.shape[d] == 1 else p for d, p in
              ((d, G.padded_dims(node).get(d, (0, 0))) for d in range(ids.ndim))]
    if any(a < 0 or b < 0 for a, b in widths):
        raise _Unsupported("a negative pad (a crop)")
    return np.pad(ids, widths, mode="edge")


def _index_add(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """A dropless MoE's combine: expert outputs added at their tokens' rows."""
    dim = norm_dim(node.args[1], len(shape(node)))
    arrays = [_align(inputs[a.name], len(shape(node))) for a in (node.args[0], node.args[3]) if a.name in inputs]
    if any(a.shape[dim] > 1 for a in arrays):
        raise _Unsupported("rows indexed along a dim that carries channels")
    out = arrays[0]
    for other in arrays[1:]:
        prov.union(out, other)
        out = np.broadcast_arrays(out, other)[0]
    return out


def _type_as(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray | None:
    x = node.args[0]  # the second operand gives only its dtype
    return inputs[x.name] if x.name in inputs else None


def _paired_reduction(prov: Provenance, node: fx.Node, inputs: dict) -> list[np.ndarray]:
    out = reduction_ids(prov, node, inputs)  # values and indices, both reduced alike
    return [out, out]


def _pointwise(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    nd = len(shape(node))
    sizes = {a.name: (1,) * (nd - len(shape(a))) + shape(a) for a in node.all_input_nodes}
    return mixers.combine(prov, [_align(a, nd) for a in inputs.values()], node.name,
                          [sizes[n] for n in inputs])


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
    """Cross-entropy over the class dim: a vocabulary-parallel head's terminal."""
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


RULES = G.op_table(
    (G.GETITEM, _getitem),
    (G.LIKE, _no_channels),
    (G.NEW_EMPTY, _no_channels),
    (G.RESHAPES, _reshape),
    (G.TRANSPOSES, _transpose),
    (G.aten.unsqueeze.default, _unsqueeze),
    (G.aten.expand_as.default, _expand_as),
    (G.aten.expand.default, _expand),
    (G.SQUEEZES, _squeeze),
    (G.aten.slice.Tensor, _slice),
    (G.SPLITS, _split),
    (G.aten.cat.default, cat_ids),
    (G.STACK, _stack),
    (G.SELECT, _select),
    (G.UNBIND, _unbind),
    (G.PADS, _pad),
    (G.SLICE_SCATTER, slice_scatter_ids),
    (G.INDEX, index_ids),  # rows gathered by an index tensor (tokens routed to experts)
    (G.INDEX_ADD, _index_add),
    (G.TYPE_AS, _type_as),
    (writes.INDEX_PUT, writes.ids),
    (G.SDPA, attention_ids),
    (G.CROSS_ENTROPY, _loss),
    (G.PAIRED_REDUCTIONS, _paired_reduction),
    (G.REDUCTIONS, reduction_ids),
    (G.NORMS, reduction_ids),
    (G.BATCHED_MATMULS, matmul_ids),
    (mixers.CONV1D, mixers.conv1d_ids),
    (mixers.ALONG, mixers.along_ids),
    (mixers.REPEAT_INTERLEAVE, mixers.repeat_ids),
    (mixers.SELECT_SCATTER, mixers.select_scatter_ids),
    (G.EINSUM, einsum_ids),
    (complex_views.VIEWS, complex_views.view_ids),
)
"""ATen op -> ``rule(prov, node, inputs)``, the ids of the node's output (None: it carries
none; a list for a multi-output op). In the order the rules were written: an op in two
groups takes the first (``graph_ops.op_table``)."""
_READS_LISTS = (_getitem, _no_channels)
"""Rules that take a multi-output value as it is (every other rule refuses one)."""
