"""Time a pipeline with fxpipe's simulator; in-flight microbatches in closed form.

Large m: generating a schedule is Python work linear in p·m·v, so when p·m·v exceeds
``budget`` the planner simulates m1 and m1 + p microbatches (m1 ≡ m mod p, m1 >= 2p,
p·m1·v about the budget) and extrapolates linearly — one more group of p
microbatches adds one steady-state period. This is exact for 1F1B and ZB-H1 from
m1 = 2p (tested against direct simulation with unequal stages) and for interleaved
once the steady state is reached, which the budget (m1·v >= 8000/p) ensures in
practice; with strongly unequal interleaved stages it stays within ~2% (tested).
A rank's finish is never put below its own compute.

Vocabulary passes: the schedule is the generated one with ``add_vocab_passes`` at unit
times, the placement ``ParallelConfig.schedule_ir`` gives the runtime, so the plan times
what ``fxpipe run --vocab-passes`` executes; the durations carry each rank's S and T
and the collectives' seconds come as ``collectives``. The same extrapolation applies
(tested against direct simulation).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fxpipe.planner.options import ScheduleKind
from fxpipe.schedules.generators.interleaved import microbatch_groups
from fxpipe.schedules.registry import generate
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.simulate import StageDurations, simulate
from fxpipe.schedules.vocab_actions import add_vocab_passes


@dataclass(frozen=True, kw_only=True)
class PipelineTiming:
    """The simulator's answer for one iteration of one pipeline."""

    makespan: float
    """First start to last compute end, seconds."""
    finish: tuple[float, ...]
    """Per rank: its last compute end."""
    busy: tuple[float, ...]
    """Per rank: its compute seconds (m × its stages' F + B)."""
    in_flight: tuple[int, ...]
    """Per rank: peak chunk-microbatches whose activations are held."""
    simulated: tuple[int, ...]
    """The m values actually simulated (one, or two when extrapolated)."""


@lru_cache(maxsize=128)
def _schedule(kind: ScheduleKind, p: int, m: int, v: int, vocab: bool) -> Schedule:
    schedule = generate(kind.value, p, m, v)
    return add_vocab_passes(schedule) if vocab else schedule


def in_flight(kind: ScheduleKind, p: int, m: int, v: int) -> tuple[int, ...]:
    """Peak chunk-microbatches per rank (docs/schedules.md; checked against the simulator):
    1F1B min(p−r, m); ZB-H1 min(p, m) (deferred W's keep their inputs); interleaved
    min(warmup_r + 1, m·v) with warmup_r = (v−1)·g0 + 2(p−1−r), g0 the first group's size."""
    if kind is ScheduleKind.ZB_H1:
        return (min(p, m),) * p
    if kind is ScheduleKind.ONE_F_ONE_B or v == 1:
        return tuple(min(p - r, m) for r in range(p))
    g0 = len(microbatch_groups(p, m)[0])
    total = m * v
    return tuple(min(min((v - 1) * g0 + 2 * (p - 1 - r), total) + 1, total) for r in range(p))


def vocab_in_flight(kind: ScheduleKind, p: int, m: int, v: int) -> int:
    """Most microbatches a rank holds between its S and its T (its block's logits and its
    copy of the head's input) under ``add_vocab_passes``' placement: 1 for 1F1B and ZB-H1
    and for interleaved when its microbatch groups are equal (exact); else at most v, the
    bound used (both checked against the schedules' action lists)."""
    if kind is not ScheduleKind.INTERLEAVED or v == 1:
        return 1
    return 1 if len({len(g) for g in microbatch_groups(p, m)}) == 1 else v


def _run(kind: ScheduleKind, p: int, m: int, v: int, durations: StageDurations,
         collectives: tuple[float, float, float] | None) -> tuple[float, np.ndarray]:
    sched = _schedule(kind, p, m, v, collectives is not None)
    res = simulate(sched, durations, collective_latency=collectives)
    finish = np.array([float(e.max()) if len(e) else 0.0 for e in res.timeline.end])
    return res.makespan, finish


def simulate_pipeline(kind: ScheduleKind, p: int, m: int, v: int, durations: StageDurations,
                      *, collectives: tuple[float, float, float] | None = None,
                      budget: int = 8000) -> PipelineTiming:
    """Makespan and per-rank finish times of ``kind`` with per-stage ``durations``
    (F, B, W per microbatch; p2p already inside them). ``collectives``: seconds of
    BCAST_H, ALLREDUCE_S, REDUCE_G — the schedule runs vocabulary passes, whose S and T
    per rank ``durations.vocab_forward/vocab_backward`` give."""
    S = p * v
    assert durations.num_stages == S, (durations.num_stages, S)
    vocab = collectives is not None
    assert vocab == bool(durations.vocab_forward) and (not vocab or p > 1), (vocab, p)
    f, b = np.asarray(durations.forward), np.asarray(durations.backward)
    per_mb = np.array([sum(f[k] + b[k] for k in range(r, S, p)) for r in range(p)])
    if vocab:
        per_mb += np.asarray(durations.vocab_forward) + np.asarray(durations.vocab_backward)
    busy = tuple((m * per_mb).tolist())
    flight = in_flight(kind, p, m, v)
    if p == 1:  # no pipeline: the rank just runs its work
        return PipelineTiming(makespan=busy[0], finish=busy, busy=busy, in_flight=flight, simulated=())
    base = max(2 * p, budget // (p * v) - p)
    if m <= base + p:
        makespan, finish = _run(kind, p, m, v, durations, collectives)
        return PipelineTiming(makespan=makespan, finish=tuple(finish.tolist()), busy=busy,
                              in_flight=flight, simulated=(m,))
    m1 = base + (m - base) % p
    m2 = m1 + p
    span1, fin1 = _run(kind, p, m1, v, durations, collectives)
    span2, fin2 = _run(kind, p, m2, v, durations, collectives)
    k = (m - m1) / p
    # A rank cannot finish before its own compute: the floor only acts where interleaved
    # extrapolation undershoots (unequal stages, see the module docstring).
    finish = np.maximum(fin1 + k * (fin2 - fin1), m * per_mb)
    return PipelineTiming(makespan=float(max(span1 + k * (span2 - span1), finish.max())),
                          finish=tuple(finish.tolist()), busy=busy, in_flight=flight, simulated=(m1, m2))
