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

from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.attention_forms import constant_values
from fxpipe.passes.tensor_parallel import mixers, writes
from fxpipe.passes.tensor_parallel.graph_ops import Projection, arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.norms import private_norm


@dataclass(frozen=True)
class AttentionUse:
    node: str
    q: np.ndarray
    """(H, D) ids of the query per head."""
    k: np.ndarray
    """(Hk, D) ids of the key per head (Hk = H after a repeat_kv expand)."""
    v: np.ndarray
    out: np.ndarray
    """(H, Dv) fresh ids of the output per head."""
    enable_gqa: bool


@dataclass
class Provenance:
    ids: dict[str, object] = field(default_factory=dict)
    """Node -> ids array (or a list of them for split-like nodes)."""
    n_ids: int = 0
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Projection / attention node -> (first id, count) of the ids it creates."""
    edges: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    poison: list[tuple[np.ndarray, str]] = field(default_factory=list)
    """(ids, reason): channels consumed where they cannot stay sharded."""
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Projection -> ids along its contraction dim (1-D)."""
    attention: dict[str, AttentionUse] = field(default_factory=dict)
    losses: dict[str, np.ndarray] = field(default_factory=dict)
    """Cross-entropy node -> ids along the class dim (1-D)."""
    mixers: list[tuple[int, str]] = field(default_factory=list)
    """(an id, op) for every reduction that mixes channels: why a class cannot split."""
    statistics: dict[str, np.ndarray] = field(default_factory=dict)
    """Linear reduction (mean/sum) over channels only -> the channel ids it sums."""
    private: set[str] = field(default_factory=set)
    """Statistics whose input only their own norm reads (``norms.private_norm``)."""
    split_statistics: frozenset[str] = frozenset()
    broadcasts: dict[str, np.ndarray] = field(default_factory=dict)
    """Expand of a value whose channels vary along its last dim only, to copies along
    another dim -> the channel ids copied."""
    copies: frozenset[str] = frozenset()
    """Of those, the ones whose every copy gets ids of its own (``shared_copies``)."""
    constants: dict = field(default_factory=dict)
    """Placeholder -> value of the graph's constants (a fused QKV's picked-rows index)."""
    broadcast_whole: list[tuple[np.ndarray, str]] = field(default_factory=list)
    """(ids, node): channels an element-wise op broadcasts against other channels without
    uniting them (``mixers.combine``); they must stay whole on every rank."""
    """Of those, the ones whose channels stay split: a partial sum, all-reduced
    (``split_statistics``); the others unite their channels like any reduction."""

    def fresh(self, node: str, ids_shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(ids_shape))
        self.sources[node] = (self.n_ids, count)
        out = np.arange(self.n_ids, self.n_ids + count, dtype=np.int64).reshape(ids_shape)
        self.n_ids += count
        return out

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = np.broadcast_arrays(a, b)
        differ = a != b
        if differ.any():
            self.edges.append((a[differ].copy(), b[differ].copy()))

    def kill(self, ids: np.ndarray, reason: str) -> None:
        self.poison.append((np.unique(ids), reason))


def _align(ids: np.ndarray, ndim: int) -> np.ndarray:
    return ids.reshape((1,) * (ndim - ids.ndim) + ids.shape)


def reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products: (2,16,192) -> (32,192) gives
    ([0,1],[0]) and ([2],[1])."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga.append(i); pa *= a[i]; i += 1  # noqa: E702
        if j < len(b):
            gb.append(j); pb *= b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb:
                ga.append(i); pa *= a[i]; i += 1  # noqa: E702
            else:
                gb.append(j); pb *= b[j]; j += 1  # noqa: E702
        groups.append((ga, gb))
    return groups


def reshape_ids(ids: np.ndarray, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    """Move ids as a reshape moves data: each run of dims that carries channels is
    materialised and reshaped; runs without channels stay size 1."""
    src, dst = [1] * len(in_shape), [1] * len(out_shape)
    for ga, gb in reshape_groups(in_shape, out_shape):
        if any(ids.shape[d] > 1 for d in ga):
            for d in ga:
                src[d] = in_shape[d]
            for d in gb:
                dst[d] = out_shape[d]
    return _compact(np.broadcast_to(ids, src).reshape(dst))


def _compact(ids: np.ndarray) -> np.ndarray:
    """Size 1 along every dim the ids do not vary along: a view that merged batch with
    heads (Bloom's (B·H, T, D)) and split them again carries the heads only."""
    if ids.size == 0:
        return ids
    for d in range(ids.ndim):
        if ids.shape[d] > 1 and (ids == np.take(ids, [0], axis=d)).all():
            ids = np.take(ids, [0], axis=d)
    return ids


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


class _Unsupported(Exception):
    pass


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
    if G.is_pointwise(t):
        nd = len(shape(node))
        sizes = {a.name: (1,) * (nd - len(shape(a))) + shape(a) for a in node.all_input_nodes}
        return mixers.combine(prov, [_align(a, nd) for a in inputs.values()], node.name,
                              [sizes[n] for n in inputs])
    raise _Unsupported("no channel rule for this op")


def _slice_scatter(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
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


def _index(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
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


def _reduction(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
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
    if node.target in G.LINEAR_REDUCTIONS and all(ids.shape[d] == 1 for d in range(nd) if d not in dims):
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


def _expand(prov: Provenance, node: fx.Node, ids: np.ndarray) -> np.ndarray:
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


def _matmul(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
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


def _einsum(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """The general form of ``_matmul`` (DTensor's einsum strategy classifies letters the
    same way, torch/distributed/tensor/_ops/_einsum_strategy.py): letters summed away
    unite their channels; letters kept unite the operands' channels element-wise."""
    letters = G.einsum_letters(node)
    if letters is None:
        raise _Unsupported("an einsum with an ellipsis")
    subs, out_subs = letters
    parts = []
    for sub, operand in zip(subs, node.args[1]):
        if operand.name not in inputs:
            continue
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
    return mixers.combine(prov, parts, node.name)


def _cat(prov: Provenance, node: fx.Node, inputs: dict, stack: bool = False) -> np.ndarray:
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


def _attention(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
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
