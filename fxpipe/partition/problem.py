"""The stage-assignment problem, independent of torch graphs.

A :class:`PartitionProblem` is a DAG of *nodes* (coarse groups of ATen ops, or
single ops) with costs, plus the pipeline it must be cut for. Every solver in
this package takes one and returns a :class:`~fxpipe.partition.result.PartitionResult`.

Node attributes (``graph.nodes[n][...]``):

==============  ========  ===================================================
name            default   meaning
==============  ========  ===================================================
``fwd``         required  forward compute time of the node, seconds
``bwd``         required  backward compute time (input + weight grads), seconds
``static_bytes`` 0        parameters + gradients + optimizer state the owning
                          stage holds for this node, bytes
``act_bytes``   0         activation bytes kept for backward, per microbatch
``out_bytes``   0         bytes of the node's output tensor(s) if they must be
                          sent to another stage; 0 means "never sent" (e.g. a
                          side input that every stage recomputes)
``params``      0         parameter count (the DeepSpeed ``params`` baseline)
``layer``       None      transformer-layer index, None outside the repeated
                          layers (embedding, final norm, LM head, loss)
``key``         None      grouping key for coarsening (e.g. module path)
==============  ========  ===================================================

Nodes are indexed in one deterministic topological order, ``problem.nodes``:
the lexicographic topological sort by graph insertion order, so a graph built
layer by layer keeps that order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

import networkx as nx
import numpy as np

Node = Hashable

REQUIRED_ATTRS = ("fwd", "bwd")
NUMERIC_DEFAULTS = {"static_bytes": 0, "act_bytes": 0, "out_bytes": 0, "params": 0}


class PartitionError(ValueError):
    """A partition request that cannot be satisfied as posed (a user error)."""


def topological_nodes(graph: nx.DiGraph) -> tuple[Node, ...]:
    """Deterministic topological order: ties broken by graph insertion order."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    return tuple(nx.lexicographical_topological_sort(graph, key=position.__getitem__))


def _byte_count(value: float) -> int:
    # Bytes are integers so the memory constraint is exact in CP-SAT; round up so a
    # fractional estimate is never under-counted.
    return int(math.ceil(value))


