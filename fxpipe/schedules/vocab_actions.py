"""Vocabulary passes: the output layer run by every pipeline rank, as actions of their own.

Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism"
(MLSys 2025, arXiv 2411.05288) split the output layer's rows evenly over the
pipeline ranks and schedule its work as two passes per microbatch j on every rank:

- ``BCAST_H j``: the last stage's output hidden state of j goes to every rank;
- ``S j``: the rank's block of logits and its local max, sum-exp and target logit;
- ``ALLREDUCE_S j``: the statistics combined over the ranks (online softmax);
- ``T j``: the block's softmax gradient, its weight gradient and a partial
  gradient of the hidden state;
- ``REDUCE_G j``: the partial gradients summed on the last stage, whose B (or I)
  of j starts from them.

``add_vocab_passes`` inserts these into any generated compute-only schedule
(1F1B, interleaved, ZB-H1, ZB-V; ``lower`` adds SEND/RECV afterwards). Placement:
a simulation of the schedule (the caller's durations, else unit) gives every
action a start time; every rank gets the S block of j where the last stage's F of
j ends (as early as the dependence allows) and the T block where the last
stage's backward of j starts (as late as it allows), so the statistics
all-reduce overlaps whatever each rank runs in between. Every rank cuts its list
at the same times, so

- the collectives come in one order on every rank (blocks sorted by time, then
  S before T, then microbatch): NCCL-style collectives cannot mismatch;
- every dependence points forward in time (durations are positive), so the
  merged lists cannot deadlock;
- S follows the F it reads and T precedes the backward that reads it.

With ``offset`` d > 0 the forwards first run d backwards earlier on every rank
(``run_forwards_earlier``), so the last stage's backward of j comes d forwards
after its forward and the S/T barrier of j leaves the critical path (the slack
of Yeung et al.'s schedules, which hold p+1 or p+2 microbatches).

``validate`` re-checks all three by execution.
"""
from __future__ import annotations

import numpy as np

from fxpipe.schedules import _sim_core
from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.simulate import StageDurations, kernel_error, simulate
from fxpipe.schedules.validate import ScheduleError, check_structure

F, B, I = ActionKind.F, ActionKind.B, ActionKind.I  # noqa: E741
S, T = ActionKind.S, ActionKind.T
BCAST_H, ALLREDUCE_S, REDUCE_G = ActionKind.BCAST_H, ActionKind.ALLREDUCE_S, ActionKind.REDUCE_G


def vocab_block_stage(schedule: Schedule, rank: int) -> int:
    """The stage field of rank ``rank``'s vocabulary actions: its vocabulary block,
    which is stage ``rank`` (it lives on rank ``rank`` under both placements)."""
    if schedule.stage_ranks[rank] != rank:
        raise ValueError(f"{schedule.name}: vocabulary passes put rank r's block on stage r, but stage {rank} "
                         f"lives on rank {schedule.stage_ranks[rank]}: use a generated placement (loop or V)")
    return rank


_EPS = 1e-9


def _floored(durations: StageDurations) -> StageDurations:
    """Every time (F, I, W, B, S, T) at least _EPS: placement relies on the last
    stage's F ending after it starts and its backward starting before it ends."""
    f = tuple(max(x, _EPS) for x in durations.forward)
    b = tuple(max(x, 2 * _EPS) for x in durations.backward)
    w = tuple(min(max(x, _EPS), y - _EPS) for x, y in zip(durations.weight, b))
    return StageDurations(forward=f, backward=b, weight=w,
                          vocab_forward=tuple(max(x, _EPS) for x in durations.vocab_forward),
                          vocab_backward=tuple(max(x, _EPS) for x in durations.vocab_backward))


def start_times(schedule: Schedule,
                 durations: StageDurations | None) -> tuple[dict[Action, float], dict[Action, float]]:
    """Start and end of every action in a simulation of ``schedule`` (compute-only or
    lowered; unit durations if None): a time order every dependence follows."""
    n = schedule.num_stages
    d = np.ones((6, n)) if durations is None else _floored(durations).as_array()
    check_structure(schedule)
    arr = schedule.arrays
    status, start, _end, blocked, _peak, _busy, _finish = _sim_core.simulate_kernel(
        arr.kind, arr.stage, arr.microbatch, arr.offsets, arr.stage_ranks, d, 0.0,
        schedule.num_microbatches, np.zeros(3),
    )
    if status != _sim_core.OK:
        raise kernel_error(schedule, status, blocked)
    flat = [a for acts in schedule.actions for a in acts]
    return dict(zip(flat, start.tolist())), {a: e for a, e in zip(flat, _end.tolist())}


