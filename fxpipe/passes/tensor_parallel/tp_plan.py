"""The TP plan under construction: per node its layout and the conversions its inputs
need (``node_layouts.build_plan`` fills it; the rules in ``layout_rules.py`` read it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxpipe.ir.tp_result import CollectiveKind
from fxpipe.passes.tensor_parallel.attention_forms import SharedChannels
from fxpipe.passes.tensor_parallel.graph_ops import Projection
from fxpipe.passes.tensor_parallel.layout import Layout


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


def is_sharded(lay: Any) -> bool:
    """A Layout (or a list of them, for split-like nodes) that differs between ranks."""
    if isinstance(lay, list):
        return any(l.is_sharded for l in lay)
    return isinstance(lay, Layout) and lay.is_sharded


class _Refuse(Exception):
    pass
