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

``add_vocab_passes`` inserts these into any generated schedule (1F1B,
interleaved, ZB-H1, ZB-V; compute-only or lowered) without reordering its
actions. Placement: the schedule's unit-duration dry run (the rounds ``lower``
uses) gives every action a round; rank r gets the S block of j at the boundary
just after the round of the last stage's F of j (as early as the dependence
allows) and the T block just before the round of the last stage's backward of j
(as late as it allows), so the statistics all-reduce overlaps whatever each rank
runs in between. Every rank cuts its list at the same boundaries, so

- the collectives come in one order on every rank (blocks sorted by boundary,
  then S before T, then microbatch): NCCL-style collectives cannot mismatch;
- a boundary sits between the same rounds on every rank, so a SEND/RECV batch of
  round t is on the same side of a block on both partners (``lower``'s
  induction on rounds still holds);
- S follows the F it reads and T precedes the backward that reads it.

``validate`` re-checks all three by execution.
"""
from __future__ import annotations

import numpy as np

from . import _sim_core
from .ir import Action, ActionKind, Schedule
from .simulate import StageDurations, kernel_error
from .validate import check_structure

F, B, I = ActionKind.F, ActionKind.B, ActionKind.I  # noqa: E741
S, T = ActionKind.S, ActionKind.T
BCAST_H, ALLREDUCE_S, REDUCE_G = ActionKind.BCAST_H, ActionKind.ALLREDUCE_S, ActionKind.REDUCE_G
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


def vocab_block_stage(schedule: Schedule, rank: int) -> int:
    """The stage field of rank ``rank``'s vocabulary actions: its vocabulary block,
    which is stage ``rank`` (it lives on rank ``rank`` under both placements)."""
    assert schedule.stage_ranks[rank] == rank, schedule.stage_ranks
    return rank


def _rounds(schedule: Schedule) -> dict[Action, int]:
    """Round of every compute action in the unit-duration dry run (as ``lower``)."""
    base = schedule.compute_only()
    check_structure(base)
    arr = base.arrays
    status, start, _end, blocked, _peak, _busy, _finish = _sim_core.simulate_kernel(
        arr.kind, arr.stage, arr.microbatch, arr.offsets, arr.stage_ranks, np.ones((6, base.num_stages)),
        0.0, base.num_microbatches, np.zeros(3),
    )
    if status != _sim_core.OK:
        raise kernel_error(base, status, blocked)
    flat = [a for acts in base.actions for a in acts]
    return dict(zip(flat, start.astype(np.int64).tolist()))


def _round_of(a: Action, rounds: dict[Action, int], backward: dict[tuple[int, int], int]) -> int:
    """A comm action belongs to the round of the compute that produced its tensor."""
    if a.kind.is_compute:
        return rounds[a]
    if a.kind is SEND_F:
        return rounds[Action(a.stage, F, a.microbatch)]
    if a.kind is RECV_F:
        return rounds[Action(a.stage - 1, F, a.microbatch)]
    if a.kind is SEND_B:
        return backward[(a.stage, a.microbatch)]
    assert a.kind is RECV_B, a
    return backward[(a.stage + 1, a.microbatch)]


def add_vocab_passes(schedule: Schedule) -> Schedule:
    """``schedule`` with the output layer's S/T passes and their collectives on
    every rank (module docstring). The original actions keep their order:
    ``add_vocab_passes(s)`` without its vocabulary actions equals ``s``.

    >>> from fxpipe.schedules import generate
    >>> [str(a) for a in add_vocab_passes(generate("1f1b", 2, 2)).actions[0]]
    ['0F0', '0F1', '0BCAST_H0', '0S0', '0ALLREDUCE_S0', '0T0', '0REDUCE_G0', '0B0', '0BCAST_H1', '0S1', \
'0ALLREDUCE_S1', '0T1', '0REDUCE_G1', '0B1']
    """
    if schedule.has_vocab_passes:
        raise ValueError(f"{schedule.name}: the schedule already has vocabulary passes")
    if schedule.num_ranks < 2:
        raise ValueError("vocabulary passes split the output layer over pipeline ranks: need pp >= 2, got 1")
    rounds = _rounds(schedule)
    backward = {(a.stage, a.microbatch): t for a, t in rounds.items() if a.kind in (B, I)}
    last = schedule.num_stages - 1
    # Blocks as (boundary, phase, microbatch, kinds): the S block right after the
    # last stage's F, the T block right before its backward.
    blocks = []
    for j in range(schedule.num_microbatches):
        after_f = rounds[Action(last, F, j)] + 1
        before_b = backward[(last, j)]
        assert after_f <= before_b, (j, after_f, before_b)
        blocks.append((after_f, 0, j, (BCAST_H, S, ALLREDUCE_S)))
        blocks.append((before_b, 1, j, (T, REDUCE_G)))
    blocks.sort()
    out = []
    for r, acts in enumerate(schedule.actions):
        block_stage = vocab_block_stage(schedule, r)
        action_rounds = [_round_of(a, rounds, backward) for a in acts]
        assert action_rounds == sorted(action_rounds), f"rank {r}'s actions are not in round order"
        merged, k = [], 0
        for boundary, _phase, j, kinds in blocks:
            while k < len(acts) and action_rounds[k] < boundary:
                merged.append(acts[k])
                k += 1
            merged.extend(Action(block_stage, kind, j) for kind in kinds)
        merged.extend(acts[k:])
        out.append(merged)
    return schedule.with_actions(out)


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
