"""Independent references for the partition tests: random DAGs and brute force.

The brute force reads the networkx graph directly, not PartitionProblem's arrays,
so it also checks fxpipe.partition.stage_cost.
"""
from __future__ import annotations

import itertools
import math

import networkx as nx
from hypothesis import strategies as st

from fxpipe.partition import PartitionProblem


@st.composite
def small_problems(draw, max_nodes: int = 8, max_stages: int = 3):
    """(graph, kwargs for PartitionProblem) with random DAG, costs, ranks and limits."""
    n = draw(st.integers(1, max_nodes))
    g = nx.DiGraph()
    layer = 0
    for i in range(n):
        if draw(st.booleans()):
            layer += 1
        g.add_node(i, fwd=draw(st.integers(0, 20)) * 1e-3, bwd=draw(st.integers(0, 40)) * 1e-3,
                   static_bytes=draw(st.integers(0, 100)), act_bytes=draw(st.integers(0, 30)),
                   out_bytes=draw(st.sampled_from([0, 10, 1000, 5000])),
                   params=draw(st.integers(0, 50)),
                   layer=None if draw(st.integers(0, 4)) == 0 else layer)
    for j in range(n):
        for i in range(j):
            if draw(st.integers(0, 9)) < 3:
                g.add_edge(i, j)
    s = draw(st.integers(1, min(max_stages, n)))
    p = draw(st.sampled_from([d for d in range(1, s + 1) if s % d == 0]))
    kwargs = dict(num_stages=s, stage_to_rank=tuple(k % p for k in range(s)),
                  inflight=tuple(draw(st.integers(1, 4)) for _ in range(s)),
                  bandwidth_bytes_per_s=draw(st.sampled_from([1e5, 1e6, math.inf])),
                  latency_s=draw(st.sampled_from([0.0, 1e-3])))
    total = sum(a["static_bytes"] + 4 * a["act_bytes"] for _, a in g.nodes(data=True))
    if draw(st.booleans()):
        kwargs["memory_limit_bytes"] = draw(st.integers(1, max(1, total)))
    return g, kwargs


def stage_times(g: nx.DiGraph, stage_of: dict, kwargs: dict) -> list[float]:
    s = kwargs["num_stages"]
    bw, lat = kwargs.get("bandwidth_bytes_per_s", math.inf), kwargs.get("latency_s", 0.0)
    times = [0.0] * s
    for n, a in g.nodes(data=True):
        times[stage_of[n]] += a["fwd"] + a["bwd"]
        if a.get("out_bytes", 0) > 0:
            for b in {stage_of[v] for v in g.successors(n) if stage_of[v] > stage_of[n]}:
                t = lat + a["out_bytes"] / bw
                times[stage_of[n]] += 2 * t
                times[b] += 2 * t
    return times


def rank_memory(g: nx.DiGraph, stage_of: dict, kwargs: dict) -> list[int]:
    ranks = kwargs["stage_to_rank"]
    mem = [0] * (max(ranks) + 1)
    for n, a in g.nodes(data=True):
        k = stage_of[n]
        mem[ranks[k]] += a.get("static_bytes", 0) + kwargs["inflight"][k] * a.get("act_bytes", 0)
    return mem


def valid_assignments(g: nx.DiGraph, s: int):
    nodes = list(g.nodes)
    for combo in itertools.product(range(s), repeat=len(nodes)):
        if len(set(combo)) < s:
            continue
        stage_of = dict(zip(nodes, combo))
        if all(stage_of[u] <= stage_of[v] for u, v in g.edges):
            yield stage_of


def brute_force(g: nx.DiGraph, kwargs: dict) -> tuple[float | None, int]:
    """(optimal bottleneck among memory-fitting assignments or None, smallest fitting limit)."""
    limit = kwargs.get("memory_limit_bytes")
    best, floor = None, None
    for stage_of in valid_assignments(g, kwargs["num_stages"]):
        peak = max(rank_memory(g, stage_of, kwargs))
        floor = peak if floor is None else min(floor, peak)
        if limit is not None and peak > limit:
            continue
        t = max(stage_times(g, stage_of, kwargs))
        best = t if best is None else min(best, t)
    assert floor is not None
    return best, floor


def is_valid(g: nx.DiGraph, stage_of: dict, s: int) -> bool:
    return (set(stage_of) == set(g.nodes) and set(stage_of.values()) == set(range(s))
            and all(stage_of[u] <= stage_of[v] for u, v in g.edges))


def layered(n_layers=6, skip=True):
    """Embedding, n_layers two-node layers with a residual skip each, head, loss."""
    g = nx.DiGraph()
    g.add_node("embed", fwd=0.1, bwd=0.2, static_bytes=500, out_bytes=64, params=50)
    prev = "embed"
    for i in range(n_layers):
        a, b = f"l{i}.attn", f"l{i}.mlp"
        g.add_node(a, fwd=1.0, bwd=2.0, static_bytes=100, act_bytes=10, out_bytes=64, params=10, layer=i)
        g.add_node(b, fwd=2.0, bwd=4.0, static_bytes=200, act_bytes=20, out_bytes=64, params=20, layer=i)
        g.add_edges_from([(prev, a), (a, b)] + ([(prev, b)] if skip else []))
        prev = b
    g.add_node("head", fwd=2.5, bwd=5.0, static_bytes=500, act_bytes=30, out_bytes=64, params=50)
    g.add_node("loss", fwd=0.5, bwd=0.5, act_bytes=30, out_bytes=4)
    g.add_edges_from([(prev, "head"), ("head", "loss")])
    return g


def problem_for(g, p=3, v=1, **kw):
    s = p * v
    return PartitionProblem(graph=g, num_stages=s, stage_to_rank=tuple(k % p for k in range(s)),
                            inflight=tuple(max(1, p - k % p) for k in range(s)),
                            bandwidth_bytes_per_s=1e4, latency_s=1e-3, **kw)
