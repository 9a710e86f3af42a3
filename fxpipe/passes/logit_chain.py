"""The LM head's logits to their cross-entropy: what may sit between, found by data flow.

One finder for both passes that split the output layer over the vocabulary, the
blockwise loss (``split_loss.py``) and the vocabulary passes (``vocab_head.py``):

    logits → [slice of a leading dim | reshape keeping the last dim |
    alias / clone / contiguous | cast to the same dtype or up to fp32 |
    element-wise op]* → cross_entropy_loss
    (or _log_softmax(-1) → nll_loss_forward / nll_loss_nd / nll_loss)

with 2-D logits, no class weights and no label smoothing; reduction none / mean
(over non-ignored targets) / sum, and ``ignore_index``. Each op keeps every logit in
its vocabulary column, so it commutes with cutting the vocabulary into blocks and each
block replays it (``ir/loss_chain.py``). An element-wise op (ATen's ``pointwise`` tag,
no random number) qualifies when its other arguments are scalars (a softcap
``c·tanh(l / c)``, a temperature ``l / T``) or, where the caller tells trainable
parameters, a parameter [V] read nowhere else, through casts and element-wise ops
with scalars (a bias added after the head, a learnable per-class logit scale): a
block reads its rows of it, so the parameter is split with the head's.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fxpipe.ir.loss_chain import ChainKind, ChainOp, Reduction, Slot, VocabOperand
from fxpipe.tp.ops import OPS

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
_IDENTITY = (aten.alias.default, aten.clone.default, aten.contiguous.default)
_CASTS = (aten._to_copy.default, aten.to.dtype)
_NLL = (aten.nll_loss_forward.default, aten.nll_loss_nd.default, aten.nll_loss.default)
_LOG_SOFTMAX = (aten._log_softmax.default, aten.log_softmax.int)
_SCALAR = (int, float, bool, type(None))
IsParam = Callable[[fx.Node], bool]


@dataclass(frozen=True)
class LossMatch:
    chain: tuple[ChainOp, ...]
    removed: tuple[fx.Node, ...]
    """Nodes the rewrite makes dead, each after the nodes it reads (cat or linear first)."""
    loss: fx.Node
    """The node whose value the new loss replaces."""
    target: fx.Node
    reduction: Reduction
    ignore_index: int
    vocab_size: int | None = None
    """The vocabulary-parallel cross-entropy's (unpadded) vocabulary: the logits are one
    tensor-parallel rank's columns. None: an ATen cross-entropy of whole logits."""
    operands: tuple[fx.Node, ...] = ()
    """The parameters the chain's ``VocabOperand``s read (placeholders, not in ``removed``)."""


