"""The CP-SAT partitioner against brute force, plus its error paths and determinism."""
import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings

from fxpipe.partition import (MemoryLimitError, PartitionProblem, SolveStatus, memory_floor,
                              solve_chain_dp, solve_ilp)
from partition_reference import brute_force, is_valid, small_problems, stage_times

SOLVER = dict(time_limit_s=5.0, seed=0, num_workers=1)


def tolerance(problem, result):
    # Every cost term is floored to a tick; a stage has at most n compute and
    # n·(S + 1) transfer terms, each off by < 1 tick (ilp.py, "Time resolution").
    return (problem.num_nodes * (problem.num_stages + 2) + 1) * result.time_resolution_s + 1e-12


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(small_problems())
def test_ilp_matches_brute_force(case):
    g, kw = case
    problem = PartitionProblem(graph=g, **kw)
    best, floor = brute_force(g, kw)
    if best is None:
        with pytest.raises(MemoryLimitError) as err:
            solve_ilp(problem, **SOLVER)
        assert err.value.floor.proven
        assert err.value.floor.fitting_limit_bytes == floor
        assert str(floor) in str(err.value)
        return
    r = solve_ilp(problem, **SOLVER)
    assert is_valid(g, r.stage_of, kw["num_stages"])
    assert r.fits_memory
    assert r.status is SolveStatus.OPTIMAL
    assert r.bottleneck_s == pytest.approx(max(stage_times(g, r.stage_of, kw)), abs=1e-12)
    assert best - 1e-12 <= r.bottleneck_s <= best + tolerance(problem, r)
    assert r.lower_bound_s <= best + 1e-12
    dp = solve_chain_dp(problem)
    if dp.fits_memory:
        assert dp.bottleneck_s >= r.bottleneck_s - tolerance(problem, r)


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


def test_deterministic_for_fixed_seed_and_workers():
    for workers in (1, 2):
        p = problem_for(layered(8), p=2, v=2)
        runs = [solve_ilp(p, time_limit_s=5.0, seed=3, num_workers=workers) for _ in range(2)]
        assert runs[0].assignment == runs[1].assignment
        assert runs[0].lower_bound_s == runs[1].lower_bound_s
        assert runs[0].status is SolveStatus.OPTIMAL


def test_single_stage_is_a_valid_no_op():
    g = layered(2)
    r = solve_ilp(PartitionProblem(graph=g, num_stages=1, stage_to_rank=(0,), inflight=(4,)))
    assert set(r.stage_of.values()) == {0} and r.gap == 0.0 and r.status is SolveStatus.OPTIMAL


def test_single_stage_over_memory_reports_total():
    g = layered(2)
    total = sum(a.get("static_bytes", 0) + 4 * a.get("act_bytes", 0) for _, a in g.nodes(data=True))
    p = PartitionProblem(graph=g, num_stages=1, stage_to_rank=(0,), inflight=(4,), memory_limit_bytes=total - 1)
    with pytest.raises(MemoryLimitError, match=rf"smallest limit that fits is .* \({total} B\).* rank 0 binds"):
        solve_ilp(p)


def test_memory_error_names_floor_and_binding_rank():
    g = layered(6)
    free = solve_ilp(problem_for(g))
    floor = memory_floor(problem_for(g), time_limit_s=5.0)
    assert floor.proven and floor.fitting_limit_bytes <= max(free.rank_memory_bytes)
    with pytest.raises(MemoryLimitError) as err:
        solve_ilp(problem_for(g, memory_limit_bytes=floor.fitting_limit_bytes - 1), **SOLVER)
    msg = str(err.value)
    assert f"({floor.fitting_limit_bytes} B)" in msg and f"rank {floor.rank} binds" in msg
    assert f"({floor.fitting_limit_bytes - 1} B)" in msg
    # ... and exactly the reported limit is feasible.
    r = solve_ilp(problem_for(g, memory_limit_bytes=floor.fitting_limit_bytes), **SOLVER)
    assert r.fits_memory and max(r.rank_memory_bytes) <= floor.fitting_limit_bytes


def test_memory_limit_moves_work_off_the_full_rank():
    g = layered(6)
    free = solve_ilp(problem_for(g), **SOLVER)
    tight = max(free.rank_memory_bytes) - 1
    r = solve_ilp(problem_for(g, memory_limit_bytes=tight), **SOLVER)
    assert max(r.rank_memory_bytes) <= tight
    assert r.bottleneck_s >= free.bottleneck_s


def test_hint_is_accepted_and_never_makes_it_worse():
    p = problem_for(layered(6), p=2, v=2)
    base = solve_ilp(p, **SOLVER)
    again = solve_ilp(p, hint=base, **SOLVER)
    assert again.bottleneck_s <= base.bottleneck_s
    with pytest.raises(ValueError, match="hint lacks"):
        solve_ilp(p, hint={"embed": 0})


def test_ilp_beats_chain_dp_when_a_tensor_feeds_two_later_stages():
    # One wide tensor (node 0) is read by every later node: a chain split must
    # send it to every stage after the first, the DAG optimum keeps its readers together.
    g = nx.DiGraph()
    g.add_node(0, fwd=0.0, bwd=0.0, out_bytes=1000)
    for i in range(1, 7):
        g.add_node(i, fwd=1.0, bwd=0.0, out_bytes=0)
        g.add_edge(0, i)
    p = PartitionProblem(graph=g, num_stages=3, stage_to_rank=(0, 1, 2), inflight=(1, 1, 1),
                         bandwidth_bytes_per_s=1000.0)
    r = solve_ilp(p, **SOLVER)
    best, _ = brute_force(g, dict(num_stages=3, stage_to_rank=(0, 1, 2), inflight=(1, 1, 1),
                                  bandwidth_bytes_per_s=1000.0))
    assert r.bottleneck_s == pytest.approx(best)
    assert solve_chain_dp(p).bottleneck_s >= r.bottleneck_s
