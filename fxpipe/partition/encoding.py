"""CP-SAT encoding of "node i runs in stage k", shared by the ILP and the memory floor.

Order (ladder) encoding: ``ge[i][k]`` is the literal [stage(i) >= k], with
ge[i][0] = 1 and ge[i][S] = 0, so [stage(i) = k] = ge[i][k] - ge[i][k+1] is a
linear expression, not a variable. Precedence u -> v becomes the clauses
ge[u][k] <= ge[v][k]: binary implications that propagate completely and whose LP
relaxation is integral (a closure / precedence polytope), which is why this
encoding beats one Boolean per (node, stage) with an all-different-style
"exactly one" row. Literals outside a node's window [lo, hi] are the constants 0/1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # imported where a model is solved: ortools (and the pandas it loads) cost
    from ortools.sat.python import cp_model  # ~1 s of every worker's start otherwise

from fxpipe.partition.problem import PartitionProblem


class StageEncoding:
    """Stage variables of every node of ``problem`` inside ``model``."""

    def __init__(self, model: cp_model.CpModel, problem: PartitionProblem,
                 lo: Sequence[int] | None = None, hi: Sequence[int] | None = None) -> None:
        s, n = problem.num_stages, problem.num_nodes
        self.model, self.problem = model, problem
        self.lo = list(lo) if lo is not None else [0] * n
        self.hi = list(hi) if hi is not None else [s - 1] * n
        self.ge: list[list] = []
        for i in range(n):
            assert 0 <= self.lo[i] <= self.hi[i] < s, (i, self.lo[i], self.hi[i])
            row = [1 if k <= self.lo[i] else 0 if k > self.hi[i] else model.NewBoolVar(f"ge_{i}_{k}")
                   for k in range(s + 1)]
            self.ge.append(row)
            for k in range(self.lo[i] + 1, self.hi[i]):
                model.AddImplication(row[k + 1], row[k])
        for u, vs in enumerate(problem.succ):
            for v in vs:
                for k in range(1, s):
                    a, b = self.ge[u][k], self.ge[v][k]
                    if not isinstance(a, int) and not isinstance(b, int):
                        model.AddImplication(a, b)
                    elif isinstance(a, int) and isinstance(b, int):
                        assert a <= b, f"windows violate edge {u}->{v} at stage {k}"
                    elif isinstance(a, int) and a == 1:
                        model.Add(b == 1)
                    elif isinstance(b, int) and b == 0:
                        model.Add(a == 0)
        for k in range(s):  # every stage non-empty
            model.Add(sum(self.x(i, k) for i in range(n) if self.lo[i] <= k <= self.hi[i]) >= 1)

    def x(self, i: int, k: int):
        """[stage(i) == k] as a linear expression (or the constant 0/1)."""
        return self.ge[i][k] - self.ge[i][k + 1]

    def can_be(self, i: int, k: int) -> bool:
        return self.lo[i] <= k <= self.hi[i]

    def rank_memory(self, rank: int):
        """Linear expression: bytes rank ``rank`` holds (static + inflight·act)."""
        p = self.problem
        terms = []
        for k in p.rank_stages(rank):
            m = p.inflight[k]
            terms.extend((p.static_bytes[i] + m * p.act_bytes[i]) * self.x(i, k)
                         for i in range(p.num_nodes) if self.can_be(i, k))
        return sum(terms)

    def add_hint(self, stages: Sequence[int]) -> None:
        for i, row in enumerate(self.ge):
            for k, lit in enumerate(row):
                if not isinstance(lit, int):
                    self.model.AddHint(lit, int(stages[i] >= k))

    def stages(self, solver: cp_model.CpSolver) -> list[int]:
        out = []
        for row in self.ge:
            out.append(sum(int(lit) if isinstance(lit, int) else solver.Value(lit) for lit in row[1:-1]))
        return out


def solver_for(time_limit_s: float, seed: int, num_workers: int) -> cp_model.CpSolver:
    """A CP-SAT solver whose answer depends only on (model, seed, num_workers).

    The limit is deterministic time (CP-SAT's work counter, calibrated to about a
    second): a wall-clock limit would stop the same search at a load-dependent
    point. With several workers ``interleave_search`` selects CP-SAT's
    deterministic batch loop (sat_parameters.proto: "The search is deterministic
    (independently of num_workers!)"). A wall-clock cap of 3x + 5 s stays as a
    safety net; if it ever fires, the run is not reproducible.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = seed
    prm.num_workers = num_workers
    prm.interleave_search = num_workers > 1
    prm.max_deterministic_time = time_limit_s
    prm.max_time_in_seconds = 3 * time_limit_s + 5
    return solver
