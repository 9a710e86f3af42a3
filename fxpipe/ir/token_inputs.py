"""Which batch inputs are token ids, and the vocabulary each must stay below.

Found from graph structure, never from parameter or module names: an input that
reaches the *indices* of an ``aten.embedding`` op through value-preserving ops
(views, copies) is a token id whose bound is the embedding weight's row count; one
that reaches the *target* of a cross-entropy / NLL loss is a class index bounded by
the logits' class dimension (PyTorch's convention: dim 1, or dim 0 for 1-D input).

Why check at all: an id >= the vocabulary is an ``IndexError`` deep inside the
embedding on one rank, and under tensor parallelism nothing at all — the
vocabulary-parallel embedding (Megatron-LM, Shoeybi et al. 2019 §3) masks ids
outside each rank's slice, so an id past the end reads zeros on every rank and the
job trains silently on wrong embeddings.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from fxpipe.ir.op_tables import VALUE_PRESERVING
from fxpipe.ir.pass_results import TokenInput, TokenRole
from fxpipe.ir.program import Program

aten = torch.ops.aten

_LOSS_TARGETS = {aten.cross_entropy_loss.default: 1, aten.nll_loss_forward.default: 1,
                 aten.nll_loss.default: 1, aten.nll_loss2d_forward.default: 1}
"""Loss op -> position of its class-index target argument (its input is argument 0)."""


def _source_input(node: object, inputs: Sequence[str]) -> int | None:
    """Index of the batch input ``node`` copies values from, or None."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return inputs.index(node.name) if node.name in inputs else None
        if node.op != "call_function" or not node.args:
            return None
        if node.target not in VALUE_PRESERVING and getattr(node.target, "__name__", "") != "getitem":
            return None
        node = node.args[0]
    return None


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def token_inputs(program: Program) -> tuple[TokenInput, ...]:
    """Every (input, bound) pair the graph implies; run on the program *before* tensor
    parallelism (the pass shards embedding rows, and the bound is the full vocabulary)."""
    found: list[TokenInput] = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default:
            weight, indices = node.args[0], node.args[1]
            role, shape = TokenRole.EMBEDDING, _shape(weight)
            rows = shape[0] if shape else None
        elif node.target in _LOSS_TARGETS:
            indices = node.args[_LOSS_TARGETS[node.target]]
            role, shape = TokenRole.LOSS_TARGET, _shape(node.args[0])
            rows = (shape[1] if len(shape) >= 2 else shape[0]) if shape else None
        else:
            continue
        index = _source_input(indices, program.inputs)
        if index is not None and rows is not None:
            found.append(TokenInput(index, rows, role, node.name, program.module_paths.get(node.name, "")))
    return tuple(found)


def check_token_ids(batch: Sequence[torch.Tensor], tokens: Sequence[TokenInput]) -> None:
    """Raise ValueError naming the input, its largest id and the vocabulary when an id
    is out of range (embedding ids also must not be negative; a loss target may be
    negative: the ignore index, -100 by default)."""
    for t in tokens:
        if t.input_index >= len(batch):  # a batch of the wrong arity: the shape check says so
            continue
        x = batch[t.input_index]
        if x.numel() == 0 or x.is_floating_point() or x.device.type == "meta":
            continue
        hi = int(x.max())
        lo = int(x.min()) if t.role is TokenRole.EMBEDDING else 0
        if hi >= t.vocab_size or lo < 0:
            bad = hi if hi >= t.vocab_size else lo
            where = f" ({t.module})" if t.module else ""
            raise ValueError(
                f"batch input {t.input_index} holds token id {bad}, outside the model's vocabulary "
                f"of {t.vocab_size} (ids 0..{t.vocab_size - 1}; it is the {t.role.value} of "
                f"{t.node}{where}); map the data into the vocabulary or build the model with a "
                f"vocabulary of at least {hi + 1}")
