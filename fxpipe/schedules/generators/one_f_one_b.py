"""1F1B, the PipeDream-Flush schedule (Narayanan et al. SC21 §2.2.1, Fig. 3)."""
from __future__ import annotations

from fxpipe.schedules.actions import loop_stage_ranks
from fxpipe.schedules.generators._common import B, F, act, check_sizes, schedule
from fxpipe.schedules.schedule import Schedule


def one_f_one_b(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """1F1B: on rank r, warmup of min(p-r-1, m) forwards, then steady
    forward/backward pairs, then a cooldown of the remaining backwards.

    Constraints: num_chunks == 1; any p >= 1, m >= 1 (m < p just shortens the
    steady phase to nothing: the schedule degenerates to GPipe).

    Bubble: the same as GPipe, (p-1)(T_F+T_B) per rank = (p-1)/m of the ideal
    compute (SC21 §2.2.1).

    Peak memory: min(p-r, m) microbatches in flight on rank r -- the warmup
    forwards plus the steady phase's first forward -- so rank 0 holds p
    instead of GPipe's m. That is the point of 1F1B.
    """
    check_sizes("1f1b", num_ranks, num_microbatches, num_chunks, chunks=(1,))
    p, m = num_ranks, num_microbatches
    per_rank = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [act(r, F, j) for j in range(warmup)]
        for j in range(m - warmup):  # steady state: F of j+warmup, then B of j
            ops += [act(r, F, j + warmup), act(r, B, j)]
        ops += [act(r, B, j) for j in range(m - warmup, m)]
        per_rank.append(ops)
    return schedule("1f1b", m, loop_stage_ranks(p, 1), per_rank)
