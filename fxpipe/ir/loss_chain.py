"""The ops between an LM head's logits and its cross-entropy, replayed on a block of them.

Defined here, outside the passes, because both sides use them: ``passes/split_loss.py``
and ``passes/vocab_head.py`` record the chain they matched (graph rewrites), and the
runtime's vocabulary passes (``runtime/head_blocks.py``) replay it eagerly on each
rank's block of logits, which the runtime may do without importing a pass.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

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


@dataclass(frozen=True)
class ChainOp:
    """One op between the cat and the loss, replayed on every block's logits."""
    kind: ChainKind
    args: tuple[Any, ...]
    """SLICE: (dim, start, end, step) of a leading dim; RESHAPE: the leading shape;
    CAST: (dtype,); POINTWISE: (ATen op, its arguments after the logits (scalars), its
    keyword arguments as (name, value) pairs)."""


def replay(chain: Sequence[ChainOp], logits: torch.Tensor, width: int) -> torch.Tensor:
    """``chain`` applied to a block of ``width`` logits (the last dim), eagerly."""
    for c in chain:
        if c.kind is ChainKind.SLICE:
            logits = torch.ops.aten.slice.Tensor(logits, *c.args)
        elif c.kind is ChainKind.RESHAPE:
            logits = logits.reshape(*c.args, width)
        elif c.kind is ChainKind.CAST:
            logits = logits.to(c.args[0])
        elif c.kind is ChainKind.POINTWISE:
            op, rest, kwargs = c.args
            logits = op(logits, *rest, **dict(kwargs))
    return logits
