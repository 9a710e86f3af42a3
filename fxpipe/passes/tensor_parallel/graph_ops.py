"""What the TP pass knows about ATen ops, and the structural finds it starts from.

Nothing here looks at a module or class name: a projection is an ``aten.linear``,
``aten.addmm`` or ``aten.mm`` whose weight is a 2-D parameter placeholder; an
embedding is an ``aten.embedding`` of a parameter; an attention core is
``aten.scaled_dot_product_attention``; the loss is ``aten.cross_entropy_loss``.
"""
from __future__ import annotations

import operator
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.ir.op_tables import CASTS  # noqa: F401  (the rules read G.CASTS)
from fxpipe.passes.weight_views import uncast

aten = torch.ops.aten

LINEAR = aten.linear.default
ADDMM = aten.addmm.default
MM = aten.mm.default
MATMUL = aten.matmul.default
# Batched matrix products of two activations (attention written as matmuls; einsum
# decomposes to bmm): (x, y, operand added to the product or None) argument indices.
BATCHED_MATMULS = {MATMUL: (0, 1, None), aten.bmm.default: (0, 1, None), aten.baddbmm.default: (1, 2, 0)}
EMBEDDING = aten.embedding.default
SDPA = aten.scaled_dot_product_attention.default
CROSS_ENTROPY = aten.cross_entropy_loss.default
DROPOUT = aten.dropout.default

# Ops that re-describe a tensor's shape; their output shape comes from meta["val"].
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default,
                      aten.reshape_as.default})
# Ops shaped by their second operand: (x, other) -> x viewed or expanded to other's shape.
SHAPED_AS = frozenset({aten.view_as.default, aten.reshape_as.default, aten.expand_as.default})
# Ops whose output is the input, channel for channel (beyond the `pointwise` tag).
SAME_LAYOUT = frozenset({aten.alias.default, aten.contiguous.default, aten.clone.default,
                         aten.detach.default, aten.to.dtype, aten.to.dtype_layout,
                         aten._to_copy.default, aten.lift_fresh_copy.default, DROPOUT,
                         aten.__and__.Tensor, aten.__or__.Tensor})
# Element-wise ops torch does not tag ``pointwise``: complex numbers built from, or split
# into, real parts (rotary written with complex numbers, complex_views.py).
COMPLEX_ELEMENTWISE = frozenset({aten.polar.default, aten.complex.default, aten.real.default,
                                 aten.imag.default, aten._conj.default, aten.conj.default})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
TRANSPOSES = frozenset({aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default})
SQUEEZES = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
# Reductions over given dims; (dim argument index, keepdim argument index or None).
REDUCTIONS: dict[Any, tuple[int, int | None]] = {
    aten.mean.dim: (1, 2), aten.sum.dim_IntList: (1, 2), aten.amax.default: (1, 2),
    aten.amin.default: (1, 2), aten.softmax.int: (1, None), aten._softmax.default: (1, None),
    aten.log_softmax.int: (1, None), aten._log_softmax.default: (1, None),
    aten.logsumexp.default: (1, 2), aten.max.dim: (1, 2), aten.min.dim: (1, 2),
    aten.linalg_vector_norm.default: (2, 3),
}
VECTOR_NORM = aten.linalg_vector_norm.default
# Reductions returning (values, indices).
PAIRED_REDUCTIONS = frozenset({aten.max.dim, aten.min.dim})
NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
# Linear reductions: over channels split across ranks they give a partial sum, made whole
# by one all-reduce of the (small) statistic rather than a gather of the activation.
LINEAR_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList})


def is_statistic(node: fx.Node) -> bool:
    """A reduction whose result over channels split across ranks each rank can compute
    from its part and one collective: a sum or mean (all-reduce of the partial sums), or
    a p-norm, p > 0 (the p-norm of the ranks' p-norms: ‖x‖ = ‖(‖x_r‖)_r‖, norms.py)."""
    if node.target is VECTOR_NORM:
        return float(arg(node, 1, "ord", 2)) > 0
    return node.target in LINEAR_REDUCTIONS
EINSUM = aten.einsum.default
# New tensors shaped like their input: the values carry none of its channels.
LIKE = frozenset({aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                  aten.full_like.default})
INDEX_ADD = aten.index_add.default
UNBIND = aten.unbind.int
STACK = aten.stack.default
SELECT = aten.select.int
INDEX = aten.index.Tensor
NEW_EMPTY = aten.new_empty.default
PADS = frozenset({aten.pad.default, aten.constant_pad_nd.default})
SLICE_SCATTER = aten.slice_scatter.default
TYPE_AS = aten.type_as.default
# Shape-only ops a collective may move across (a sum commutes with a view).
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                   aten.alias.default})


