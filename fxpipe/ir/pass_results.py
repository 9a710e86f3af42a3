"""What the passes find and record on the Program, typed (one field each): defined in the
IR, below every pass, so that the Program and the artifact can name them without
importing the passes that write them."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.ir.loss_chain import ChainOp
from fxpipe.ir.shard_spec import ShardSpec
from fxpipe.schedules.simulate import StageDurations


@dataclass(frozen=True)
class ModelStats:
    """Whole-model numbers, counted before tensor parallelism shards the graph."""
    num_parameters: int
    flops_per_step: int
    """Model FLOPs of one step over the global batch: matmul forward + backward, the
    quantity of Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) (no recomputation)."""


@dataclass(frozen=True)
class MatmulBlock:
    """One block of a split matmul's output features."""
    start: int
    """First output feature of the block."""
    end: int
    """One past its last output feature."""
    output: str
    """The block's matmul node."""
    nodes: tuple[str, ...]
    """Every node built for the block: weight (and bias) slice, then the matmul."""


@dataclass(frozen=True)
class MatmulSplit:
    """One matmul cut into output-feature blocks: what rebuilding any range needs."""
    target: Any
    """aten.linear / aten.addmm / aten.mm."""
    x: str
    """The matmul's input node."""
    weight: str
    """The weight's node, sliced along ``weight_dim`` per block."""
    bias: str | None
    """The bias's node; None without one."""
    weight_dim: int
    """The weight's output-feature dim: 0 for linear ([out, in]), 1 for addmm / mm ([in, out])."""
    kwargs: tuple[tuple[str, Any], ...]
    key: str
    """Module path of the op that was cut; block i of k is keyed ``key[i/k]``."""
    blocks: tuple[MatmulBlock, ...]
    """In output-feature order."""


@dataclass(frozen=True)
class LossBlock:
    """One block's share of the loss, folded into the running (lse, pick) of the blocks
    before it."""
    logits: str
    """The block's matmul node (``MatmulBlock.output``)."""
    acc: str
    """(2, N): [logsumexp, target logit] over this block and all blocks before it."""
    nodes: tuple[str, ...]
    """Every node built for the block, the replayed chain first, ``acc`` last."""


@dataclass(frozen=True)
class BlockwiseLoss:
    """A cross-entropy rewritten over the blocks of one split matmul."""
    chain: tuple[ChainOp, ...]
    target: str
    blocks: tuple[LossBlock, ...]
    """In block order; the last block's ``acc`` feeds the loss."""
    replaced: tuple[str, ...] = ()
    """The captured nodes the blocks stand in for (the logits' cat, the chain, the loss):
    a timing of the capture prices the blocks by theirs (``costs.local.node_times_for``)."""


@dataclass(frozen=True)
class RecomputeRegion:
    """One outlined region: what it holds and what crosses its boundary."""
    name: str
    """Name of its submodule and of the call node that replaced it."""
    nodes: tuple[str, ...]
    """Original node names, in graph order (they keep these names inside the body)."""
    layer: int
    """The layer index its nodes carry from capture."""
    mode: RecomputeMode
    """What its backward re-runs (``RecomputeMode``)."""
    inputs: tuple[str, ...]
    """Values the forward keeps for backward (parameters among them cost nothing)."""
    outputs: tuple[str, ...]
    """Values its body returns to the rest of the graph."""


@dataclass(frozen=True)
class ExpertLayer:
    layer: int
    """Index among the graph's grouped MoEs (the key of the tokens-per-expert counts)."""
    experts: int
    params: tuple[str, ...]
    """Canonical names of its stacked expert weights."""
    dispatch: str
    """Node that dispatches its tokens."""


@dataclass(frozen=True)
class EPResult:
    ep: int
    layers: tuple[ExpertLayer, ...]
    specs: dict[str, ShardSpec]
    """Canonical name -> which experts each expert-parallel rank holds (dim 0 ranges)."""
    skipped: tuple[str, ...] = ()
    """Grouped matmuls left data-parallel, each with why."""

    @property
    def expert_params(self) -> frozenset[str]:
        return frozenset(self.specs)


class TokenRole(enum.Enum):
    EMBEDDING = "embedding index"
    LOSS_TARGET = "loss target"


@dataclass(frozen=True)
class TokenInput:
    """A batch input whose values index a table of ``vocab_size`` rows."""
    input_index: int
    """Position in the batch (``example_inputs`` order)."""
    vocab_size: int
    role: TokenRole
    node: str
    """The embedding or loss node, for messages."""
    module: str = ""
    """Module path of that node ('' when outside any submodule)."""


@dataclass(frozen=True)
class VocabTiming:
    """What the vocabulary passes are placed on, in seconds per microbatch."""
    durations: StageDurations
    """Each stage's F, B and W without the head (W: half of B, as ``StageDurations.uniform``),
    and per pp rank its S and T: 1/pp of the head's forward and backward."""
    p2p_latency: float
    """A stage-boundary transfer: the head's hidden state over the link."""
    collective_latency: tuple[float, float, float]
    """BCAST_H, ALLREDUCE_S and REDUCE_G: the hidden state, the statistics and the
    hidden state's gradient, each priced as one transfer of its payload over the link."""
