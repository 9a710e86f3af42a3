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
scored with the exact model (:mod:`fxpipe.partition.stage_cost`).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from fxpipe.partition.problem import PartitionProblem
from fxpipe.partition.result import Method, PartitionResult, SolveStatus, make_result
from fxpipe.partition.stage_cost import DIRECTIONS, evaluate, trivial_lower_bound_s

ColumnFn = Callable[[int, int], np.ndarray]
"""column(k, i)[j] = cost of the piece [j, i) as stage k, for j in 0..i-1."""


def min_max_split(num_items: int, num_parts: int, column: ColumnFn,
                  memory: Callable[[int, int], np.ndarray] | None = None) -> list[int] | None:
    """Part index of each item for the min-max contiguous split, or None if ``memory``
    rules every split out. ``memory(k, i)[j]`` is True when [j, i) fits as part k.
    Columns are requested in increasing i."""
    n, s = num_items, num_parts
    assert 1 <= s <= n
    best = np.full((s, n + 1), np.inf)
    cut = np.zeros((s, n + 1), dtype=np.int64)
    for i in range(1, n + 1):
        for k in range(min(s, i)):
            lo = k  # parts 0..k-1 need one item each
            hi = 1 if k == 0 else i  # part 0 starts at item 0
            cand = column(k, i)[lo:hi]
            if k > 0:
                cand = np.maximum(best[k - 1, lo:hi], cand)
            if memory is not None:
                cand = np.where(memory(k, i)[lo:hi], cand, np.inf)
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

    def column(k: int, i: int) -> np.ndarray:
        if i == state["i"]:
            return state["col"]
        assert i == state["i"] + 1, "columns are requested in increasing i"
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
        state["col"] = compute + recv + send
        return state["col"]

    return column


def memory_shares(problem: PartitionProblem, *, equal: bool = False) -> list[float]:
    """Fraction of its rank's limit each stage may use in the DP (1.0 when the rank
    runs one stage, so the DP is then exact). Default: proportional to what the
    stage would hold with an even 1/S of the graph, static/S + inflight·act/S —
    interleaved stages holding more microbatches get more room."""
    s = problem.num_stages
    expected = [1.0 if equal else sum(problem.static_bytes) / s + m * sum(problem.act_bytes) / s
                for m in problem.inflight]
    expected = [e if e > 0 else 1.0 for e in expected]
    rank_total = [0.0] * problem.num_ranks
    for k, r in enumerate(problem.stage_to_rank):
        rank_total[r] += expected[k]
    return [expected[k] / rank_total[r] for k, r in enumerate(problem.stage_to_rank)]


def _stage_memory(problem: PartitionProblem) -> Callable[[int, int], np.ndarray]:
    """memory(k, i)[j]: bytes the piece [j, i) needs as stage k."""
    static = np.concatenate([[0], np.cumsum(problem.static_bytes, dtype=np.float64)])
    act = np.concatenate([[0], np.cumsum(problem.act_bytes, dtype=np.float64)])
    return lambda k, i: (static[i] - static[:i]) + problem.inflight[k] * (act[i] - act[:i])


def min_memory_split(problem: PartitionProblem) -> list[int]:
    """Contiguous split minimising max_k memory(k) / share(k); with one stage per rank
    this is the smallest peak rank memory any contiguous split reaches."""
    memory, shares = _stage_memory(problem), memory_shares(problem)
    parts = min_max_split(problem.num_nodes, problem.num_stages, lambda k, i: memory(k, i) / shares[k])
    assert parts is not None
    return parts


def rank_bytes(problem: PartitionProblem, stages) -> list[int]:
    """Bytes each rank holds under ``stages``: static + inflight · activations of its nodes."""
    per_rank = [0] * problem.num_ranks
    for i, k in enumerate(stages):
        per_rank[problem.stage_to_rank[k]] += problem.static_bytes[i] + problem.inflight[k] * problem.act_bytes[i]
    return per_rank


def fits_memory(problem: PartitionProblem, stages) -> bool:
    return problem.memory_limit_bytes is None or max(rank_bytes(problem, stages)) <= problem.memory_limit_bytes


def chain_dp_stages(problem: PartitionProblem) -> tuple[list[int], bool]:
    """(stage per node, fits memory). Time-optimal contiguous split under per-stage
    byte budgets limit·share(k) — exact when every rank runs one stage, a heuristic
    with interleaving (two share rules are tried, the faster fit kept). If neither
    fits, the memory-minimal split if it fits, else the memory-blind optimum."""
    n, s = problem.num_nodes, problem.num_stages
    limit = problem.memory_limit_bytes
    if limit is None:
        return min_max_split(n, s, stage_time_columns(problem)), True
    memory = _stage_memory(problem)
    found = []
    for equal in (False, True) if problem.num_ranks < s else (False,):  # shares differ only if interleaved
        shares = memory_shares(problem, equal=equal)
        fits = lambda k, i, shares=shares: memory(k, i) <= limit * shares[k]  # noqa: E731
        parts = min_max_split(n, s, stage_time_columns(problem), fits)
        if parts is not None and fits_memory(problem, parts):
            found.append(parts)
    if found:
        return min(found, key=lambda c: max(t.time_s for t in evaluate(problem, c)[0])), True
    parts = min_memory_split(problem)
    if fits_memory(problem, parts):
        return parts, True
    return min_max_split(n, s, stage_time_columns(problem)), False


def solve_chain_dp(problem: PartitionProblem) -> PartitionResult:
    """The ``dp`` method: optimal contiguous split of ``problem.nodes`` (see module doc).

    Never raises for memory: when no contiguous split fits, the result has
    ``fits_memory == False`` (the ILP raises with the smallest feasible limit)."""
    start = time.perf_counter()
    parts, _ = chain_dp_stages(problem)
    return make_result(problem, parts, method=Method.DP, status=SolveStatus.HEURISTIC,
                       lower_bound_s=trivial_lower_bound_s(problem),
                       wall_time_s=time.perf_counter() - start)
