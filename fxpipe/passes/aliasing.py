"""What an op's schema says about aliasing, for ``functionalize``: which arguments it writes,
whether it returns a view of its input, and how a value written into a view is carried
back to the view's parent (the scatter op that inverts each view: ``slice`` ->
``slice_scatter``, ``select`` -> ``select_scatter``, ``view``/``unsqueeze``/... ->
``reshape_as``, ``transpose``/``permute`` -> themselves inverted)."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

Emit = Callable[[Any, tuple], fx.Node]
"""``emit(target, args)``: a new node of the rewritten graph (placed and annotated like the write)."""


class FunctionalizeError(RuntimeError):
    """A mutation this pass cannot express functionally; names the node and its source."""


def mutated_args(node: fx.Node) -> list[int]:
    """Positions of the arguments ``node`` writes into ([] for a functional node)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [i for i, a in enumerate(node.target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def is_view(node: fx.Node) -> bool:
    """Does ``node`` return an alias of its input (its schema says so; an output of a
    multi-output view op, too)?"""
    t = node.target
    if node.op != "call_function":
        return False
    if t is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and is_view(src)
    if not isinstance(t, torch._ops.OpOverload) or mutated_args(node):
        return False
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None


def view_parent(node: fx.Node) -> fx.Node:
    if node.target is operator.getitem:
        return node.args[0].args[0]
    return node.args[0]


def same_storage(a: fx.Node, b: fx.Node) -> bool:
    """Did ``a`` return ``b``'s storage? (``x.to(dtype)`` does only when nothing converts.)"""
    try:
        return StorageWeakRef(a.meta["val"].untyped_storage()) == \
            StorageWeakRef(b.meta["val"].untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse, nested: no plain storage
        return False


def where(node: fx.Node) -> str:
    """``node`` for messages: its name, its op and the user's source line."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    src = next((ln.strip() for ln in reversed(trace) if ln.strip().startswith("File ")), "")
    return f"{node.name} ({node.target}){': ' + src if src else ''}"


def functional_op(node: fx.Node) -> Callable:
    """aten.foo_.overload -> aten.foo.overload (copy_ -> copy)."""
    schema = node.target._schema
    base = schema.name.split("::")[1]
    overload = node.target._overloadname
    if not base.endswith("_") or mutated_args(node) != [0]:
        raise FunctionalizeError(f"cannot make {where(node)} functional: it writes into "
                                 f"arguments {mutated_args(node)} (only writes into its first "
                                 f"argument, like x.add_(y), are supported)")
    packet = getattr(aten, base[:-1], None)
    op = getattr(packet, overload, None) if packet is not None else None
    if op is None:
        raise FunctionalizeError(f"cannot make {where(node)} functional: torch has no "
                                 f"aten.{base[:-1]}.{overload}")
    return op


RESHAPES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.alias.default, aten.detach.default, aten.view_as.default,
    aten.reshape_as.default,
})
"""Views whose inverse is a reshape back to the parent's shape."""
IDENTITIES = frozenset({
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
    aten.contiguous.default, aten.type_as.default,
})
"""Ops that return their input itself when nothing needs converting (else a new storage)."""


def inverse_view(view: fx.Node, base: fx.Node, value: fx.Node, emit: Emit, m: fx.Node) -> fx.Node:
    """The value of ``view``'s parent, now ``base``, once ``view`` holds ``value``: the
    inverse of one view op (``m``: the write, for messages)."""
    t = view.target
    a = view.args
    if t is operator.getitem:
        return _inverse_multi(view, base, value, emit, m)
    if t == aten.slice.Tensor:
        dim, start, end, step = (list(a[1:]) + [0, None, None, 1][len(a) - 1:])[:4]
        return emit(aten.slice_scatter.default, (base, value, dim, start, end, step))
    if t == aten.select.int:
        return emit(aten.select_scatter.default, (base, value, a[1], a[2]))
    if t == aten.diagonal.default:
        extra = tuple(a[1:])
        return emit(aten.diagonal_scatter.default, (base, value, *extra))
    if t in (aten.transpose.int,):
        return emit(aten.transpose.int, (value, a[1], a[2]))
    if t == aten.t.default:
        return emit(aten.t.default, (value,))
    if t == aten.permute.default:
        dims = [d % len(a[1]) for d in a[1]]
        inverse = [dims.index(i) for i in range(len(dims))]
        return emit(aten.permute.default, (value, inverse))
    if t in RESHAPES:
        return emit(aten.reshape_as.default, (value, base))
    if t in IDENTITIES:  # same storage: the op returned its input unchanged
        return value
    raise FunctionalizeError(f"cannot make {where(m)} functional: it writes through "
                             f"{view.name} ({t}), a view this pass cannot invert")


def _inverse_multi(view: fx.Node, base: fx.Node, value: fx.Node, emit: Emit, m: fx.Node) -> fx.Node:
    multi, i = view.args
    t, a = multi.target, multi.args
    if t == aten.unbind.int:
        dim = a[1] if len(a) > 1 else 0
        return emit(aten.select_scatter.default, (base, value, dim, i))
    if t in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = a[2] if len(a) > 2 else multi.kwargs.get("dim", 0)
        sizes = [int(v.shape[dim]) for v in multi.meta["val"]]
        start = sum(sizes[:i])
        return emit(aten.slice_scatter.default, (base, value, dim, start, start + sizes[i], 1))
    raise FunctionalizeError(f"cannot make {where(m)} functional: it writes through "
                             f"{view.name}, an output of {t}")
