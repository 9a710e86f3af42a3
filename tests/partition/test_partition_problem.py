"""PartitionProblem validation and the cost model, against hand-computed numbers."""
import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import PartitionError, PartitionProblem, evaluate
from fxpipe.partition.stage_cost import transfers
from partition_reference import rank_memory, small_problems, stage_times, valid_assignments


def chain(n, **attrs):
    g = nx.DiGraph()
    nx.add_path(g, range(n))
    for i in g:
        g.nodes[i].update(fwd=1.0, bwd=2.0, **attrs)
    return g


def test_more_stages_than_nodes_names_both_numbers():
    with pytest.raises(PartitionError, match=r"5 stages but only 3 nodes"):
        PartitionProblem(graph=chain(3), num_stages=5, stage_to_rank=tuple(range(5)), inflight=(1,) * 5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage_to_rank=(0,), inflight=(1, 1)), "stage_to_rank has 1 entries"),
    (dict(stage_to_rank=(0, 1), inflight=(0, 1)), "inflight must be >= 1"),
    (dict(stage_to_rank=(0, 1), inflight=(1, 1), memory_limit_bytes=0), "memory_limit_bytes must be positive"),
    (dict(stage_to_rank=(0, 1), inflight=(1, 1), bandwidth_bytes_per_s=0.0), "bandwidth"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(PartitionError, match=match):
        PartitionProblem(graph=chain(3), num_stages=2, **kwargs)


def test_cycle_and_missing_attributes_are_rejected():
    g = chain(3)
    g.add_edge(2, 0)
    with pytest.raises(PartitionError, match="without cycles"):
        PartitionProblem(graph=g, num_stages=1, stage_to_rank=(0,), inflight=(1,))
    g = chain(3)
    del g.nodes[1]["bwd"]
    with pytest.raises(PartitionError, match=r"node 1 lacks attribute\(s\) \['bwd'\]"):
        PartitionProblem(graph=g, num_stages=1, stage_to_rank=(0,), inflight=(1,))


def test_skip_connection_is_sent_once_per_consumer_stage():
    # 0 feeds 1, 2 and 3 (a skip); stages 0 | 1 | 2,3: node 0's output goes to stage 1
    # and to stage 2 once (two consumers there), never relayed through stage 1.
    g = nx.DiGraph([(0, 1), (1, 2), (2, 3), (0, 2), (0, 3)])
    for i in g:
        g.nodes[i].update(fwd=1.0, bwd=2.0, out_bytes=100, static_bytes=10, act_bytes=5)
    p = PartitionProblem(graph=g, num_stages=3, stage_to_rank=(0, 1, 2), inflight=(3, 2, 1),
                         bandwidth_bytes_per_s=1000.0, latency_s=0.5)
    stages = (0, 1, 2, 2)
    assert transfers(p, stages) == [(0, 0, 1), (0, 0, 2), (1, 1, 2)]
    t = 0.5 + 100 / 1000.0  # one way
    costs, mem = evaluate(p, stages)
    assert [c.comm_s for c in costs] == pytest.approx([2 * 2 * t, 2 * 2 * t, 2 * 2 * t])
    assert [c.time_s for c in costs] == pytest.approx([3 + 4 * t, 3 + 4 * t, 6 + 4 * t])
    assert [c.send_bytes for c in costs] == [200, 100, 0]
    assert [c.recv_bytes for c in costs] == [0, 100, 200]
    assert mem == (10 + 3 * 5, 10 + 2 * 5, 20 + 1 * 10)


def test_zero_out_bytes_is_never_sent():
    g = chain(2, out_bytes=0)
    p = PartitionProblem(graph=g, num_stages=2, stage_to_rank=(0, 1), inflight=(1, 1), latency_s=1.0)
    assert [c.comm_s for c in evaluate(p, (0, 1))[0]] == [0.0, 0.0]


def test_interleaved_ranks_sum_their_stages_memory():
    g = chain(4, static_bytes=100, act_bytes=10)
    p = PartitionProblem(graph=g, num_stages=4, stage_to_rank=(0, 1, 0, 1), inflight=(4, 3, 2, 1))
    assert evaluate(p, (0, 1, 2, 3))[1] == (100 + 40 + 100 + 20, 100 + 30 + 100 + 10)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(small_problems(max_nodes=6), st.randoms(use_true_random=False))
def test_cost_model_matches_reference(case, rnd):
    g, kw = case
    p = PartitionProblem(graph=g, **kw)
    assignments = list(valid_assignments(g, kw["num_stages"]))
    for stage_of in rnd.sample(assignments, min(5, len(assignments))):
        costs, mem = evaluate(p, [stage_of[n] for n in p.nodes])
        assert [c.time_s for c in costs] == pytest.approx(stage_times(g, stage_of, kw), abs=1e-12)
        assert list(mem) == rank_memory(g, stage_of, kw)
        assert all(math.isclose(c.compute_s + c.comm_s, c.time_s) for c in costs)
