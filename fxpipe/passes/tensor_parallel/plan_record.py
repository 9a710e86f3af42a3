"""The records the TP planner works on: what the pass read off the graph
(``GraphFacts``, the input of the layout search) and the plan under construction
(``TPPlan``: per node its layout and the conversions its inputs need; ``plan.build_plan``
fills it, the op rules in ``plan_rules.py`` read and extend it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from fxpipe.ir.program import Program
from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel.attention_forms import SharedChannels
from fxpipe.passes.tensor_parallel.graph_ops import Projection


@dataclass(frozen=True)
class GraphFacts:
    """What the pass finds in the captured graph before any layout is planned, by
    structure only (``graph_ops``); every reading of the search plans from it."""
    program: Program
    """The program with its no-grad / autocast regions opened (``regions.open_regions``)."""
    projections: dict[str, Projection]
    """Node -> the projection it is (linear, matmul by a weight, ...)."""
    embeddings: dict[str, str]
    """Token-embedding node -> its weight placeholder (vocabulary-parallel candidates)."""
    grad: frozenset[str]
    """Nodes whose value carries a gradient (where f is needed, and where it is not)."""
    tp: int
    describe: Callable[[str], str]
    """Node -> where it is in the model, for messages ("layer 3 (h.3.attn)")."""

    @property
    def graph(self) -> fx.Graph:
        return self.program.graph


@dataclass(frozen=True)
class Conversion:
    kind: CollectiveKind
    dim: int | None = None
    outer: int = 1
    """SCATTER of a strided block (``attention_forms.strided_blocks``): ``dim`` viewed as
    (outer, -1) around the scatter, which keeps block r of the inner part."""


@dataclass(frozen=True)
class PartialSite:
    """A partial sum (row-parallel output, vocab-parallel lookup) and where it is reduced."""
    source: str
    sink: str
    """Last node of the single-use view chain after ``source``: the reduction goes after it."""
    bias: str | None


@dataclass
class TPPlan:
    tp: int
    layouts: dict[str, Any] = field(default_factory=dict)
    """Node -> Layout (a list of them for split-like nodes)."""
    new_args: dict[str, tuple] = field(default_factory=dict)
    new_target: dict[str, Any] = field(default_factory=dict)
    new_kwargs: dict[str, dict] = field(default_factory=dict)
    conflict_rows: bool = False
    """A projection both row- and column-parallel gives up its input channels (else its output's)."""
    conversions: dict[tuple[str, str], list[Conversion]] = field(default_factory=dict)
    """(consumer, producer) -> ops applied to the producer's value for that consumer."""
    column_inputs: set[tuple[str, str]] = field(default_factory=set)
    """(consumer, producer) edges that enter a column-parallel projection (f sites)."""
    partial: dict[str, PartialSite] = field(default_factory=dict)
    """Sink node -> its partial-sum site."""
    column: dict[str, Projection] = field(default_factory=dict)
    row: dict[str, Projection] = field(default_factory=dict)
    vocab_ce: dict[str, int] = field(default_factory=dict)
    vocab_embedding: dict[str, str] = field(default_factory=dict)
    """Embedding node -> weight placeholder (vocab-parallel lookups)."""
    sharded_dropout: set[str] = field(default_factory=set)
    gathered: frozenset[str] = frozenset()
    """Replicated projections split with their output all-gathered (``gathered``)."""
    shared_columns: dict[str, SharedChannels] = field(default_factory=dict)
    """Column-parallel projection -> its channels every rank uses whole (``placement``)."""
    pending: list = field(default_factory=list)
    """param_shards.Narrowing: replicated operands a consumer needs other than each rank's
    block of (only a parameter split alike can give them; else a layout failure)."""
    param_shards: dict[str, Any] = field(default_factory=dict)
    """Placeholder -> param_shards.ParamShard: parameters split with their consumers."""
    statistics: dict[str, float] = field(default_factory=dict)
    """Mean/sum over split channels -> the factor turning the local result into this
    rank's share of the whole (local/full count for a mean); g follows it."""


class Refuse(Exception):
    """An op rule's refusal of a node's layouts: its channels are replicated (``plan.build_plan``)."""