def run_forwards_earlier(schedule: Schedule, offset: int) -> Schedule:
    """Every rank runs each forward ``offset`` backwards earlier (an F that came
    after k backwards, B or I, now comes after max(0, k - offset)): 1F1B's warmup
    grows by ``offset``, and so does each rank's peak in flight. This is the slack
    Yeung et al. give the vocabulary passes (their 1F1B holds p+1 or p+2
    microbatches): the last stage's backward of j comes ``offset`` forwards after
    its forward, so S and T of j are no longer back to back on the critical path."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (forwards run that many backwards earlier), got {offset}")
    if offset == 0:
        return schedule
    out = []
    for acts in schedule.actions:
        backwards = 0
        keyed = []  # (slot, order): a forward moves to slot max(0, k - offset), before that slot's backward
        for n, a in enumerate(acts):
            if a.kind is F:
                keyed.append(((max(0, backwards - offset), 0), n, a))
            else:
                if a.kind in (B, I):
                    backwards += 1
                keyed.append(((backwards - (a.kind in (B, I)), 1), n, a))
        out.append([a for _key, _n, a in sorted(keyed, key=lambda x: (x[0], x[1]))])
    return schedule.with_actions(out)


def add_vocab_passes(schedule: Schedule, durations: StageDurations | None = None, *,
                     offset: int = 0, s_delay: float = 0.0, t_lead: float = 0.0) -> Schedule:
    """The compute-only ``schedule`` with the output layer's S/T passes and their
    collectives on every rank (module docstring); ``lower`` it afterwards.
    ``durations`` (of the stages without the output layer; None: unit) time the
    placement; ``offset``: forwards run that many backwards earlier first
    (``run_forwards_earlier``). ``s_delay`` moves each S block that much later,
    ``t_lead`` each T block that much earlier (in the durations' unit; clipped to
    keep S after the last stage's F, T before its backward and S before T);
    ``place_vocab_passes`` searches them. With offset 0 the original actions keep their
    order: ``add_vocab_passes(s)`` without its vocabulary actions equals ``s``.

    >>> from fxpipe.schedules import generate
    >>> [str(a) for a in add_vocab_passes(generate("1f1b", 2, 2)).actions[0]]
    ['0F0', '0F1', '0BCAST_H0', '0S0', '0ALLREDUCE_S0', '0T0', '0REDUCE_G0', '0B0', '0BCAST_H1', '0S1', \
'0ALLREDUCE_S1', '0T1', '0REDUCE_G1', '0B1']
    """
    if schedule.has_vocab_passes:
        raise ValueError(f"{schedule.name}: the schedule already has vocabulary passes")
    if schedule.is_lowered:
        raise ValueError(f"{schedule.name}: add vocabulary passes to the compute-only schedule, then lower it")
    if schedule.num_ranks < 2:
        raise ValueError("vocabulary passes split the output layer over pipeline ranks: need pp >= 2, got 1")
    schedule = run_forwards_earlier(schedule, offset)
    start, end = start_times(schedule, durations)
    return _place(schedule, start, end, s_delay, t_lead)


def _place(schedule: Schedule, start: dict[Action, float], end: dict[Action, float], s_delay: float,
           t_lead: float) -> Schedule:
    """Cut every rank's list at the block times (``start``/``end``: the times of
    ``schedule``'s actions in one simulation, where every dependence points forward)."""
    last = schedule.num_stages - 1
    backward = {a.microbatch: t for a, t in start.items() if a.stage == last and a.kind in (B, I)}
    # Blocks as (time, phase, microbatch, kinds): the S block once the last stage's
    # F ends, the T block when its backward starts. An action starting before the
    # time stays before the block on every rank, so every dependence points forward
    # in time and the blocks come in one order everywhere (the collectives match).
    blocks = []
    for j in range(schedule.num_microbatches):
        after_f = end[Action(last, F, j)]
        assert after_f <= backward[j], (j, after_f, backward[j])
        t_time = max(after_f, backward[j] - t_lead)
        blocks.append((min(after_f + s_delay, t_time), 0, j, (BCAST_H, S, ALLREDUCE_S)))
        blocks.append((t_time, 1, j, (T, REDUCE_G)))
    blocks.sort()
    out = []
    for r, acts in enumerate(schedule.actions):
        block_stage = vocab_block_stage(schedule, r)
        merged, k = [], 0
        for time, _phase, j, kinds in blocks:
            while k < len(acts) and start[acts[k]] < time:
                merged.append(acts[k])
                k += 1
            merged.extend(Action(block_stage, kind, j) for kind in kinds)
        merged.extend(acts[k:])
        out.append(merged)
    return schedule.with_actions(out)


def place_vocab_passes(schedule: Schedule, durations: StageDurations, *, p2p_latency: float = 0.0,
                       collective_latency=None, offsets: tuple[int, ...] = (0, 1, 2),
                       rounds: int = 3) -> Schedule:
    """``add_vocab_passes`` with the offset, S delay and T lead that give the
    shortest simulated step under ``durations`` (with the vocabulary passes' own
    times; see ``split_output_layer``). The delays are tried in steps of half the
    longest stage time; each candidate is re-cut ``rounds`` times at the times of
    its own simulation (which include the passes and their waits: a simulation is
    still a time order every dependence follows). The cut at unit times
    (``add_vocab_passes(schedule, offset=...)``) is a candidate too, so the result is
    never slower under ``durations`` than the unit placement. Ties keep the first
    found, the smaller offset (less activation memory)."""

    floored = _floored(durations)

    def timed(candidate):
        result = simulate(candidate, floored, p2p_latency=p2p_latency, collective_latency=collective_latency)
        start, end = {}, {}
        for acts, starts, ends in zip(candidate.actions, result.timeline.start, result.timeline.end):
            for a, t0, t1 in zip(acts, starts.tolist(), ends.tolist()):
                start[a], end[a] = t0, t1
        return result.makespan, start, end

    slot = max(f + b for f, b in zip(durations.forward, durations.backward))
    steps = (0.0, 0.5 * slot, slot, 2.0 * slot)
    best = None
    for offset in offsets:
        base = run_forwards_earlier(schedule, offset)
        try:
            start_times(base, durations)
        except ScheduleError:  # forwards this much earlier wait on a backward behind them: skip
            if offset == 0:
                raise
            continue
        for s_delay in steps:
            for t_lead in steps:
                candidate = add_vocab_passes(schedule, durations, offset=offset, s_delay=s_delay, t_lead=t_lead)
                for _ in range(rounds + 1):
                    span, start, end = timed(candidate)
                    if best is None or span < best[0] - 1e-9:
                        best = (span, candidate)
                    candidate = _place(base, start, end, s_delay, t_lead)
        unit = add_vocab_passes(schedule, offset=offset)
        span = timed(unit)[0]
        if span < best[0] - 1e-9:
            best = (span, unit)
    return best[1]


def split_output_layer(durations: StageDurations, num_ranks: int, *, forward: float, backward: float,
                       weight: float | None = None) -> StageDurations:
    """Durations for a schedule with vocabulary passes, from ``durations`` whose last
    stage holds the whole output layer (its ``forward``/``backward``/``weight`` part
    given here): the last stage sheds it and every rank's S and T take 1/p of it
    (Yeung et al.'s even split of the vocabulary)."""
    weight = backward / 2 if weight is None else weight
    last = durations.num_stages - 1
    if not (0 <= forward <= durations.forward[last] and 0 <= backward <= durations.backward[last]
            and 0 <= weight <= min(backward, durations.weight[last])):
        raise ValueError(
            f"the output layer (F={forward}, B={backward}, W={weight}) must fit in the last stage "
            f"(F={durations.forward[last]}, B={durations.backward[last]}, W={durations.weight[last]})"
        )

    def shed(values: tuple[float, ...], amount: float) -> tuple[float, ...]:
        return values[:last] + (values[last] - amount,)

    return StageDurations(
        forward=shed(durations.forward, forward),
        backward=shed(durations.backward, backward),
        weight=shed(durations.weight, weight),
        vocab_forward=(forward / num_ranks,) * num_ranks,
        vocab_backward=(backward / num_ranks,) * num_ranks,
    )
