"""Megatron / DeepSpeed baselines, the chain DP, and the method registry."""
import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fxpipe.partition import Method, PartitionError, PartitionProblem, SolveStatus, partition
from fxpipe.partition.chain_dp import min_max_split
from partition_reference import brute_force, is_valid, layered, problem_for, small_problems


def test_uniform_is_megatrons_split_with_remainder_first():
    g = layered(5)
    g.add_node("labels", fwd=0.0, bwd=0.0, out_bytes=8)
    g.add_edge("labels", "loss")
    r = partition(problem_for(g, p=2), "uniform")
    s = r.stage_of
    assert [s[f"l{i}.attn"] for i in range(5)] == [0, 0, 0, 1, 1]  # 5 layers: 3 + 2
    assert s["embed"] == 0 and s["head"] == 1 and s["loss"] == 1
    assert s["labels"] == 1  # fed only to the loss: as late as its consumer
    assert r.method is Method.UNIFORM and r.status is SolveStatus.HEURISTIC


def test_uniform_interleaved_chunks_take_consecutive_slices():
    r = partition(problem_for(layered(8), p=2, v=2), "uniform")
    assert [r.stage_of[f"l{i}.mlp"] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_uniform_needs_a_layer_per_stage():
    with pytest.raises(PartitionError, match="2 layers, 3 stages"):
        partition(problem_for(layered(2), p=3), "uniform")


def test_params_balances_parameter_counts_at_module_boundaries():
    g = nx.DiGraph()
    nx.add_path(g, range(8))
    for i in g:
        g.nodes[i].update(fwd=1.0, bwd=1.0, params=10 if i % 2 == 0 else 0)
    p = PartitionProblem(graph=g, num_stages=2, stage_to_rank=(0, 1), inflight=(1, 1))
    r = partition(p, "params")
    assert r.stage_indices == (0, 0, 0, 0, 1, 1, 1, 1)
    assert [c.params for c in r.stages] == [20, 20]


def test_uniform_overloads_the_last_stage_the_ilp_does_not():
    g = layered(6)
    g.nodes["head"].update(fwd=6.0, bwd=12.0)  # a big LM head, as with GPT-2's vocabulary
    p = problem_for(g, p=3)
    uni, ilp = partition(p, "uniform"), partition(p, "ilp", time_limit_s=5.0)
    assert uni.stages[-1].time_s == uni.bottleneck_s
    assert ilp.bottleneck_s < 0.9 * uni.bottleneck_s and ilp.balance_ratio < uni.balance_ratio


def test_min_max_split_is_the_linear_partition_optimum():
    w = [7, 2, 5, 10, 8, 1, 1, 9]
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    parts = min_max_split(len(w), 3, lambda k, i: prefix[i] - prefix[:i])
    loads = [sum(x for x, k in zip(w, parts) if k == j) for j in range(3)]
    best = min(max(sum(w[:a]), sum(w[a:b]), sum(w[b:])) for a in range(1, 7) for b in range(a + 1, 8))
    assert max(loads) == best == 18  # 7+2+5 | 10+8 | 1+1+9
    assert parts == sorted(parts) and set(parts) == {0, 1, 2}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(small_problems())
def test_every_method_returns_a_valid_assignment(case):
    g, kw = case
    p = PartitionProblem(graph=g, **kw)
    for method in ("dp", "params", "uniform"):
        try:
            r = partition(p, method)
        except PartitionError as e:
            assert method == "uniform" and "layer" in str(e)
            continue
        assert is_valid(g, r.stage_of, kw["num_stages"]), method
        assert r.lower_bound_s <= r.bottleneck_s and 0.0 <= r.gap <= 1.0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(small_problems(max_nodes=7))
def test_chain_dp_is_exact_on_paths(case):
    g, kw = case
    path = nx.DiGraph()
    path.add_nodes_from(g.nodes(data=True))
    nx.add_path(path, list(g.nodes))
    kw = {k: v for k, v in kw.items() if k != "memory_limit_bytes"}
    best, _ = brute_force(path, kw)
    assert partition(PartitionProblem(graph=path, **kw), "dp").bottleneck_s == pytest.approx(best, abs=1e-12)


def test_registry_rejects_unknown_names_and_stray_options():
    p = problem_for(layered(3))
    with pytest.raises(ValueError, match="unknown partition method 'greedy'; valid methods: ilp, uniform, params, dp"):
        partition(p, "greedy")
    with pytest.raises(TypeError, match="takes no options"):
        partition(p, "dp", time_limit_s=1.0)
    assert partition(p, Method.DP).method is Method.DP
    assert Method.parse("ILP") is Method.ILP  # any case, as every base.enums.NamedEnum
