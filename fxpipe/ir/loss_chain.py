"""The ops between an LM head's logits and its cross-entropy, replayed on a block of them.

Defined here, outside the passes, because both sides use them: ``passes/split_loss.py``
and ``passes/vocab_head.py`` record the chain they matched (graph rewrites), and the
runtime's vocabulary passes (``runtime/head_blocks.py``) replay it eagerly on each
rank's block of logits, which the runtime may do without importing a pass.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch


class Reduction(enum.IntEnum):
    """ATen's reduction codes (``at::Reduction``)."""
    NONE = 0
    MEAN = 1
    SUM = 2


class ChainKind(enum.Enum):
    SLICE = "slice"
    RESHAPE = "reshape"
    CAST = "cast"
    POINTWISE = "pointwise"
    """An element-wise function of each logit alone (softcap ``c·tanh(l / c)``, a
    temperature ``l / T``): it commutes with cutting the vocabulary into blocks."""
    IDENTITY = "identity"
    """alias / clone / contiguous: nothing to replay."""


class Slot(enum.Enum):
    VALUE = "value"
    """Where the chained value (the logits, or an operand's parameter) goes among an
    element-wise op's arguments."""


@dataclass(frozen=True)
class VocabOperand:
    """An element-wise op's operand that varies along the vocabulary only: a trainable
    parameter [V] (a bias added after the head, a learnable per-class logit scale)
    through ``chain`` (casts, element-wise ops with scalars). Each block reads its rows."""
    param: str
    """The parameter: its graph node's name where a pass matched it, its canonical name
    in ``VocabHead.chain``."""
    chain: tuple["ChainOp", ...]


@dataclass(frozen=True)
class ChainOp:
    """One op between the cat and the loss, replayed on every block's logits."""
    kind: ChainKind
    args: tuple[Any, ...]
    """SLICE: (dim, start, end, step) of a leading dim; RESHAPE: the leading shape;
    CAST: (dtype,); POINTWISE: (ATen op, its arguments (``Slot.VALUE`` for the logits, a
    scalar, or a ``VocabOperand``), its keyword arguments as (name, value) pairs)."""


def operand_params(chain: Sequence[ChainOp]) -> tuple[str, ...]:
    """The parameters the chain's operands read, in order."""
    return tuple(a.param for c in chain if c.kind is ChainKind.POINTWISE for a in c.args[1]
                 if isinstance(a, VocabOperand))


def replay(chain: Sequence[ChainOp], logits: torch.Tensor, width: int,
           operands: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``chain`` applied to a block of ``width`` logits (the last dim), eagerly;
    ``operands``: each ``VocabOperand`` parameter's rows of the block."""
    for c in chain:
        if c.kind is ChainKind.SLICE:
            logits = torch.ops.aten.slice.Tensor(logits, *c.args)
        elif c.kind is ChainKind.RESHAPE:
            logits = logits.reshape(*c.args, width)
        elif c.kind is ChainKind.CAST:
            logits = logits.to(c.args[0])
        elif c.kind is ChainKind.POINTWISE:
            op, args, kwargs = c.args
            args = [logits if a is Slot.VALUE else
                    replay(a.chain, operands[a.param], width) if isinstance(a, VocabOperand) else a for a in args]
            logits = op(*args, **dict(kwargs))
    return logits
