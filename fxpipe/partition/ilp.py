"""Optimal stage assignment on the DAG with OR-Tools CP-SAT.

Model (S stages, nodes in the problem's topological order, ``encoding.py`` for
the stage literals x(i, k) = [stage(i) = k]):

* minimise T subject to T >= load(k) for every stage k, where load(k) is the
  cost model of :mod:`fxpipe.partition.stage_cost` in integer ticks:
  compute(k) = Σ_i c_i·x(i, k);
  receive: r(u, b) >= x(v, b) - x(u, b) for every consumer v of u — u is sent to
  b iff a consumer sits at b and u does not (order makes "does not" mean "earlier");
  send: with a single consumer v, s(u, a) >= x(u, a) - x(v, a); with several,
  w(u, a) >= Σ_{b>a} r(u, b) - M·(1 - x(u, a)) counts the distinct later stages.
  Each r, s, w adds 2·t_u ticks (forward + backward). They are only bounded
  from below; minimising the max keeps the bottleneck stage's terms exact.
* per rank, Σ static + inflight·act <= limit (bytes, exact integers);
* redundant cuts that help propagation: the first k stages hold at most k·T of
  compute, the last S - k at most (S - k)·T.

Memory as the second objective (``memory_tiebreak`` = τ > 0): among the cuts whose
bottleneck is within τ of the best found — cuts that measurement noise cannot tell
apart —, a second solve takes the one whose fullest rank holds the least
(parameters, gradients, optimizer state and activations in flight: ``rank_memory``),
hinted with the first answer, so it is never worse in memory than that answer and
never more than τ slower.

Warm start: the chain DP (or the caller's hint), given to CP-SAT with AddHint
as a complete solution. Its objective UB also shrinks every node's stage window
without losing any solution at least as good: all ancestors of i (with i) fit in
stages 0..stage(i), so stage(i) >= ceil(anc_i / UB) - 1, and symmetrically
stage(i) <= S - ceil(desc_i / UB). On layered transformer graphs this leaves each
node two or three candidate stages.

Time resolution: seconds become integer ticks of tick = (total compute + an
upper bound on all transfer costs) / 10^7, every cost rounded *down*. Rounding down makes the tick
model a relaxation, so CP-SAT's bound times tick is a sound lower bound on the
true optimum; the returned assignment is within (terms in its bottleneck stage)
ticks of optimal, i.e. relative error ~ n / 10^7.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from fxpipe.partition.chain_dp import chain_dp_stages, fits_memory, rank_bytes
from fxpipe.partition.encoding import StageEncoding, solver_for
from fxpipe.partition.memory_floor import MemoryLimitError, memory_floor
from fxpipe.partition.problem import PartitionError, PartitionProblem
from fxpipe.partition.result import Method, PartitionResult, SolveStatus, make_result
from fxpipe.partition.stage_cost import DIRECTIONS, evaluate, transfers

if TYPE_CHECKING:  # imported where a model is solved: ortools (and the pandas it loads) cost
    from ortools.sat.python import cp_model  # ~1 s of every worker's start otherwise

TICKS_FOR_TOTAL = 10**7
TIEBREAK_TIME_S = 0.03
"""CP-SAT deterministic time for the memory tie-break's second solve."""
MAX_NODES = 5000  # the window bound below is O(n²); the ILP is meant for coarsened graphs


