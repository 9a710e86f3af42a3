"""Plan rules for ops that mix or write channels (conv1d, along-dim ops, matmul,
repeat, select_scatter, index_put) and for attention, einsum, split and slice: the
operands' layouts and conversions a sharded node needs (``plan.RULES`` maps each op to
its rule; every rule is ``rule(plan, prov, node, lay, grad, where)``), and ``narrow``,
how a replicated operand meets a sharded consumer."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch.fx as fx

from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.attention_forms import strided_blocks
from fxpipe.passes.tensor_parallel.channel_ids import Provenance
from fxpipe.passes.tensor_parallel.graph_ops import arg, norm_dim, shape
from fxpipe.passes.tensor_parallel.layout import Layout, is_sharded, local_range
from fxpipe.passes.tensor_parallel.mixers import _FULL_SIZE, ALONG, CONV1D
from fxpipe.passes.tensor_parallel.param_shards import Narrowing
from fxpipe.passes.tensor_parallel.plan_record import Conversion, Refuse, TPPlan
from fxpipe.passes.tensor_parallel.writes import _indexed_dims


def narrow(plan: TPPlan, consumer: fx.Node, a: fx.Node, lay: Any, dim_of: Callable[[int], int | None],
           grad: frozenset[str]) -> None:
    """A replicated operand of a sharded consumer: ``dim_of(d)`` is the operand's dim that
    indexes the positions of the consumer's sharded dim d (None: it has none). Each rank
    takes its block there (scatter; the backward all-gathers), or, indexing none, the
    operand's gradient is a partial sum over the rank's part (f)."""

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
        raise Refuse(f"replicated input {a.name} cannot be narrowed to the shard")
    if pending is not None:
        if scatter_dim is not None:
            raise Refuse(f"replicated input {a.name} cannot be narrowed to the shard")
        plan.pending.append(pending)
        return
    if scatter_dim is not None:
        plan.conversions[(consumer.name, a.name)] = [Conversion(CollectiveKind.SCATTER, scatter_dim, outer)]
    elif a.name in grad:
        plan.conversions[(consumer.name, a.name)] = [Conversion(CollectiveKind.F)]


def conv1d_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                grad: frozenset[str], where: str) -> None:
    """Each rank convolves its own channels with its own rows of the kernel and bias;
    ``groups`` becomes the local channel count."""
    xl = plan.layouts[node.args[0].name]
    if xl.sharded != (1,) or lay.sharded != (1,):
        raise Refuse("a depthwise conv1d split along another dim than its channels")
    args = [node.args[0], node.args[1], arg(node, 2, "bias"), arg(node, 3, "stride", [1]),
            arg(node, 4, "padding", [0]), arg(node, 5, "dilation", [1]), lay.shape[1]]
    plan.new_target[node.name] = CONV1D
    plan.new_args[node.name] = tuple(args)
    for a in args[1:3]:
        if isinstance(a, fx.Node):
            narrow(plan, node, a, lay, lambda d: 0 if d == 1 else None, grad)


def along_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
               grad: frozenset[str], where: str) -> None:
    x = plan.layouts[node.args[0].name]
    if set(ALONG[node.target](node, len(x.full))) & set(x.sharded):
        raise Refuse("scans or masks along a sharded dim")


def matmul_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                grad: frozenset[str], where: str) -> None:
    """x @ y split along batch dims (heads), rows of x or columns of y (a recurrence's
    state whose rows are channels, times a replicated vector), never the contracted
    dim: the same op on smaller operands. A replicated operand takes its block of a
    split dim it indexes (scatter), or gets f: its gradient sums over every rank's part."""

    ix, iy, iadd = G.BATCHED_MATMULS[node.target]
    x, y = node.args[ix], node.args[iy]
    xl, yl = plan.layouts[x.name], plan.layouts[y.name]
    nd = len(lay.full)
    if len(xl.full) - 1 in xl.sharded or len(yl.full) - 2 in yl.sharded:
        raise Refuse("a batched matmul split along its contracted dim")
    if (nd - 2 in lay.sharded) != (len(xl.full) - 2 in xl.sharded) or \
            (nd - 1 in lay.sharded) != (len(yl.full) - 1 in yl.sharded):
        raise Refuse("a batched matmul whose output is split unlike its operands' rows and columns")
    for a, own in ((x, nd - 2), (y, nd - 1)):
        na = len(shape(a))

        def dim_of(d: int, na: int = na, own: int = own) -> int | None:
            if d >= nd - 2:
                return na - nd + d if d == own else None
            return d - (nd - na)

        al = plan.layouts[a.name]
        if is_sharded(al):
            if any(ad + nd - na not in lay.sharded for ad in al.sharded):
                raise Refuse("a batched matmul's operands are split unlike its output")
            continue
        narrow(plan, node, a, lay, dim_of, grad)
    if iadd is not None:
        a = node.args[iadd]
        narrow(plan, node, a, lay, lambda d, na=len(shape(a)): d - (nd - na), grad)


