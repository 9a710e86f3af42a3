"""Chain dynamic program: the best contiguous split of one topological order.

Cutting a topological order into S contiguous, non-empty pieces always gives a
convex, ordered assignment, and the best such split is the classic linear
partition problem (min over the last cut of max(best prefix, last piece)),
O(S·n²) — here vectorised over the cut position with numpy. It is the ILP's
warm start and the ``dp`` baseline (PipeDream's planner solves the same
recurrence over layers; Narayanan et al., SOSP'19 §3.1).

Communication inside the DP: a piece [j, i) receives each earlier output that
one of its nodes consumes (exact), and sends each of its outputs that has a
consumer at or after i *once*. The true model sends once per distinct later
consumer stage, which the DP cannot see without remembering later cuts; the two
agree unless one tensor feeds two later stages. The returned result is always
scored with the exact model (:mod:`fxpipe.partition.cost`).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from fxpipe.partition.cost import DIRECTIONS, trivial_lower_bound_s
from fxpipe.partition.problem import PartitionProblem
from fxpipe.partition.result import Method, PartitionResult, SolveStatus, make_result

ColumnFn = Callable[[int], np.ndarray]
"""column(i)[j] = cost of the piece [j, i) as one stage, for j in 0..i-1."""


def min_max_split(num_items: int, num_parts: int, column: ColumnFn,
                  memory: Callable[[int, int], np.ndarray] | None = None) -> list[int] | None:
    """Part index of each item for the min-max contiguous split, or None if ``memory``
    rules every split out. ``memory(k, i)[j]`` is True when [j, i) fits as part k."""
    n, s = num_items, num_parts
    assert 1 <= s <= n
    best = np.full((s, n + 1), np.inf)
    cut = np.zeros((s, n + 1), dtype=np.int64)
    for i in range(1, n + 1):
        col = column(i)
        for k in range(min(s, i)):
            lo = k  # parts 0..k-1 need one item each
            cand = col[lo:i] if k == 0 else np.maximum(best[k - 1, lo:i], col[lo:i])
            if k == 0:
                cand = cand[:1]  # part 0 starts at item 0
            if memory is not None:
                cand = np.where(memory(k, i)[lo:lo + len(cand)], cand, np.inf)
            j = int(np.argmin(cand))
            best[k, i], cut[k, i] = cand[j], lo + j
    if not np.isfinite(best[s - 1, n]):
        return None
    parts, i = [0] * n, n
    for k in range(s - 1, -1, -1):
        j = int(cut[k, i])
        parts[j:i] = [k] * (i - j)
        i = j
    assert i == 0
    return parts


def stage_time_columns(problem: PartitionProblem) -> ColumnFn:
    """Column function of stage time (compute + approximate comm, see module doc)."""
    n = problem.num_nodes
    compute_prefix = np.concatenate([[0.0], np.cumsum(problem.compute_s)])
    t2 = DIRECTIONS * problem.transfer_s
    last_succ = np.array([max(vs) if vs else -1 for vs in problem.succ])
    last_succ_below = np.full(n, -1)  # per producer: latest consumer position < i
    state = {"i": 0}

    def column(i: int) -> np.ndarray:
        assert i == state["i"] + 1, "columns are generated in order"
        state["i"] = i
        for u in problem.pred[i - 1]:
            last_succ_below[u] = i - 1
        compute = compute_prefix[i] - compute_prefix[:i]
        # recv[j] = Σ_u t2_u over producers u < j with a consumer in [j, i).
        has = (last_succ_below >= 0) & (t2 > 0)
        producers = np.nonzero(has)[0]
        diff = np.bincount(producers + 1, weights=t2[producers], minlength=n + 2)
        diff -= np.bincount(last_succ_below[producers] + 1, weights=t2[producers], minlength=n + 2)
        recv = np.cumsum(diff)[:i]
        # send[j] = Σ t2_u over u in [j, i) whose output is consumed at or after i.
        w = np.where(last_succ[:i] >= i, t2[:i], 0.0)
        send = np.cumsum(w[::-1])[::-1]
        return compute + recv + send

    return column


def stage_memory_masks(problem: PartitionProblem, budgets: Sequence[float]):
    """memory(k, i)[j]: piece [j, i) fits stage k's byte budget."""
    static = np.concatenate([[0], np.cumsum(problem.static_bytes, dtype=np.float64)])
    act = np.concatenate([[0], np.cumsum(problem.act_bytes, dtype=np.float64)])

    def memory(k: int, i: int) -> np.ndarray:
        need = (static[i] - static[:i]) + problem.inflight[k] * (act[i] - act[:i])
        return need <= budgets[k]

    return memory


def chain_dp_stages(problem: PartitionProblem) -> tuple[list[int], bool]:
    """(stage per node, honours memory). Memory is exact when every rank runs one
    stage; with interleaving each stage gets an equal share of its rank's limit
    (a heuristic). If no split fits, the memory-blind optimum is returned."""
    n, s = problem.num_nodes, problem.num_stages
    limit = problem.memory_limit_bytes
    if limit is not None:
        share = [len(problem.rank_stages(r)) for r in problem.stage_to_rank]
        budgets = [limit / c for c in share]
        parts = min_max_split(n, s, stage_time_columns(problem), stage_memory_masks(problem, budgets))
        if parts is not None:
            return parts, True
    parts = min_max_split(n, s, stage_time_columns(problem))
    assert parts is not None
    return parts, limit is None


def solve_chain_dp(problem: PartitionProblem) -> PartitionResult:
    """The ``dp`` method: optimal contiguous split of ``problem.nodes`` (see module doc).

    Never raises for memory: when no contiguous split fits, the result has
    ``fits_memory == False`` (the ILP raises with the smallest feasible limit)."""
    start = time.perf_counter()
    parts, _ = chain_dp_stages(problem)
    return make_result(problem, parts, method=Method.DP, status=SolveStatus.HEURISTIC,
                       lower_bound_s=trivial_lower_bound_s(problem),
                       wall_time_s=time.perf_counter() - start)
