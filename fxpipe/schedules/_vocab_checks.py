"""The validator's rules for vocabulary passes (``vocab_actions.py``).

Completeness asks, per rank and microbatch, one S, one T and one of each
collective, and every rank must post the collectives in one order (NCCL matches
collectives by their order: ranks that disagree hang or mix tensors). In the
execution a collective is posted without blocking, after what it sends (the last
stage's F for BCAST_H, the rank's S for ALLREDUCE_S, its T for REDUCE_G), and
completes once every rank posted it and the collective before it completed; S
waits for its BCAST_H, T for its ALLREDUCE_S, and the last stage's B or I for
its REDUCE_G. These functions return what is wrong; validate.py raises it with
the grid.
"""
from __future__ import annotations

from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.schedule import Schedule

F, S, T = ActionKind.F, ActionKind.S, ActionKind.T
BCAST_H, ALLREDUCE_S, REDUCE_G = ActionKind.BCAST_H, ActionKind.ALLREDUCE_S, ActionKind.REDUCE_G


def expected_vocab(schedule: Schedule) -> set[Action]:
    """The vocabulary actions the schedule must hold, each once: per rank r (on its
    vocabulary block, stage r) and microbatch, S, T and the three collectives."""
    if not schedule.has_vocab_passes:
        return set()
    kinds = (BCAST_H, S, ALLREDUCE_S, T, REDUCE_G)
    return {Action(r, k, j) for r in range(schedule.num_ranks) for k in kinds for j in range(schedule.num_microbatches)}


def vocab_needs(schedule: Schedule, a: Action, rank: int) -> list[tuple]:
    """What vocabulary action ``a`` on ``rank`` waits for (validate._needs' keys;
    ("k", (kind, microbatch)) is a completed collective). A collective's needs are
    what it sends, and must be done when the rank posts it."""
    j, last = a.microbatch, schedule.num_stages - 1
    if a.kind is S:  # reads the broadcast hidden state
        return [("k", (BCAST_H, j))]
    if a.kind is T:  # reads its logits (S) and the combined statistics
        return [("c", Action(a.stage, S, j)), ("k", (ALLREDUCE_S, j))]
    if a.kind is BCAST_H:  # the root sends the last stage's output
        return [("c", Action(last, F, j))] if rank == schedule.stage_to_rank(last) else []
    if a.kind is ALLREDUCE_S:
        return [("c", Action(a.stage, S, j))]
    assert a.kind is REDUCE_G, a
    return [("c", Action(a.stage, T, j))]


def collective_order_mismatch(schedule: Schedule) -> tuple[str, dict[tuple[int, int], str]] | None:
    """(message, marks) if some rank posts the collectives in another order than rank 0."""
    steps = [[k for k, a in enumerate(acts) if a.kind.is_collective] for acts in schedule.actions]
    seqs = [[(acts[k].kind, acts[k].microbatch) for k in ks] for acts, ks in zip(schedule.actions, steps)]
    for r in range(1, schedule.num_ranks):
        if seqs[r] == seqs[0]:
            continue
        n = next((i for i, (x, y) in enumerate(zip(seqs[0], seqs[r])) if x != y), min(len(seqs[0]), len(seqs[r])))
        got, marks = [], {}
        for rank in (0, r):
            what = f"{seqs[rank][n][0].value} of microbatch {seqs[rank][n][1]}" if n < len(seqs[rank]) else "nothing"
            step = steps[rank][n] if n < len(steps[rank]) else len(schedule.actions[rank])
            marks[(rank, step)] = f"collective #{n}: {what}"
            got.append(what)
        return (f"ranks disagree on the order of collectives: collective #{n} is {got[0]} on rank 0 but "
                f"{got[1]} on rank {r} (every rank must post them in one order, or they hang)", marks)
    return None