def repeat_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                grad: frozenset[str], where: str) -> None:
    """Along a sharded dim each rank repeats its own block (key heads r·k/t.. give value
    heads r·v/t..): the same op, its ``output_size`` the local one."""
    xl = plan.layouts[node.args[0].name]
    dim = norm_dim(arg(node, 2, "dim"), len(lay.full))
    if dim not in xl.sharded and dim not in lay.sharded:
        return
    if not (dim in xl.blocks and dim in lay.blocks and lay.shape[dim] == xl.shape[dim] * node.args[1]):
        raise Refuse("repeats a sharded dim into another rank's part")
    if node.kwargs.get("output_size") is not None:
        plan.new_kwargs[node.name] = {**node.kwargs, "output_size": lay.shape[dim]}


def select_scatter_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                        grad: frozenset[str], where: str) -> None:
    dim = norm_dim(node.args[2], len(lay.full))
    if dim in lay.sharded:
        raise Refuse("writes one index of a sharded dim")
    narrow(plan, node, node.args[0], lay, lambda d: d, grad)
    narrow(plan, node, node.args[1], lay, lambda d: None if d == dim else (d if d < dim else d - 1),
           grad)


def like_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
              grad: frozenset[str], where: str) -> None:
    """zeros_like/ones_like/... of a sharded tensor: a constant. When every reader is
    sharded it takes the input's layout (the local op makes the local shape; each rank's
    part of a constant is that constant); else it is spelled with its full size
    (``new_zeros``...), replicated, and sharded readers take their part of it."""

    xl = plan.layouts[node.args[0].name]
    if not isinstance(xl, list) and all(is_sharded(plan.layouts.get(u.name)) for u in node.users):
        plan.layouts[node.name] = xl
        return
    lay = plan.layouts[node.name]
    if is_sharded(lay) or min(lay.full) < 0:
        raise Refuse("a tensor shaped like a shard of data-dependent size, read by replicated ops")
    target, extra = _FULL_SIZE[node.target]
    plan.new_target[node.name] = target
    plan.new_args[node.name] = (node.args[0], list(lay.full), *node.args[1:1 + extra])
    plan.new_kwargs[node.name] = {k: v for k, v in node.kwargs.items()
                                  if k in ("dtype", "layout", "device", "pin_memory")}


def operand(plan: TPPlan, consumer: fx.Node, a: fx.Node, ref: Layout, grad: frozenset[str]) -> None:
    """An input of a sharded consumer, aligned to it by broadcasting."""
    off = len(ref.full) - len(shape(a))
    narrow(plan, consumer, a, ref, lambda d: d - off, grad)