def padded_dims(node: fx.Node) -> dict[int, tuple[int, int]]:
    """dim -> (before, after) of an ``aten.pad``/``constant_pad_nd`` (pairs from the last dim)."""
    pad, nd = list(node.args[1]), len(shape(node))
    return {nd - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)
            if pad[2 * i] or pad[2 * i + 1]}


def is_pointwise(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return target in SAME_LAYOUT or target in COMPLEX_ELEMENTWISE or torch.Tag.pointwise in tags


GETITEM = operator.getitem


def op_table(*entries: tuple[Any, Any]) -> dict[Any, Any]:
    """A rule table keyed by ATen op (DTensor keeps its sharding strategies the same way,
    one registered per op): ``entries`` are (op or collection of ops, rule). An op that
    two entries name keeps the first one's rule, so the order of ``entries`` says which
    rule an op that belongs to two groups follows."""
    table: dict[Any, Any] = {}
    for ops, rule in entries:
        for op in (ops if isinstance(ops, (frozenset, set, dict, tuple)) else (ops,)):
            table.setdefault(op, rule)
    return table


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: fx.Node) -> tuple[int, ...]:
    """Static sizes as ints; a data-dependent size (routed tokens, fxpipe/ir/sizes.py) as a
    negative stand-in, equal for equal symbols and never equal to a real size, so the
    channel rules can match feature dimensions around it without guarding on it."""
    return tuple(_dim(s) for s in node.meta["val"].shape)


def _dim(s: Any) -> int:
    if isinstance(s, torch.SymInt) and s.node.hint is None:
        return -1 - zlib.crc32(str(s.node.expr).encode())
    return int(s)


def einsum_letters(node: fx.Node) -> tuple[list[str], str] | None:
    """Subscripts of an ``aten.einsum`` (per operand, and the output); None with an ellipsis."""
    equation = node.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.split("->")
    return lhs.split(","), out


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of an ATen call, with its schema default."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@dataclass(frozen=True)
class Projection:
    """A matrix multiply by a parameter: the unit TP shards."""
    node: str
    weight: str
    """Placeholder of the weight parameter."""
    out_dim: int
    """Weight dim that indexes output channels (0 for linear, 1 for Conv1D-style addmm)."""
    input_arg: int
    """Index in ``node.args`` of the activation."""
    bias: str | None
    """Placeholder of the bias parameter, if the op adds one."""
    contract_dim: int | None = None
    """Weight dim contracted with the input's channels; None: the other dim of a 2-D weight.
    Stacked expert weights (E, ., .) name it (grouped_mm, bmm, a selected expert)."""
    out_axis: int = -1
    """Dim of the output (and of the input) that carries the channels: -2 for ``W @ x``
    (Mamba's dt_proj applied to (B, R, T)), whose input channels are its rows."""

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim if self.contract_dim is None else self.contract_dim


def _weight_of(node: Any, params: set[str], ndim: int = 2) -> tuple[str, tuple[int, ...]] | None:
    """(placeholder, axes) when ``node`` is an ``ndim``-D view of a parameter made by
    transposes, dtype casts or by selecting one expert of a stacked (E, ., .) parameter:
    ``axes[i]`` is the parameter dim that the view's dim i indexes."""
    node = uncast(node)
    if not isinstance(node, fx.Node):
        return None
    if node.op == "placeholder":
        if node.name in params and len(shape(node)) == ndim:
            return node.name, tuple(range(ndim))
        return None
    if node.op != "call_function":
        return None
    t = node.target
    if t in TRANSPOSES:
        inner = _weight_of(node.args[0], params, ndim)
        if inner is None:
            return None
        name, axes = inner
        if t is aten.permute.default:
            perm = [norm_dim(d, ndim) for d in node.args[1]]
        elif t in (aten.t.default, aten.numpy_T.default):
            perm = list(reversed(range(ndim)))
        else:
            perm = list(range(ndim))
            d0, d1 = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
            perm[d0], perm[d1] = perm[d1], perm[d0]
        return name, tuple(axes[p] for p in perm)
    if t is SELECT and isinstance(node.args[2], int):
        # One expert's matrix of a stacked (E, ., .) weight: w[e] (JetMoE's experts).
        inner = _weight_of(node.args[0], params, ndim + 1)
        if inner is None or norm_dim(node.args[1], ndim + 1) != 0:
            return None
        return inner[0], inner[1][1:]
    return None