class _Ticks:
    """Integer costs of the ILP (see "Time resolution" above)."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.problem = problem
        c, t2 = problem.compute_s, DIRECTIONS * problem.transfer_s
        total = float(c.sum() + sum(t2[u] * len(vs) * 2 for u, vs in enumerate(problem.succ)))
        self.tick_s = total / TICKS_FOR_TOTAL if total > 0 else 1.0
        self.compute = [int(math.floor(v / self.tick_s)) for v in c]
        self.transfer = [int(math.floor(v / self.tick_s)) for v in t2]

    def loads(self, stages: Sequence[int]) -> list[int]:
        load = [0] * self.problem.num_stages
        for i, k in enumerate(stages):
            load[k] += self.compute[i]
        for u, a, b in transfers(self.problem, stages):
            load[a] += self.transfer[u]
            load[b] += self.transfer[u]
        return load


def _windows(problem: PartitionProblem, compute: list[int], ub: int) -> tuple[list[int], list[int]]:
    """Stage window [lo, hi] of each node among solutions with T <= ub (module doc)."""
    n, s = problem.num_nodes, problem.num_stages
    anc = np.zeros((n, n), dtype=bool)
    for v in range(n):
        for u in problem.pred[v]:
            anc[v] |= anc[u]
            anc[v, u] = True
    c = np.array(compute, dtype=np.float64)  # tick sums stay < 2^53: exact
    up, down = c.copy(), c.copy()            # compute of i with its ancestors / descendants
    for rows in range(0, n, 512):            # blocks keep the float copy of anc small
        block = anc[rows:rows + 512].astype(np.float64)
        up[rows:rows + 512] += block @ c
        down += block.T @ c[rows:rows + 512]
    lo = [max(0, -(-int(a) // ub) - 1) for a in up]
    hi = [min(s - 1, s - -(-int(d) // ub)) for d in down]
    return lo, hi


class _Model:
    """The CP-SAT model of the module docstring, with its auxiliary variables kept for hinting."""

    def __init__(self, problem: PartitionProblem, ticks: _Ticks, lo, hi, t_min: int, t_max: int) -> None:
        from ortools.sat.python import cp_model

        s = problem.num_stages
        m = self.model = cp_model.CpModel()
        enc = self.enc = StageEncoding(m, problem, lo, hi)
        self.bottleneck = m.NewIntVar(t_min, t_max, "bottleneck")
        load: list[list] = [[] for _ in range(s)]
        for i, c in enumerate(ticks.compute):
            for k in range(lo[i], hi[i] + 1) if c else ():
                load[k].append(c * enc.x(i, k))
        self.recv: dict[tuple[int, int], cp_model.IntVar] = {}
        self.send: dict[tuple[int, int], cp_model.IntVar] = {}
        for u, vs in enumerate(problem.succ):
            t = ticks.transfer[u]
            if not t or not vs:
                continue
            receivers = []
            for b in range(lo[u] + 1, max(hi[v] for v in vs) + 1):
                at_b = [v for v in vs if enc.can_be(v, b)]
                if at_b:
                    r = self.recv[u, b] = m.NewBoolVar(f"recv_{u}_{b}")
                    receivers.append(b)
                    for v in at_b:
                        m.Add(r >= enc.x(v, b) - enc.x(u, b))
                    load[b].append(t * r)
            for a in range(lo[u], hi[u] + 1):
                later = [v for v in vs if hi[v] > a]
                bs = [b for b in receivers if b > a]
                if not later or not bs:
                    continue
                w = self.send[u, a] = m.NewIntVar(0, len(bs), f"send_{u}_{a}")
                for v in later:
                    m.Add(w >= enc.x(u, a) - enc.x(v, a))
                if len(vs) > 1:
                    m.Add(w >= sum(self.recv[u, b] for b in bs) - len(bs) * (1 - enc.x(u, a)))
                load[a].append(t * w)
        for k in range(s):
            m.Add(self.bottleneck >= sum(load[k]))
        total = sum(ticks.compute)
        for k in range(1, s):  # prefix / suffix compute cuts
            before = sum(c * (1 - enc.ge[i][k]) for i, c in enumerate(ticks.compute) if c)
            m.Add(before <= k * self.bottleneck)
            m.Add(total - before <= (s - k) * self.bottleneck)
        if problem.memory_limit_bytes is not None:
            for r in range(problem.num_ranks):
                m.Add(enc.rank_memory(r) <= problem.memory_limit_bytes)
        m.Minimize(self.bottleneck)

    def even_memory(self, problem: PartitionProblem, stages: Sequence[int], stages_ticks: int,
                    bottleneck_max: int) -> None:
        """Re-aim the model: bottleneck at most ``bottleneck_max``, minimise the fullest
        rank's bytes; hinted with ``stages`` (whose bottleneck is ``stages_ticks``)."""
        m = self.model
        m.Add(self.bottleneck <= bottleneck_max)
        loads = [self.enc.rank_memory(r) for r in range(problem.num_ranks)]
        fullest = m.NewIntVar(0, sum(problem.static_bytes) + max(problem.inflight) * sum(problem.act_bytes),
                              "fullest_rank_bytes")
        for load in loads:
            m.Add(fullest >= load)
        m.ClearObjective()
        m.Minimize(fullest)
        m.ClearHints()
        self.hint(problem, stages, stages_ticks)

    def hint(self, problem: PartitionProblem, stages: Sequence[int], objective: int) -> None:
        self.enc.add_hint(stages)
        sent = transfers(problem, stages)
        received = {(u, b) for u, _, b in sent}
        sends = Counter((u, a) for u, a, _ in sent)
        for key, var in self.recv.items():
            self.model.AddHint(var, int(key in received))
        for key, var in self.send.items():
            self.model.AddHint(var, sends[key])
        self.model.AddHint(self.bottleneck, objective)


