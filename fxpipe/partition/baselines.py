"""The partitioners of existing systems, scored with our cost model.

Neither looks at memory or communication; a result that overflows the limit
says so in ``fits_memory`` instead of raising, so the comparison table can show it.
"""
from __future__ import annotations

import time

import numpy as np

from fxpipe.partition.chain_dp import min_max_split
from fxpipe.partition.problem import PartitionError, PartitionProblem
from fxpipe.partition.result import Method, PartitionResult, SolveStatus, make_result
from fxpipe.partition.stage_cost import trivial_lower_bound_s


def uniform_stages(problem: PartitionProblem) -> list[int]:
    """Megatron-LM's default split: L transformer layers over S stages, L // S each,
    the remainder one extra to each of the first stages (Megatron requires L % S == 0;
    this is the natural generalisation). Interleaved chunk k gets the k-th slice too
    (Narayanan et al., SC21 §2.2.2).

    Nodes outside the layers follow the data: those fed only by non-layer nodes
    (embedding, position ids, labels) go as late as their consumers allow — stage 0
    for the embedding, the last stage for labels; those downstream of a layer (final
    norm, LM head, loss) go to the latest stage among their inputs, i.e. S - 1."""
    s, n = problem.num_stages, problem.num_nodes
    layers = sorted({l for l in problem.layer if l is not None})
    if len(layers) < s:
        raise PartitionError(
            f"uniform needs at least one transformer layer per stage: {len(layers)} layers, "
            f"{s} stages; use fewer stages or another method (ilp, dp)")
    q, r = divmod(len(layers), s)
    first_layer_of = np.cumsum([0] + [q + 1 if k < r else q for k in range(s)])
    layer_stage = {l: int(np.searchsorted(first_layer_of, pos, side="right") - 1)
                   for pos, l in enumerate(layers)}

    after_layer = [False] * n  # has a layered node among its ancestors (or is one)
    stage = [-1] * n
    for v in range(n):  # forward: layered nodes and everything downstream of them
        after_layer[v] = problem.layer[v] is not None or any(after_layer[u] for u in problem.pred[v])
        if not after_layer[v]:
            continue
        inputs = [stage[u] for u in problem.pred[v] if after_layer[u]]
        own = layer_stage[problem.layer[v]] if problem.layer[v] is not None else 0
        stage[v] = max([own, *inputs])  # push forward if an input sits later
    for v in reversed(range(n)):  # backward: the embedding side, as late as allowed
        if not after_layer[v]:
            stage[v] = min((stage[w] for w in problem.succ[v]), default=0)
    return stage


def params_stages(problem: PartitionProblem) -> list[int]:
    """DeepSpeed's ``partition_method='parameters'``: a contiguous split minimising the
    largest per-stage parameter count (``ds_utils.partition_balanced``, the linear
    partition problem). DeepSpeed splits a list of modules; here a *unit* is one
    node with parameters plus the parameter-free nodes after it in topological
    order, so a cut always falls right before a parameterised node, as between
    modules."""
    s, n = problem.num_stages, problem.num_nodes
    starts = [0] + [i for i in range(1, n) if problem.params[i] > 0]
    if len(starts) < s:  # too few parameterised nodes: fall back to single nodes
        starts = list(range(n))
    weights = np.array([sum(problem.params[a:b]) for a, b in zip(starts, [*starts[1:], n])], dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    unit_parts = min_max_split(len(starts), s, lambda k, i: prefix[i] - prefix[:i])
    assert unit_parts is not None
    stage = [0] * n
    for u, (a, b) in enumerate(zip(starts, [*starts[1:], n])):
        stage[a:b] = [unit_parts[u]] * (b - a)
    return stage


def _result(problem: PartitionProblem, method: Method, stages_fn) -> PartitionResult:
    start = time.perf_counter()
    stages = stages_fn(problem)
    if len(set(stages)) < problem.num_stages:
        raise PartitionError(
            f"{method.value} left stages {sorted(set(range(problem.num_stages)) - set(stages))} "
            f"empty on this graph; use method ilp or dp")
    return make_result(problem, stages, method=method, status=SolveStatus.HEURISTIC,
                       lower_bound_s=trivial_lower_bound_s(problem),
                       wall_time_s=time.perf_counter() - start)


def solve_uniform(problem: PartitionProblem) -> PartitionResult:
    return _result(problem, Method.UNIFORM, uniform_stages)


def solve_params(problem: PartitionProblem) -> PartitionResult:
    return _result(problem, Method.PARAMS, params_stages)