def _bound(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


@dataclass(frozen=True)
class _Step:
    op: ChainOp
    before: tuple[fx.Node, ...] = ()
    """Operand nodes the op reads that go with it (in graph order)."""
    params: tuple[fx.Node, ...] = ()


def _chain_op(cur: fx.Node, user: fx.Node, is_param: IsParam | None) -> _Step | None:
    """The step ``user`` applies to ``cur`` if it commutes with cutting the last dim,
    None when it does not."""
    vin, vout = cur.meta["val"], user.meta["val"]
    if not isinstance(vout, torch.Tensor) or vout.dim() == 0:
        return None
    if user.args[0] is not cur:
        return _pointwise(cur, user, is_param)
    if user.target is aten.slice.Tensor:
        a = _bound(user)
        dim = a["dim"] % vin.dim()
        if dim == vin.dim() - 1:
            return None
        return _Step(ChainOp(ChainKind.SLICE, (dim, a["start"], a["end"], a["step"])))
    if user.target in _RESHAPES and vout.shape[-1] == vin.shape[-1]:
        # Rows stay rows when the last dim is kept: any regrouping of leading dims.
        return _Step(ChainOp(ChainKind.RESHAPE, tuple(int(d) for d in vout.shape[:-1])))
    if user.target in _IDENTITY and vout.shape == vin.shape:
        return _Step(ChainOp(ChainKind.IDENTITY, ()))
    if user.target in _CASTS and vout.device == vin.device and vout.shape == vin.shape and \
            (vout.dtype == vin.dtype or (vout.dtype == torch.float32 and vin.dtype.is_floating_point)):
        return _Step(ChainOp(ChainKind.CAST, (vout.dtype,)))
    return _pointwise(cur, user, is_param)


def _elementwise(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and \
        all(isinstance(v, _SCALAR) for v in node.kwargs.values())


def _pointwise(cur: fx.Node, user: fx.Node, is_param: IsParam | None) -> _Step | None:
    """``user`` as an element-wise op of ``cur`` (once) and scalars or vocabulary operands:
    each output logit reads the same column of its inputs, so a block's results are the
    whole's at the block's columns."""
    vin, vout = cur.meta["val"], user.meta["val"]
    shape = _static(vin)
    if shape is None or not _elementwise(user) or _static(vout) != shape or vout.dtype != vin.dtype or \
            sum(a is cur for a in user.args) != 1:
        return None
    args, before, params = [], [], []
    for a in user.args:
        if a is cur:
            args.append(Slot.VALUE)
        elif isinstance(a, _SCALAR):
            args.append(a)
        elif isinstance(a, fx.Node) and is_param is not None and (found := _operand(a, shape[-1], is_param)):
            param, ops, chain = found
            args.append(VocabOperand(param.name, chain))
            before += ops
            params.append(param)
        else:
            return None
    return _Step(ChainOp(ChainKind.POINTWISE, (user.target, tuple(args), tuple(user.kwargs.items()))),
                 tuple(before), tuple(params))


def _static(value) -> tuple[int, ...] | None:
    """A tensor value's shape when every size is a number (None: a data-dependent size,
    which no head has, or no tensor): compared without guarding on a symbol."""
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _operand(node: fx.Node, vocab: int, is_param: IsParam):
    """``node`` as a function of one trainable parameter [``vocab``] alone, read nowhere
    else: (the parameter, the ops from it to ``node`` in graph order, their ChainOps), or None."""
    if _static(node.meta.get("val")) != (vocab,):
        return None
    ops, cur = [], node
    while cur.op == "call_function":
        if len(cur.users) != 1 or not isinstance(cur.args[0], fx.Node) or not (
                cur.target in _CASTS or _elementwise(cur) and all(isinstance(a, _SCALAR) for a in cur.args[1:])):
            return None
        ops.append(cur)
        cur = cur.args[0]
    if cur.op != "placeholder" or not is_param(cur) or len(cur.users) != 1 or _static(cur.meta.get("val")) != (vocab,):
        return None
    ops.reverse()
    chain = tuple(ChainOp(ChainKind.CAST, (n.meta["val"].dtype,)) if n.target in _CASTS else
                  ChainOp(ChainKind.POINTWISE, (n.target, (Slot.VALUE, *n.args[1:]), tuple(n.kwargs.items())))
                  for n in ops)
    return cur, ops, chain


def _walk(cat: fx.Node, is_param: IsParam | None = None):
    """Follow ``cat``'s logits through chain ops while each value has one reader:
    (the ops to replay, the nodes passed, the operands' parameters, the last value)."""
    cur, chain, removed, params = cat, [], [cat], []
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        step = _chain_op(cur, user, is_param)
        if step is None:
            break
        if step.op.kind is not ChainKind.IDENTITY:
            chain.append(step.op)
        removed += [*step.before, user]
        params += step.params
        cur = user
    return chain, removed, params, cur


def blocking_op(cat: fx.Node, is_param: IsParam | None = None) -> str:
    """What stops ``cat``'s logits from reaching a cross-entropy ``match_loss`` takes, in
    words naming the op: for an error message."""
    cur = _walk(cat, is_param)[-1]
    readers = sorted(str(u.target) for u in cur.users)
    if len(readers) != 1:
        return f"the logits ({cur.target}) are read by {len(readers)} ops ({', '.join(readers) or 'none'})"
    logits, reader = cur.meta["val"], next(iter(cur.users))
    if logits.dim() != 2 and reader.target in (aten.cross_entropy_loss.default, *_LOG_SOFTMAX):
        return f"the logits reach {readers[0]} as a {logits.dim()}-D tensor (2-D [tokens, V] wanted)"
    return f"the logits reach {readers[0]}, which is no element-wise op of the logits and scalars (or of a " \
           f"parameter [V] read only there), slice or reshape of leading dims, cast, nor a cross-entropy " \
           f"without class weights or label smoothing"


def match_loss(cat: fx.Node, vocab_parallel: bool = False, is_param: IsParam | None = None) -> LossMatch | None:
    """The cross-entropy that ``cat``'s logits reach through a chain of ChainOps. With
    ``vocab_parallel``, also the tensor-parallel pass's vocabulary-parallel cross-entropy
    (``fxpipe_tp.vocab_parallel_cross_entropy``; the vocabulary passes run it per block,
    the blockwise loss does not). ``is_param`` tells a trainable parameter an operand may
    read (None: scalar operands only)."""
    chain, removed, params, cur = _walk(cat, is_param)
    if len(cur.users) != 1:
        return None
    user = next(iter(cur.users))
    logits = cur.meta["val"]
    if logits.dim() != 2:
        return None
    if user.target is aten.cross_entropy_loss.default:
        a = _bound(user)
        if a["self"] is not cur or a["weight"] is not None or a["label_smoothing"] != 0.0:
            return None
        loss, target = user, a["target"]
        removed.append(user)
    elif vocab_parallel and user.target is OPS.vocab_parallel_cross_entropy.default:
        logits_arg, target, vocab_size, ignore_index, reduction = user.args
        if logits_arg is not cur or tuple(target.meta["val"].shape) != (logits.shape[0],):
            return None
        return LossMatch(chain=tuple(chain), removed=(*removed, user), loss=user, target=target,
                         reduction=Reduction(reduction), ignore_index=int(ignore_index), vocab_size=int(vocab_size),
                         operands=tuple(params))
    elif user.target in _LOG_SOFTMAX and user.args[1] in (-1, 1) and len(user.users) == 1:
        ls = _bound(user)
        if ls.get("half_to_float") or ls.get("dtype") is not None:
            return None
        nll = next(iter(user.users))
        if nll.target not in _NLL:
            return None
        a = _bound(nll)
        if a["self"] is not user or a["weight"] is not None:
            return None
        removed += [user, nll]
        loss, target = nll, a["target"]
        if nll.target is aten.nll_loss_forward.default:  # (output, total_weight)
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in nll.users) or len(nll.users) != 1:
                return None
            loss = next(iter(nll.users))
            removed.append(loss)
    else:
        return None
    if tuple(target.meta["val"].shape) != (logits.shape[0],):
        return None
    return LossMatch(chain=tuple(chain), removed=tuple(removed), loss=loss, target=target,
                     reduction=Reduction(a["reduction"]), ignore_index=int(a["ignore_index"]), operands=tuple(params))
