"""Coarsening: merge a fine DAG into at most ``max_groups`` groups the ILP can handle.

Contracting two nodes of a DAG creates a cycle exactly when another path joins
them (a -> x -> b and a -> b: the merged node would precede and follow x), so
every merge is checked on the current quotient graph. Steps, each only while
more than ``max_groups`` groups remain:

1. **by key** — nodes with the same ``key`` (a module path) and the same layer
   merge in topological order where legal: a module is the unit users reason in.
2. **by edge, cheapest first** — contract the quotient edge whose two ends have
   the smallest combined weight (share of total compute + static + activation
   memory), preferring edges inside one transformer layer, then linear-chain
   edges (out-degree 1 -> in-degree 1, always legal). Cheapest-first keeps
   groups of similar size, so the stage boundaries the ILP can choose stay fine.
3. **fallback** — merge two consecutive groups of a topological order of the
   quotient (always legal: no path can pass between them); only reached when
   the graph is disconnected.

Group attributes: ``fwd``, ``bwd``, ``static_bytes``, ``act_bytes``, ``params``
are sums; ``out_bytes`` sums the members whose output leaves the group (a cut
sends all of them — exact when the group has one output); ``layer`` is the
members' common layer, or the smallest one when a group had to span layers;
``key`` is the common key or None; ``size`` is the member count.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping

import networkx as nx

from fxpipe.partition.problem import Node, topological_nodes

SUMMED = ("fwd", "bwd", "static_bytes", "act_bytes", "params")
_MIXED = object()  # layer of a group spanning several layers


@dataclass(frozen=True)
class Coarsening:
    """A coarse DAG and how it maps back to the fine one."""

    graph: nx.DiGraph
    """Coarse DAG; nodes are group ids 0..G-1 numbered in topological order."""
    group_of: Mapping[Node, int]
    """Fine node -> group id."""
    members: tuple[tuple[Node, ...], ...]
    """Group id -> its fine nodes, in the fine topological order."""

    def expand(self, stage_of: Mapping[int, int]) -> dict[Node, int]:
        """Stage of every fine node, given the stage of every group."""
        return {n: stage_of[g] for n, g in self.group_of.items()}


class _Quotient:
    """Mutable quotient graph over fine-node indices (a group is named by its first member)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.fine = topological_nodes(graph)
        pos = {n: i for i, n in enumerate(self.fine)}
        self.q = nx.DiGraph()
        self.q.add_nodes_from(range(len(self.fine)))
        self.q.add_edges_from((pos[u], pos[v]) for u, v in graph.edges)
        attrs = [graph.nodes[n] for n in self.fine]
        totals = {k: sum(a.get(k, 0) for a in attrs) for k in ("fwd", "bwd", "static_bytes", "act_bytes")}
        share = lambda a, keys: sum(a.get(k, 0) for k in keys) / max(sum(totals[k] for k in keys), 1e-300)  # noqa: E731
        self.weight = {i: share(a, ("fwd", "bwd")) + share(a, ("static_bytes",)) + share(a, ("act_bytes",))
                       for i, a in enumerate(attrs)}
        self.layer = {i: a.get("layer") for i, a in enumerate(attrs)}
        self.members = {i: [i] for i in range(len(self.fine))}
        self.owner = list(range(len(self.fine)))
        """Fine index -> the group holding it now."""
        self.version = {i: 0 for i in range(len(self.fine))}

    def __len__(self) -> int:
        return self.q.number_of_nodes()

    def _reaches(self, a: int, b: int) -> bool:
        """Is there a path a -> ... -> b other than the direct edge?"""
        stack = [s for s in self.q.successors(a) if s != b]
        seen = set(stack)
        while stack:
            x = stack.pop()
            if x == b:
                return True
            for y in self.q.successors(x):
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        return False

    def can_merge(self, a: int, b: int) -> bool:
        q = self.q
        if q.has_edge(a, b) and (q.out_degree(a) == 1 or q.in_degree(b) == 1):
            return True  # a linear-chain edge: the only path from a to b
        if q.has_edge(b, a) and (q.out_degree(b) == 1 or q.in_degree(a) == 1):
            return True
        return not self._reaches(a, b) and not self._reaches(b, a)

    def merge(self, a: int, b: int) -> int:
        """Contract b into a (or a into b, whichever is first); returns the survivor."""
        a, b = min(a, b), max(a, b)
        q = self.q
        q.add_edges_from((p, a) for p in q.predecessors(b) if p != a)
        q.add_edges_from((a, s) for s in q.successors(b) if s != a)
        q.remove_node(b)
        for i in self.members[b]:
            self.owner[i] = a
        self.members[a] += self.members.pop(b)
        self.weight[a] += self.weight.pop(b)
        la, lb = self.layer[a], self.layer.pop(b)
        self.layer[a] = la if la is lb or la == lb else _MIXED
        self.version[a] += 1
        del self.version[b]
        assert not q.has_edge(a, a)
        return a


