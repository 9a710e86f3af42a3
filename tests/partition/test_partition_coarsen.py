"""Coarsening keeps the DAG acyclic, sums costs, and maps back; deterministic."""
import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import PartitionProblem, coarsen, solve_ilp
from fxpipe.partition.coarsen import SUMMED
from partition_reference import is_valid


@st.composite
def keyed_dags(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, fwd=float(draw(st.integers(0, 9))), bwd=float(draw(st.integers(0, 9))),
                   static_bytes=draw(st.integers(0, 50)), act_bytes=draw(st.integers(0, 50)),
                   params=draw(st.integers(0, 5)), out_bytes=draw(st.integers(0, 100)),
                   key=draw(st.sampled_from([None, "a", "b", "c"])), layer=draw(st.sampled_from([None, 0, 1])))
    for j in range(n):
        for i in range(j):
            if draw(st.integers(0, 9)) < 2:
                g.add_edge(i, j)
    return g, draw(st.integers(1, n))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(keyed_dags())
def test_coarsening_is_acyclic_sums_and_maps_back(case):
    g, max_groups = case
    c = coarsen(g, max_groups)
    cg = c.graph
    assert nx.is_directed_acyclic_graph(cg)
    assert cg.number_of_nodes() <= max_groups
    assert sorted(n for m in c.members for n in m) == sorted(g.nodes)
    assert all(c.group_of[n] == gid for gid, m in enumerate(c.members) for n in m)
    for k in SUMMED:
        assert sum(a[k] for _, a in cg.nodes(data=True)) == pytest.approx(sum(a[k] for _, a in g.nodes(data=True)))
        for gid, m in enumerate(c.members):
            assert cg.nodes[gid][k] == pytest.approx(sum(g.nodes[n][k] for n in m))
    # Coarse edges are exactly the fine edges between different groups.
    crossing = {(c.group_of[u], c.group_of[v]) for u, v in g.edges if c.group_of[u] != c.group_of[v]}
    assert set(cg.edges) == crossing
    # Group ids follow a topological order, and any valid coarse assignment expands to a valid fine one.
    assert all(a < b for a, b in cg.edges)
    s = min(2, cg.number_of_nodes())
    stage_of = {gid: (0 if gid < cg.number_of_nodes() // 2 or s == 1 else 1) for gid in cg}
    assert is_valid(g, c.expand(stage_of), s)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(keyed_dags())
def test_coarsening_is_deterministic(case):
    g, max_groups = case
    copy = nx.DiGraph()
    copy.add_nodes_from(g.nodes(data=True))
    copy.add_edges_from(sorted(g.edges, reverse=True))  # same graph, other edge insertion order
    a, b = coarsen(g, max_groups), coarsen(copy, max_groups)
    assert a.members == b.members
    assert sorted(a.graph.edges) == sorted(b.graph.edges)


def test_never_merges_the_ends_of_a_path_through_a_third_node():
    # a -> b directly and a -> c -> b: merging {a, b} would put c both before and after it.
    g = nx.DiGraph([("a", "b"), ("a", "c"), ("c", "b")])
    for n, w in zip("abc", (1.0, 1.0, 50.0)):  # a + b is the cheapest pair by weight
        g.nodes[n].update(fwd=w, bwd=0.0)
    c = coarsen(g, 2)
    assert c.group_of["a"] != c.group_of["b"]
    assert nx.is_directed_acyclic_graph(c.graph) and c.graph.number_of_nodes() == 2


def test_key_groups_merge_first_and_out_bytes_count_leaving_outputs():
    g = nx.DiGraph()
    nx.add_path(g, range(6))
    for i, key in enumerate("xxxyyy"):
        g.nodes[i].update(fwd=1.0, bwd=1.0, key=key, out_bytes=10 * (i + 1), layer=0)
    c = coarsen(g, 4)
    assert c.members == ((0, 1, 2), (3, 4, 5))
    assert c.graph.nodes[0]["out_bytes"] == 30  # only node 2's output leaves group 0
    assert c.graph.nodes[0]["key"] == "x" and c.graph.nodes[0]["layer"] == 0


def test_layers_stay_apart_until_they_must_merge():
    g = nx.DiGraph()
    nx.add_path(g, range(8))
    for i in g:
        g.nodes[i].update(fwd=1.0, bwd=0.0, layer=i // 4)
    assert [sorted(m) for m in coarsen(g, 2).members] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert coarsen(g, 1).graph.nodes[0]["layer"] == 0  # spanning: the smallest layer


def test_disconnected_graph_reaches_the_target():
    g = nx.DiGraph()
    for i in range(6):
        g.add_node(i, fwd=1.0, bwd=0.0)
    assert coarsen(g, 2).graph.number_of_nodes() == 2


def test_coarse_solution_expands_to_a_valid_fine_assignment():
    g = nx.DiGraph()
    prev = None
    for i in range(40):  # a residual ladder: x_i -> f_i -> x_{i+1}, plus x_i -> x_{i+1}
        g.add_node(f"x{i}", fwd=0.1, bwd=0.2, out_bytes=10, key=f"l{i // 2}")
        g.add_node(f"f{i}", fwd=1.0, bwd=2.0, out_bytes=10, key=f"l{i // 2}")
        g.add_edge(f"x{i}", f"f{i}")
        if prev:
            g.add_edges_from([(prev[0], f"x{i}"), (prev[1], f"x{i}")])
        prev = (f"x{i}", f"f{i}")
    c = coarsen(g, 12)
    p = PartitionProblem(graph=c.graph, num_stages=4, stage_to_rank=(0, 1, 2, 3), inflight=(4, 3, 2, 1))
    r = solve_ilp(p, time_limit_s=5.0)
    assert is_valid(g, c.expand(r.stage_of), 4)
