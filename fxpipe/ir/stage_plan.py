"""The pipeline plan: one GraphModule per stage and the tensors that cross between them.

Built by ``fxpipe.passes.split.split_pass`` from a Program whose nodes carry a
stage index; read by the runtime, which never looks at the full graph again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.base.dtypes import itemsize
from fxpipe.ir.loss_chain import operand_params
from fxpipe.ir.program import Program, TensorSpec
from fxpipe.ir.shard_spec import PipelineRows


@dataclass(frozen=True)
class StageValue:
    """A tensor produced by one stage and consumed by later ones (per microbatch)."""
    name: str
    """Name of the producing node in the full graph."""
    producer: int
    consumers: tuple[int, ...]
    """Every later stage that reads it; each gets its own direct transfer (skip
    connections across several stages are sent straight to their consumer)."""
    spec: TensorSpec
    requires_grad: bool
    """Whether a gradient flows back for it (False for integer or detached values)."""
    tp_replicated: bool = False
    """Value and gradient identical on every tensor-parallel rank: scatter-gather may
    send each rank's 1/t chunk and all-gather on arrival (SC21 §4.1)."""
    stride: tuple[int, ...] | None = None
    """The producer's strides when they are not row-major (a transposed attention
    output, a slice of a fused QKV projection); None for contiguous values. The consumer's graph may rely
    on it — export drops a ``contiguous()`` that was a no-op at capture, so a ``view``
    can follow a ``transpose`` — so the receiver restores it."""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.spec.shape:
            n *= d
        return n * itemsize(self.spec.dtype)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a model chunk).

    Its GraphModule takes, in order: the parameters/buffers named in ``params``
    (by their original names; tied members read the group's tensor), the batch
    items listed in ``batch_inputs``, the received values named in ``inputs``, and
    the summed embedding lookups named in ``lookups``.
    It returns the values named in ``outputs``, then the loss if ``is_last``.
    """
    index: int
    graph_module: fx.GraphModule
    params: tuple[str, ...]
    batch_inputs: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    is_last: bool
    num_nodes: int
    """Compute nodes assigned to this stage (recomputed side values excluded)."""
    buffer_updates: tuple[str, ...] = ()
    """Buffers (names as in ``params``) whose new values the graph returns after the
    sent values and before the loss; the runner writes them back after each forward."""
    lookups: tuple[str, ...] = ()
    """Embedding lookups of a row-split table (``VocabLookup.name``) the graph takes after
    the received values: the runtime sums the owners' partial lookups into them."""

    def call(self, state: Mapping[str, torch.Tensor], canonical: Mapping[str, str],
             batch: Sequence[torch.Tensor], received: Mapping[str, torch.Tensor],
             fn: Callable | None = None) -> tuple:
        """Run the stage; ``fn`` replaces the GraphModule with a function of the same
        arguments and results (the compiled stage, ``fxpipe/runtime/compiled.py``)."""
        args = [state[canonical[p]] for p in self.params]
        args += [batch[i] for i in self.batch_inputs]
        args += [received[n] for n in (*self.inputs, *self.lookups)]
        out = (fn or self.graph_module)(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


LOOKUP_PARTS_AHEAD = 2
"""How many microbatches ahead of the consuming stage's forward an owner of embedding rows
sends its part of the lookup (``runtime/lookup_exchange.py``): one ahead, placed on a
unit-time simulation, arrived late under real times (the owner still busy with an S or
T pass when the consumer's forward wanted it); each part more ahead is one more b·s·h
held per owner (``planner/memory_model.py``'s ``lookup_activation_bytes``)."""


@dataclass(frozen=True)
class VocabLookup:
    """An embedding lookup of a table whose rows are split over pipeline ranks
    (``passes/outline_lookups.py``): every rank holding rows of ``table`` looks the
    microbatch's token ids up in its own rows (zeros for ids it does not own), the
    partial results are summed onto the rank of ``stage``, which reads the sum as its
    input ``name``; in backward the gradient of that input goes back to every owner,
    which builds the gradient of its rows only (Megatron's vocabulary-parallel
    embedding, over pipeline ranks instead of tensor-parallel ones)."""
    name: str
    """The embedding node's name: the stage input the lookup's result feeds."""
    table: str
    """Canonical name of the table (a key of ``PipelinePlan.row_shards``)."""
    stage: int
    """The stage that reads the result."""
    batch_input: int
    """Position in the microbatch of the tensor the ids are read from."""
    ids: fx.GraphModule
    """That batch tensor -> the token ids (the value-preserving views between them)."""
    spec: TensorSpec
    """Shape and dtype of the result (one microbatch)."""
    padding_idx: int = -1
    """The embedding's padding row (its gradient stays zero); -1: none."""
    vocab_parallel: bool = False
    """The lookup was tensor-parallel (``fxpipe_tp.vocab_parallel_embedding``): the table's
    rows are one TP rank's, token t is row t - tp_rank·rows of them, and the result is
    that rank's partial sum (the stage sums it over the TP group, as before)."""


@dataclass(frozen=True)
class VocabHead:
    """The LM head and its cross-entropy, cut off the last stage and run by every
    pipeline rank on its block of the vocabulary (``passes/vocab_head.py``,
    ``runtime/head_blocks.py``): the schedule's BCAST_H / S / ALLREDUCE_S / T / REDUCE_G.
    The last stage outputs ``hidden`` (the head's input) and ``target`` instead of the loss."""
    weight: str
    """Canonical name of the head's weight [V, h] (a key of ``PipelinePlan.row_shards``:
    rank r holds block r of its rows)."""
    hidden: str
    """The last stage's output value the head reads (``x`` of ``linear(x, W)``)."""
    target: str
    """The last stage's output value holding the cross-entropy's class indices."""
    chain: tuple
    """The ops between the head's output and the cross-entropy's 2-D logits
    (``split_loss.ChainOp``), replayed on each block's logits."""
    reduction: int
    """``split_loss.Reduction``: MEAN, SUM, or NONE with ``token_weight``."""
    ignore_index: int
    blocks: tuple[tuple[int, int], ...]
    """Per pipeline rank, the vocabulary rows [start, stop) of its block (of the weight's
    tensor-parallel local rows under tp > 1)."""
    bias: str | None = None
    """Canonical name of the head's bias [V] (``nn.Linear(h, V, bias=True)``), split into
    the same blocks of rows as ``weight``; None: the head has none."""
    token_weight: str | None = None
    """With reduction NONE: the last stage's output value holding each token's weight in
    the loss, which is Σ_t weight_t·ce_t (per-token losses reduced with a loss mask,
    ``passes/token_weights.py``); None: the reduction alone."""
    vocab_size: int | None = None
    """Under tensor parallelism (the loss was ``fxpipe_tp.vocab_parallel_cross_entropy``):
    the unpadded vocabulary; TP rank t's rows are classes t·rows.. of it, padding rows are
    masked, and the softmax statistics are reduced over the TP group too. None: tp = 1."""

    @property
    def outputs(self) -> tuple[str, ...]:
        """The last stage's outputs the head reads, in order: hidden, target[, token_weight]."""
        return (self.hidden, self.target) + ((self.token_weight,) if self.token_weight is not None else ())

    @property
    def params(self) -> tuple[str, ...]:
        """The head's parameters, each split into ``blocks`` of rows: weight, bias, then
        the parameters [V] the chain's element-wise ops read (``loss_chain.VocabOperand``)."""
        return (self.weight,) + ((self.bias,) if self.bias is not None else ()) + operand_params(self.chain)


@dataclass(frozen=True)
class PipelinePlan:
    program: Program
    """The Program the stages were cut from (annotated with ``stages``)."""
    stages: tuple[Stage, ...]
    values: Mapping[str, StageValue]
    tied_stages: Mapping[str, tuple[int, ...]]
    """Canonical name of each tied group, and of every trainable parameter read by more
    than one stage (a module applied in several places), -> the stages holding a copy.
    When there is more than one, the runtime all-reduces its gradient over them
    (Megatron's embedding group)."""
    param_stages: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Canonical parameter name -> stages that use it."""
    row_shards: Mapping[str, PipelineRows] = field(default_factory=dict)
    """Parameters whose rows are split over pipeline ranks (``passes/vocab_rows.py``):
    each rank holds, updates and checkpoints only its rows, and its stage graphs index
    them; the gradient of rows held by several ranks is summed range by range. Such a
    name is not in ``tied_stages``."""
    lookups: tuple[VocabLookup, ...] = ()
    """Embedding lookups of row-split tables done by the rows' owners (``VocabLookup``)."""
    vocab_head: VocabHead | None = None
    """The LM head run as vocabulary passes on every rank (``ParallelConfig.vocab_passes``)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def canonical(self) -> dict[str, str]:
        return {p.name: p.canonical for p in self.program.params}

    def rank_params(self, pp_rank: int, stages: Sequence[int]) -> tuple[str, ...]:
        """Canonical names of the tensors pipeline rank ``pp_rank`` (running ``stages``)
        holds: its stages' and the tables of which it owns rows for a lookup."""
        names = dict.fromkeys(n for s in stages for n in self.stage_params(s))
        names.update(dict.fromkeys(lk.table for lk in self.lookups if self.row_shards[lk.table].ranks[pp_rank]))
        if self.vocab_head is not None:  # its block of the head, run by the vocabulary passes
            names.update(dict.fromkeys(self.vocab_head.params))
        return tuple(names)

    def stage_params(self, stage: int) -> tuple[str, ...]:
        """Canonical names of the tensors a stage holds (each once)."""
        canon = self.canonical
        return tuple(dict.fromkeys(canon[p] for p in self.stages[stage].params))