def _hint_stages(problem: PartitionProblem, hint) -> list[int]:
    if isinstance(hint, PartitionResult):
        hint = hint.stage_of
    if isinstance(hint, Mapping):
        missing = [n for n in problem.nodes if n not in hint]
        if missing:
            raise ValueError(f"hint lacks {len(missing)} node(s), e.g. {missing[0]!r}")
        hint = [hint[n] for n in problem.nodes]
    stages = [int(k) for k in hint]
    problem.check_stages(stages)
    return stages


def solve_ilp(problem: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0,
              num_workers: int = 1, hint: Mapping | Sequence[int] | PartitionResult | None = None,
              memory_tiebreak: float = 0.0) -> PartitionResult:
    """The ``ilp`` method (module docstring).

    ``time_limit_s`` is CP-SAT deterministic time (its work counter, about a second
    each); the answer depends only on (problem, seed, num_workers). One worker is
    the default: the windowed models are small and the deterministic multi-worker
    loop mostly adds synchronisation. ``hint``: a previous result or a node ->
    stage mapping, tried as warm start beside the chain DP.
    Raises :class:`~fxpipe.partition.memory_floor.MemoryLimitError` when no assignment
    fits the memory limit, with the smallest limit that does."""
    start = time.perf_counter()
    if problem.num_nodes > MAX_NODES:
        raise PartitionError(
            f"ilp takes at most {MAX_NODES} nodes, got {problem.num_nodes}; "
            f"coarsen(graph, max_groups=...) first (a few hundred groups is typical)")
    floor_kw = dict(time_limit_s=time_limit_s, seed=seed, num_workers=num_workers)
    if problem.num_stages == 1:
        only = [0] * problem.num_nodes
        if not fits_memory(problem, only):
            raise MemoryLimitError(problem, memory_floor(problem, **floor_kw))
        return make_result(problem, only, method=Method.ILP, status=SolveStatus.OPTIMAL,
                           lower_bound_s=_exact_bottleneck(problem, only),
                           wall_time_s=time.perf_counter() - start)
    ticks = _Ticks(problem)
    t_min = max(max(ticks.compute), -(-sum(ticks.compute) // problem.num_stages))
    candidates = [chain_dp_stages(problem)[0]] + ([_hint_stages(problem, hint)] if hint is not None else [])
    floor = None
    if not any(fits_memory(problem, c) for c in candidates):
        floor = memory_floor(problem, **floor_kw)
        if floor.lower_bound_bytes > problem.memory_limit_bytes:
            raise MemoryLimitError(problem, floor)
        candidates.append(list(floor.stages))
    feasible = [c for c in candidates if fits_memory(problem, c)]
    n, s = problem.num_nodes, problem.num_stages
    if feasible:
        incumbent = min(feasible, key=lambda c: (max(ticks.loads(c)), _exact_bottleneck(problem, c)))
        ub = max(max(ticks.loads(incumbent)), t_min)
        # The windows keep every cut up to the tie-break's slack over the incumbent: the
        # second solve may take one slower than the optimum by up to memory_tiebreak.
        wide = int(ub * (1 + memory_tiebreak))
        lo, hi = _windows(problem, ticks.compute, wide) if ub > 0 else ([0] * n, [s - 1] * n)
        model = _Model(problem, ticks, lo, hi, t_min, wide)
        model.hint(problem, incumbent, ub)
    else:  # memory is tight and nothing found fits yet: full windows, start near the floor
        incumbent = None
        model = _Model(problem, ticks, [0] * n, [s - 1] * n, t_min, sum(ticks.compute) + sum(ticks.transfer) * s)
        model.hint(problem, floor.stages, max(ticks.loads(floor.stages)))
    from ortools.sat.python import cp_model

    solver = solver_for(time_limit_s, seed, num_workers)
    status = solver.Solve(model.model)
    solved = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    if status == cp_model.INFEASIBLE:  # only possible without incumbent: a proof
        raise MemoryLimitError(problem, floor)
    if not solved and incumbent is None:
        raise PartitionError(
            f"CP-SAT found no assignment within the memory limit of {problem.memory_limit_bytes} B in "
            f"time_limit_s={time_limit_s} (status {solver.StatusName(status)}); the best found needs "
            f"{floor.fitting_limit_bytes} B per rank and none needs less than {floor.lower_bound_bytes} B. "
            f"Raise time_limit_s or the memory limit.")
    stages = model.enc.stages(solver) if solved else incumbent
    if incumbent is not None and _exact_bottleneck(problem, incumbent) < _exact_bottleneck(problem, stages):
        stages = incumbent  # equal in ticks, better in exact seconds
    bound_ticks = max(solver.BestObjectiveBound(), t_min) if solved else t_min
    if memory_tiebreak > 0 and solved:
        stages = _even_memory(problem, model, stages, ticks, memory_tiebreak, time_limit_s, seed, num_workers)
    return make_result(
        problem, stages, method=Method.ILP,
        status=SolveStatus.OPTIMAL if status == cp_model.OPTIMAL else SolveStatus.FEASIBLE,
        lower_bound_s=bound_ticks * ticks.tick_s,
        wall_time_s=time.perf_counter() - start, time_resolution_s=ticks.tick_s)


def _even_memory(problem: PartitionProblem, model: _Model, stages: list[int], ticks: _Ticks, tolerance: float,
                 time_limit_s: float, seed: int, num_workers: int) -> list[int]:
    """The cut within ``tolerance`` of ``stages``' bottleneck whose fullest rank holds
    the least (``stages`` itself unless one holds less)."""
    from ortools.sat.python import cp_model

    best = max(ticks.loads(stages))
    model.even_memory(problem, stages, best, int(best * (1 + tolerance)))
    # A short budget: the hint is already feasible, and a proof that no cut holds less is
    # worth little here (the 3% band is a judgement of noise, not an exact quantity).
    solver = solver_for(min(time_limit_s / 4, TIEBREAK_TIME_S), seed, num_workers)
    if solver.Solve(model.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return stages
    even = model.enc.stages(solver)
    return even if max(rank_bytes(problem, even)) < max(rank_bytes(problem, stages)) else stages


def _exact_bottleneck(problem: PartitionProblem, stages: Sequence[int]) -> float:
    return max(c.time_s for c in evaluate(problem, stages)[0])