def is_grouped_mm(node: fx.Node) -> bool:
    """``aten._grouped_mm`` without a bias, or an op with its (input, weight, offs) schema
    and meaning (Hugging Face's ``grouped_mm_fallback``): (S, K) x (E, K, N) -> (S, N),
    the rows of expert e given by the cumulative counts ``offs``."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(node.args) < 3:
        return False
    if schema.name == "aten::_grouped_mm":
        return arg(node, 3, "bias") is None and arg(node, 4, "out_dtype") is None
    return schema.name.endswith("::grouped_mm_fallback") and \
        [a.name for a in schema.arguments] == ["input", "weight", "offs"]


def find_projections(graph: fx.Graph, params: set[str]) -> dict[str, Projection]:
    found: dict[str, Projection] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is LINEAR:
            w = _weight_of(node.args[1], params)
            b = arg(node, 2, "bias")
            if w is None or (b is not None and not _is_param(b, params)):
                continue
            # linear computes x @ W.T: the view of W is (out, in).
            found[node.name] = Projection(node.name, w[0], w[1][0], 0,
                                          uncast(b).name if b is not None else None, w[1][1])
        elif node.target is MATMUL:
            # x @ W (Falcon's ``input @ self.weight.T``): like mm, with any leading dims.
            w = _weight_of(node.args[1], params)
            if w is not None and len(shape(node.args[0])) >= 2:
                found[node.name] = Projection(node.name, w[0], w[1][1], 0, None, w[1][0])
                continue
            # W @ x (Mamba's ``dt_proj.weight @ dt``): output channels along dim -2.
            w = _weight_of(node.args[0], params)
            if w is not None and len(shape(node.args[1])) >= 2 and _weight_of(node.args[1], params) is None:
                found[node.name] = Projection(node.name, w[0], w[1][0], 1, None, w[1][1], out_axis=-2)
        elif node.target in (ADDMM, MM):
            w_index, x_index = (2, 1) if node.target is ADDMM else (1, 0)
            w = _weight_of(node.args[w_index], params)
            b = node.args[0] if node.target is ADDMM else None
            if w is None or (b is not None and not _is_param(b, params)):
                continue
            if len(shape(node.args[x_index])) != 2:
                continue
            # mm computes x @ W: the view of W is (in, out) (GPT-2's Conv1D).
            found[node.name] = Projection(node.name, w[0], w[1][1], x_index,
                                          uncast(b).name if b is not None else None, w[1][0])
        elif is_grouped_mm(node) or node.target is aten.bmm.default:
            # Stacked expert weights (E, in, out): every expert's FFN is split alike, its
            # output channels (or contracted channels) over the ranks, as a dense MLP's.
            w = _weight_of(node.args[1], params, 3)
            if w is None or w[1][0] != 0:
                continue
            if node.target is not aten.bmm.default and len(shape(node.args[0])) != 2:
                continue
            if node.target is aten.bmm.default and len(shape(node.args[0])) != 3:
                continue
            found[node.name] = Projection(node.name, w[0], w[1][2], 0, None, w[1][1])
    return found


def _is_param(node: Any, params: set[str]) -> bool:
    node = uncast(node)
    return isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params


def token_embeddings(graph: fx.Graph, params: set[str], inputs: set[str]) -> dict[str, str]:
    """Embedding node -> weight placeholder, for lookups of parameter rows whose
    indices come from a batch input (token ids) through shape-only ops. Position
    tables are indexed by values the graph computes and are not returned."""
    found = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is EMBEDDING and _is_param(node.args[0], params):
            if arg(node, 3, "scale_grad_by_freq", False) or arg(node, 4, "sparse", False):
                continue  # per-batch frequency scaling / sparse grads are not vocab-parallel
            ids = node.args[1]
            while isinstance(ids, fx.Node) and ids.op == "call_function" and (
                    ids.target in RESHAPES or ids.target in SAME_LAYOUT):
                ids = ids.args[0]
            if isinstance(ids, fx.Node) and ids.op == "placeholder" and ids.name in inputs:
                found[node.name] = node.args[0].name
    return found


def grad_carrying(graph: fx.Graph, trainable: set[str]) -> set[str]:
    """Nodes whose value depends differentiably on a trainable parameter.

    A collective that acts only in backward (Megatron's f) is inserted only on
    such values. Integer/bool values and grad-disabled regions carry none; complex ones
    do (rotary written with complex numbers, complex_views.py)."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in trainable:
                out.add(node.name)
            continue
        if node.op != "call_function":
            continue
        if getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" and node.args[0] is False:
            continue
        if node.target is aten.detach.default:
            continue
        v = val(node)
        tensors = [v] if isinstance(v, torch.Tensor) else [
            t for t in (v if isinstance(v, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
        if not tensors or not any(t.dtype.is_floating_point or t.dtype.is_complex for t in tensors):
            continue
        if any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out
