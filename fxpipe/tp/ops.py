"""Tensor-parallel graph ops: Megatron's communication operators as autograd-aware ATen ops.

They are ``torch.library`` custom ops in the ``fxpipe_tp`` namespace, so they sit
in an fx graph like any ATen op (``torch.ops.fxpipe_tp.copy_to_tp.default``),
propagate FakeTensor/meta shapes (cost pass, paper-scale compiles) and are
differentiated by autograd. Each forward reads the group from
:func:`fxpipe.tp.context.current_tp`; ``setup_context`` stores it on ``ctx`` so
backward never needs the context.

Size-dependent ops take ``tp`` as a static argument: shapes are known without a
group, and a group of the wrong size is caught at run time.

| op | forward | backward | source |
|---|---|---|---|
| copy_to_tp | identity | all-reduce | Megatron f (Shoeybi et al. 2019 §3) |
| reduce_from_tp | all-reduce | identity | Megatron g |
| gather_seq | all-gather | reduce-scatter | SP before column-parallel (Korthikanti et al. 2022 §4.2.2) |
| reduce_scatter_seq | reduce-scatter | all-gather | SP after row-parallel |
| scatter | keep own chunk | all-gather | replicated -> sharded (split) |
| gather | all-gather | keep own chunk | sharded -> replicated consumer |

Identity forwards return a copy: custom ops may not alias their inputs.

Every backward is itself one of these ops (f <-> g, gather_seq <-> reduce_scatter_seq,
scatter <-> gather), called with ``ctx.group`` made current: eager backward behaves as
before, and AOTAutograd (``parallelize(inductor=True)``, ``fxpipe/runtime/compiled.py``)
traces it into the compiled backward graph as an opaque op that reads the group current
when that graph runs (the StageRunner enters the TP context around every backward).
"""
from __future__ import annotations

import torch

from fxpipe.tp.context import current_tp, current_tp_or_none, tp_group_context
from fxpipe.tp.group import ReduceOp, TPGroup

NS = "fxpipe_tp"


def _group(tp: int | None = None) -> TPGroup:
    group = current_tp().group
    if tp is not None and group.size != tp:
        raise RuntimeError(f"the graph was compiled for tp={tp} but runs in a TP group of size "
                           f"{group.size}; compile with tp={group.size} or build a group of {tp}")
    return group


def _save_group(ctx, inputs, output) -> None:
    ctx.group = _group()


def _save_group_dim(ctx, inputs, output) -> None:
    ctx.group = _group()
    ctx.dim, ctx.tp = inputs[1], inputs[2]


def _in_group(ctx, op, *args) -> torch.Tensor:
    """``op(*args)`` with the group forward saw made current (eager backward may run
    outside any context, e.g. on autograd's device thread). Under AOTAutograd this
    runs at trace time and only records ``op``; the context is re-read at run time."""
    current = current_tp_or_none()
    rng = current.rng if current is not None and current.group is ctx.group else None
    with tp_group_context(ctx.group, rng):
        return op(*args)