@dataclass(frozen=True, kw_only=True, eq=False)
class PartitionProblem:
    """One pipeline-partitioning instance. See the module docstring for node attributes."""

    graph: nx.DiGraph
    """DAG of nodes with cost attributes. Not copied: do not mutate it afterwards."""
    num_stages: int
    """S = p·v, the number of pipeline stages (model chunks)."""
    stage_to_rank: tuple[int, ...]
    """Pipeline rank that runs each stage, e.g. ``k % p`` for interleaved 1F1B."""
    inflight: tuple[int, ...]
    """Per stage: microbatches whose activations the stage holds at its peak, taken
    from the schedule (1F1B, rank r: min(p - r, m); Narayanan et al. SC21 §2.2)."""
    memory_limit_bytes: int | None = None
    """Per-rank memory limit; None means unlimited."""
    bandwidth_bytes_per_s: float = math.inf
    """Point-to-point bandwidth between stages; inf makes transfers cost only latency."""
    latency_s: float = 0.0
    """Fixed cost of one point-to-point transfer."""

    # Derived in __post_init__, indexed by position in ``nodes``.
    nodes: tuple[Node, ...] = field(init=False, repr=False)
    index: dict = field(init=False, repr=False)
    fwd_s: np.ndarray = field(init=False, repr=False)
    bwd_s: np.ndarray = field(init=False, repr=False)
    static_bytes: tuple[int, ...] = field(init=False, repr=False)
    act_bytes: tuple[int, ...] = field(init=False, repr=False)
    out_bytes: tuple[int, ...] = field(init=False, repr=False)
    params: tuple[int, ...] = field(init=False, repr=False)
    layer: tuple[int | None, ...] = field(init=False, repr=False)
    succ: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    pred: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        g, s = self.graph, self.num_stages
        if not isinstance(g, nx.DiGraph) or not nx.is_directed_acyclic_graph(g):
            raise PartitionError("graph must be a networkx.DiGraph without cycles")
        if not isinstance(s, int) or s < 1:
            raise PartitionError(f"num_stages must be a positive int, got {s!r}")
        if s > g.number_of_nodes():
            raise PartitionError(
                f"{s} stages but only {g.number_of_nodes()} nodes: every stage needs at "
                f"least one node; use fewer stages (pp·chunks) or coarsen less "
                f"(raise max_groups)")
        for name in ("stage_to_rank", "inflight"):
            value = tuple(getattr(self, name))
            if len(value) != s:
                raise PartitionError(f"{name} has {len(value)} entries, expected one per stage ({s})")
            object.__setattr__(self, name, value)
        if min(self.stage_to_rank) < 0:
            raise PartitionError(f"stage_to_rank must be non-negative, got {self.stage_to_rank}")
        if min(self.inflight) < 1:
            raise PartitionError(f"inflight must be >= 1 per stage, got {self.inflight}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise PartitionError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        if not self.bandwidth_bytes_per_s > 0 or not self.latency_s >= 0:
            raise PartitionError(
                f"need bandwidth > 0 and latency >= 0, got {self.bandwidth_bytes_per_s}, {self.latency_s}")
        self._derive()

    def _derive(self) -> None:
        nodes = topological_nodes(self.graph)
        index = {n: i for i, n in enumerate(nodes)}
        attrs = [self.graph.nodes[n] for n in nodes]
        for n, a in zip(nodes, attrs):
            missing = [k for k in REQUIRED_ATTRS if k not in a]
            if missing:
                raise PartitionError(f"node {n!r} lacks attribute(s) {missing}; every node needs fwd and bwd seconds")
            for k in (*REQUIRED_ATTRS, *NUMERIC_DEFAULTS):
                v = a.get(k, 0)
                if not (isinstance(v, (int, float, np.number)) and math.isfinite(v) and v >= 0):
                    raise PartitionError(f"node {n!r}: {k} must be a finite number >= 0, got {v!r}")
        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen dataclass)
        put("nodes", nodes)
        put("index", index)
        put("fwd_s", np.array([float(a["fwd"]) for a in attrs]))
        put("bwd_s", np.array([float(a["bwd"]) for a in attrs]))
        for k in ("static_bytes", "act_bytes", "out_bytes"):
            put(k, tuple(_byte_count(a.get(k, 0)) for a in attrs))
        put("params", tuple(int(a.get("params", 0)) for a in attrs))
        put("layer", tuple(a.get("layer") for a in attrs))
        put("succ", tuple(tuple(sorted(index[v] for v in self.graph.successors(n))) for n in nodes))
        put("pred", tuple(tuple(sorted(index[u] for u in self.graph.predecessors(n))) for n in nodes))

    # ---- small derived views -------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """Stages that run on ``rank``, ascending."""
        return tuple(k for k, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def compute_s(self) -> np.ndarray:
        """fwd + bwd seconds per node."""
        return self.fwd_s + self.bwd_s

    @property
    def transfer_s(self) -> np.ndarray:
        """Seconds of one one-way transfer of each node's output (0 if never sent)."""
        out = np.array(self.out_bytes, dtype=float)
        return np.where(out > 0, self.latency_s + out / self.bandwidth_bytes_per_s, 0.0)

    def check_stages(self, stages) -> None:
        """Raise ValueError unless ``stages`` (one int per node, in ``nodes`` order) is valid."""
        if len(stages) != self.num_nodes:
            raise ValueError(f"assignment has {len(stages)} entries, problem has {self.num_nodes} nodes")
        if any(not 0 <= k < self.num_stages for k in stages):
            raise ValueError(f"stage outside 0..{self.num_stages - 1} in assignment")
        for u, vs in enumerate(self.succ):
            for v in vs:
                if stages[u] > stages[v]:
                    raise ValueError(
                        f"edge {self.nodes[u]!r}->{self.nodes[v]!r} goes backwards "
                        f"(stage {stages[u]} -> {stages[v]}); stages must be ordered")
        empty = sorted(set(range(self.num_stages)) - set(stages))
        if empty:
            raise ValueError(f"stages {empty} are empty; every stage needs at least one node")
