"""``partition(problem, method)``: one entry point for every method, by name."""
from __future__ import annotations

from typing import Any, Callable

from fxpipe.partition.baselines import solve_params, solve_uniform
from fxpipe.partition.chain_dp import solve_chain_dp
from fxpipe.partition.ilp import solve_ilp
from fxpipe.partition.problem import PartitionProblem
from fxpipe.partition.result import Method, PartitionResult

SOLVERS: dict[Method, Callable[..., PartitionResult]] = {
    Method.ILP: solve_ilp,
    Method.UNIFORM: solve_uniform,
    Method.PARAMS: solve_params,
    Method.DP: solve_chain_dp,
}


def partition(problem: PartitionProblem, method: Method | str = Method.ILP, **options: Any) -> PartitionResult:
    """Assign every node of ``problem`` to a stage with ``method`` (ilp, uniform, params, dp).

    ``options`` go to the ILP (time_limit_s, seed, num_workers, hint); the other
    methods take none.

    >>> import networkx as nx
    >>> g = nx.DiGraph()
    >>> nx.add_path(g, range(4))
    >>> nx.set_node_attributes(g, {i: {"fwd": 1.0, "bwd": 2.0, "layer": i} for i in g})
    >>> p = PartitionProblem(graph=g, num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))
    >>> partition(p, "uniform").stage_indices
    (0, 0, 1, 1)
    """
    method = Method.parse(method)
    if options and method is not Method.ILP:
        raise TypeError(f"method {method.value!r} takes no options, got {sorted(options)}")
    return SOLVERS[method](problem, **options)