def _chunk(t: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    size = t.shape[dim] // group.size
    return t.narrow(dim, group.rank * size, size).clone()


# ---- f and g (Megatron §3) -------------------------------------------------------------
@torch.library.custom_op(f"{NS}::copy_to_tp", mutates_args=())
def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """f: identity forward; backward all-reduces the gradient over the TP group."""
    _group()
    return x.clone()


@copy_to_tp.register_fake
def _(x):
    return torch.empty_like(x)


copy_to_tp.register_autograd(lambda ctx, g: _in_group(ctx, reduce_from_tp, g), setup_context=_save_group)


@torch.library.custom_op(f"{NS}::reduce_from_tp", mutates_args=())
def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    """g: all-reduce forward (sums row-parallel partial results); identity backward."""
    return _group().all_reduce(x)


@reduce_from_tp.register_fake
def _(x):
    return torch.empty_like(x)


reduce_from_tp.register_autograd(lambda ctx, g: g, setup_context=_save_group)


@torch.library.custom_op(f"{NS}::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """All-reduce MAX, no gradient (vocab-parallel cross-entropy's logit max)."""
    return _group().all_reduce(x, ReduceOp.MAX)


@all_reduce_max.register_fake
def _(x):
    return torch.empty_like(x)


# ---- sequence parallelism (Korthikanti et al. 2022) and split/gather ------------------------
@torch.library.custom_op(f"{NS}::gather_seq", mutates_args=())
def gather_seq(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """All-gather forward / reduce-scatter backward: a sequence shard entering a
    column-parallel projection, whose input gradient is a partial sum per rank."""
    return _group(tp).all_gather(x, dim)


@torch.library.custom_op(f"{NS}::reduce_scatter_seq", mutates_args=())
def reduce_scatter_seq(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """Reduce-scatter forward / all-gather backward: a row-parallel partial result
    leaving as a sequence shard (replaces g under sequence parallelism)."""
    return _group(tp).reduce_scatter(x, dim)


@torch.library.custom_op(f"{NS}::scatter", mutates_args=())
def scatter(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """Keep this rank's contiguous chunk of a replicated tensor; backward all-gathers
    (each rank owns the gradient of its chunk). Megatron's scatter_to_*_region."""
    return _chunk(x, dim, _group(tp))


@torch.library.custom_op(f"{NS}::gather", mutates_args=())
def gather(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """All-gather forward; backward keeps this rank's chunk: the consumer is
    replicated, so its gradient is already complete on every rank."""
    return _group(tp).all_gather(x, dim)


def _fake_concat(x, dim, tp):
    """Shape of the tp slices concatenated along ``dim`` (all-gather)."""
    shape = list(x.shape)
    shape[dim] *= tp
    return x.new_empty(shape)


def _fake_split(x, dim, tp):
    """Shape of this rank's 1/tp slice along ``dim`` (reduce-scatter and scatter alike)."""
    shape = list(x.shape)
    shape[dim] //= tp
    return x.new_empty(shape)


def _register_dim_op(op, fake, grad_op) -> None:
    """``op(x, dim, tp)``'s shape rule, and its backward: ``grad_op`` on the gradient along
    the same dim, in the group forward ran in (``dim`` and ``tp`` take no gradient)."""
    op.register_fake(fake)
    op.register_autograd(lambda ctx, g: (_in_group(ctx, grad_op, g, ctx.dim, ctx.tp), None, None),
                         setup_context=_save_group_dim)


# Each op's backward is its partner's forward (the module docstring's table).
for _op, _fake, _grad_op in ((gather_seq, _fake_concat, reduce_scatter_seq),
                             (reduce_scatter_seq, _fake_split, gather_seq),
                             (scatter, _fake_split, gather),
                             (gather, _fake_concat, scatter)):
    _register_dim_op(_op, _fake, _grad_op)
del _op, _fake, _grad_op


# ---- rank-dependent helpers (no gradient) ---------------------------------------------------
@torch.library.custom_op(f"{NS}::rank_offset", mutates_args=())
def rank_offset(like: torch.Tensor, stride: int) -> torch.Tensor:
    """``tp_rank * stride`` as a 0-d int64 tensor on ``like``'s device: the first
    vocabulary index this rank owns when every rank holds ``stride`` rows."""
    return torch.tensor(_group().rank * stride, dtype=torch.int64, device=like.device)


@rank_offset.register_fake
def _(like, stride):
    return like.new_empty((), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::dropout_mask", mutates_args=())
def dropout_mask(x: torch.Tensor, p: float, sharded: bool) -> torch.Tensor:
    """Keep-mask scaled by 1/(1-p), drawn from the replicated or the per-rank stream."""
    gen = current_tp().rng.generator(x.device, sharded)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=gen)
    return keep.div_(1.0 - p)


@dropout_mask.register_fake
def _(x, p, sharded):
    return x.new_empty(x.shape)


# ---- composites: differentiated through their parts -----------------------------------------
def _define(schema: str, fn) -> None:
    name = schema.split("(", 1)[0]
    torch.library.define(f"{NS}::{name}", schema[len(name):])
    torch.library.impl(f"{NS}::{name}", "CompositeImplicitAutograd", fn)


def _dropout(x: torch.Tensor, p: float, sharded: bool) -> torch.Tensor:
    return x * torch.ops.fxpipe_tp.dropout_mask(x.detach(), p, sharded)


def _vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    # Megatron's VocabParallelEmbedding (Shoeybi et al. 2019 §3): this rank holds rows
    # [start, start + rows); ids outside look up row 0 and their output is zeroed.
    # The result is a partial sum: the all-reduce (or SP reduce-scatter) is a separate node.
    rows = weight.shape[0]
    local = ids - torch.ops.fxpipe_tp.rank_offset(weight, rows)
    inside = (local >= 0) & (local < rows)
    out = torch.embedding(weight, torch.where(inside, local, 0))
    out = torch.where(inside.unsqueeze(-1), out, 0.0)
    if padding_idx >= 0:  # nn.Embedding(padding_idx=...): that row receives no gradient
        out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return out


def _vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                  ignore_index: int, reduction: int) -> torch.Tensor:
    # Megatron's vocab_parallel_cross_entropy: all-reduce MAX of the logit max, SUM of
    # the target logit and SUM of the exp-sums; full logits are never gathered. The
    # sums go through g (identity backward), so backward needs no communication.
    cols = logits.shape[-1]
    start = torch.ops.fxpipe_tp.rank_offset(logits, cols)
    index = torch.arange(cols, device=logits.device) + start
    logits = logits.masked_fill(index >= vocab_size, float("-inf"))  # padding never wins
    top = torch.ops.fxpipe_tp.all_reduce_max(logits.detach().amax(dim=-1))
    shifted = logits - top.unsqueeze(-1)
    local = target - start
    inside = (local >= 0) & (local < cols)
    picked = shifted.gather(-1, torch.where(inside, local, 0).unsqueeze(-1)).squeeze(-1)
    picked = torch.ops.fxpipe_tp.reduce_from_tp(torch.where(inside, picked, 0.0))
    sum_exp = torch.ops.fxpipe_tp.reduce_from_tp(shifted.exp().sum(dim=-1))
    valid = target != ignore_index
    loss = torch.where(valid, sum_exp.log() - picked, 0.0)
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / valid.sum()


_define("dropout(Tensor x, float p, bool sharded) -> Tensor", _dropout)
_define("vocab_parallel_embedding(Tensor weight, Tensor ids, int padding_idx) -> Tensor",
        _vocab_parallel_embedding)
_define("vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_size, "
        "int ignore_index, int reduction) -> Tensor", _vocab_parallel_cross_entropy)

OPS = torch.ops.fxpipe_tp