def attention_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                   grad: frozenset[str], where: str) -> None:
    q = plan.layouts[node.args[0].name]
    if not q.is_sharded:
        raise Refuse("keys/values are sharded but queries are not")
    if q.sharded != (1,) or lay.sharded != (1,):
        raise Refuse("attention must be split by heads only")
    for a in node.all_input_nodes[1:]:
        # Keys/values whose channels another reader splits otherwise (Doge's values, read
        # by a projection over all heads, split in tp blocks smaller than a head).
        if is_sharded(plan.layouts[a.name]) and plan.layouts[a.name].sharded != (1,):
            raise Refuse("attention must be split by heads only")
        operand(plan, node, a, lay, grad)


def einsum_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                grad: frozenset[str], where: str) -> None:
    """Like a batched matmul: split letters must be kept in the output (never summed)."""
    subs, out_subs = G.einsum_letters(node)
    for sub, x in zip(subs, node.args[1]):
        al = plan.layouts[x.name]
        if any(sub[d] not in out_subs for d in al.sharded):
            raise Refuse("an einsum sums over a sharded dim")
        if not al.is_sharded:  # its part of each split letter (scatter), or f
            narrow(plan, node, x, lay, lambda d, sub=sub: sub.find(out_subs[d]) if
                   out_subs[d] in sub else None, grad)


def _sharded_dim(plan: TPPlan, node: fx.Node, index: int) -> tuple[Layout, int | None]:
    """The input's layout, and the op's ``dim`` argument (at ``index``) when it is sharded."""
    x = plan.layouts[node.args[0].name]
    dim = norm_dim(arg(node, index, "dim", 0), len(x.full))
    return x, dim if dim in x.sharded else None


def split_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
               grad: frozenset[str], where: str) -> None:
    x, dim = _sharded_dim(plan, node, 2)
    if dim is None:
        return
    sizes, start = [], 0
    for v in G.val(node):
        n = int(v.shape[dim])
        a, b = local_range(x, dim, start, start + n, where, np.zeros(0))
        if a != sum(sizes):
            raise Refuse("split pieces are not consecutive in the shard")
        sizes.append(b - a)
        start += n
    plan.new_target[node.name] = G.aten.split_with_sizes.default
    plan.new_args[node.name] = (node.args[0], sizes, dim)


def slice_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
               grad: frozenset[str], where: str) -> None:
    x, dim = _sharded_dim(plan, node, 1)
    if dim is None:
        return
    step = arg(node, 4, "step", 1)
    start, stop, _ = slice(arg(node, 2, "start"), arg(node, 3, "end")).indices(x.full[dim])
    if step == 1:
        a, b = local_range(x, dim, start, stop, where, np.zeros(0))
        plan.new_args[node.name] = (node.args[0], dim, a, b, 1)
        return
    # x[..., start::step] of a shard (gpt-oss's interleaved gate/up): every rank must take
    # its part at the same local start with the same step.
    found = set()
    for held in x.positions[x.sharded.index(dim)]:
        inside = np.flatnonzero(np.isin(held, np.arange(start, stop, step)))
        if len(inside) == 0 or not np.array_equal(
                inside, np.arange(inside[0], inside[0] + step * len(inside), step)):
            raise Refuse("a strided slice takes an irregular part of the shard")
        found.add((int(inside[0]), len(inside)))
    if len(found) != 1 or x.vocab:
        raise Refuse("a strided slice takes different parts of the shard on different ranks")
    a, n = found.pop()
    plan.new_args[node.name] = (node.args[0], dim, a, a + step * (n - 1) + 1, step)


def index_put_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
                   grad: frozenset[str], where: str) -> None:
    """Operands aligned to the written tensor's layout: a scalar written at a mask that
    addresses no sharded dim."""
    if _indexed_dims(node) & set(lay.sharded):
        raise Refuse("index_put along a sharded dim")
    values = node.args[2]
    if values.meta["val"].numel() != 1:
        raise Refuse("index_put of values that span the sharded dims")
    for a in (node.args[0], values):
        operand(plan, node, a, lay, grad)
