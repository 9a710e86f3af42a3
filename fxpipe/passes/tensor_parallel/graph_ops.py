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

aten = torch.ops.aten

LINEAR = aten.linear.default
ADDMM = aten.addmm.default
MM = aten.mm.default
EMBEDDING = aten.embedding.default
SDPA = aten.scaled_dot_product_attention.default
CROSS_ENTROPY = aten.cross_entropy_loss.default
DROPOUT = aten.dropout.default

# Ops that re-describe a tensor's shape; their output shape comes from meta["val"].
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default})
# Ops whose output is the input, channel for channel (beyond the `pointwise` tag).
SAME_LAYOUT = frozenset({aten.alias.default, aten.contiguous.default, aten.clone.default,
                         aten.detach.default, aten.to.dtype, aten.to.dtype_layout,
                         aten._to_copy.default, aten.lift_fresh_copy.default, DROPOUT,
                         aten.__and__.Tensor, aten.__or__.Tensor})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
TRANSPOSES = frozenset({aten.transpose.int, aten.permute.default, aten.t.default})
SQUEEZES = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
# Reductions over given dims; (dim argument index, keepdim argument index or None).
REDUCTIONS: dict[Any, tuple[int, int | None]] = {
    aten.mean.dim: (1, 2), aten.sum.dim_IntList: (1, 2), aten.amax.default: (1, 2),
    aten.amin.default: (1, 2), aten.softmax.int: (1, None), aten._softmax.default: (1, None),
    aten.log_softmax.int: (1, None), aten._log_softmax.default: (1, None),
}
NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
# Shape-only ops a collective may move across (a sum commutes with a view).
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                   aten.alias.default})


def is_pointwise(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return target in SAME_LAYOUT or torch.Tag.pointwise in tags


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: fx.Node) -> tuple[int, ...]:
    """Static sizes as ints; a data-dependent size (routed tokens, fxpipe/sizes.py) as a
    negative stand-in, equal for equal symbols and never equal to a real size, so the
    channel rules can match feature dimensions around it without guarding on it."""
    return tuple(_dim(s) for s in node.meta["val"].shape)


def _dim(s: Any) -> int:
    if isinstance(s, torch.SymInt) and s.node.hint is None:
        return -1 - zlib.crc32(str(s.node.expr).encode())
    return int(s)


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

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim


def _weight_of(node: Any, params: set[str]) -> tuple[str, bool] | None:
    """(placeholder, transposed) when ``node`` is a 2-D parameter or its transpose."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "placeholder" and node.name in params and len(shape(node)) == 2:
        return node.name, False
    if node.op == "call_function" and node.target in TRANSPOSES:
        inner = _weight_of(node.args[0], params)
        if inner is not None:
            return inner[0], not inner[1]
    return None


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
            # linear computes x @ W.T: W is (out, in), or (in, out) when it arrives transposed.
            found[node.name] = Projection(node.name, w[0], 1 if w[1] else 0, 0,
                                          b.name if b is not None else None)
        elif node.target in (ADDMM, MM):
            w_index, x_index = (2, 1) if node.target is ADDMM else (1, 0)
            w = _weight_of(node.args[w_index], params)
            b = node.args[0] if node.target is ADDMM else None
            if w is None or (b is not None and not _is_param(b, params)):
                continue
            if len(shape(node.args[x_index])) != 2:
                continue
            # mm computes x @ W: W is (in, out) (GPT-2's Conv1D), or (out, in) transposed.
            found[node.name] = Projection(node.name, w[0], 0 if w[1] else 1, x_index,
                                          b.name if b is not None else None)
    return found


def _is_param(node: Any, params: set[str]) -> bool:
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
    such values. Integer/bool values and grad-disabled regions carry none."""
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
        if not tensors or not any(t.dtype.is_floating_point for t in tensors):
            continue
        if any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out