def _merge_pinned(qg: _Quotient, graph: nx.DiGraph) -> None:
    """One group for every node marked ``pinned`` (its output must not cross a cut: a
    data-dependent shape) and its readers, with everything on a path between them
    (the group must stay convex for the quotient to stay a DAG)."""
    pinned = [n for n in qg.fine if graph.nodes[n].get("pinned")]
    if not pinned:
        return
    pos = {n: i for i, n in enumerate(qg.fine)}
    comps: list[set] = [{n, *graph.successors(n)} for n in pinned]
    changed = True
    while changed:  # convex hulls, joined where they meet, until stable
        changed = False
        hulls = []
        for comp in comps:
            down = set().union(*(nx.descendants(graph, c) for c in comp)) | comp
            up = set().union(*(nx.ancestors(graph, c) for c in comp)) | comp
            hull = down & up
            for other in hulls:
                if other & hull:
                    other |= hull
                    changed = True
                    break
            else:
                hulls.append(hull)
            changed |= hull != comp
        comps = hulls
    for comp in comps:
        order = sorted(pos[n] for n in comp)
        group = order[0]
        for i in order[1:]:  # topological order over a convex set: every merge is legal
            group = qg.merge(group, i)


def _merge_by_key(qg: _Quotient, graph: nx.DiGraph) -> None:
    by_key: dict = {}
    for i, n in enumerate(qg.fine):
        key = graph.nodes[n].get("key")
        if key is not None:
            by_key.setdefault(key, []).append(i)
    for nodes in by_key.values():  # insertion order: keys by first appearance
        group = qg.owner[nodes[0]]
        for i in nodes[1:]:
            i = qg.owner[i]  # an earlier step may have merged it already
            if i == group:
                continue
            if qg.layer[group] == qg.layer[i] and qg.can_merge(group, i):
                group = qg.merge(group, i)
            else:
                group = i


def _merge_by_edge(qg: _Quotient, max_groups: int) -> None:
    heap: list = []

    def push(a: int, b: int) -> None:
        q = qg.q
        cross = qg.layer[a] is _MIXED or qg.layer[b] is _MIXED or qg.layer[a] != qg.layer[b]
        chain = q.out_degree(a) == 1 and q.in_degree(b) == 1
        heapq.heappush(heap, (cross, qg.weight[a] + qg.weight[b], not chain, a, b,
                              qg.version[a], qg.version[b]))

    for a, b in sorted(qg.q.edges):
        push(a, b)
    while heap and len(qg) > max_groups:
        *_, a, b, va, vb = heapq.heappop(heap)
        if qg.version.get(a) != va or qg.version.get(b) != vb or not qg.can_merge(a, b):
            continue
        g = qg.merge(a, b)
        for p in sorted(qg.q.predecessors(g)):
            push(p, g)
        for s in sorted(qg.q.successors(g)):
            push(g, s)


def _merge_consecutive(qg: _Quotient, max_groups: int) -> None:
    while len(qg) > max_groups:
        order = list(nx.lexicographical_topological_sort(qg.q))
        a, b = min(zip(order, order[1:]), key=lambda p: qg.weight[p[0]] + qg.weight[p[1]])
        qg.merge(a, b)


def coarsen(graph: nx.DiGraph, max_groups: int) -> Coarsening:
    """Merge ``graph`` into at most ``max_groups`` groups (module docstring). Deterministic."""
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError("coarsen needs a DAG")
    qg = _Quotient(graph)
    _merge_pinned(qg, graph)
    if len(qg) > max_groups:
        _merge_by_key(qg, graph)
    _merge_by_edge(qg, max_groups)
    _merge_consecutive(qg, max_groups)
    assert nx.is_directed_acyclic_graph(qg.q)
    return _build(qg, graph)


def _build(qg: _Quotient, graph: nx.DiGraph) -> Coarsening:
    order = list(nx.lexicographical_topological_sort(qg.q))
    gid = {rep: g for g, rep in enumerate(order)}
    group_of = {qg.fine[i]: gid[rep] for rep in order for i in qg.members[rep]}
    coarse = nx.DiGraph()
    members = []
    for rep in order:
        idx = sorted(qg.members[rep])
        nodes = [qg.fine[i] for i in idx]
        members.append(tuple(nodes))
        attrs = [graph.nodes[n] for n in nodes]
        leaving = [a for n, a in zip(nodes, attrs)
                   if any(group_of[s] != gid[rep] for s in graph.successors(n))]
        layers = {a.get("layer") for a in attrs}
        keys = {a.get("key") for a in attrs}
        known = sorted(l for l in layers if l is not None)
        coarse.add_node(
            gid[rep], **{k: sum(a.get(k, 0) for a in attrs) for k in SUMMED},
            out_bytes=sum(a.get("out_bytes", 0) for a in leaving),
            layer=layers.pop() if len(layers) == 1 else known[0] if known else None,
            key=keys.pop() if len(keys) == 1 else None, size=len(nodes))
    coarse.add_edges_from((gid[a], gid[b]) for a, b in sorted(qg.q.edges))
    return Coarsening(graph=coarse, group_of=group_of, members=tuple(members))
