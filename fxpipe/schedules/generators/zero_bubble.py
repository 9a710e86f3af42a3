"""ZB-H1, the handcrafted zero-bubble schedule of Qi et al., ICLR 2024 §3.1."""
from __future__ import annotations

from fxpipe.schedules.actions import loop_stage_ranks
from fxpipe.schedules.generators._common import F, I, W, act, check_sizes, schedule
from fxpipe.schedules.schedule import Schedule


def zb_h1(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """ZB-H1: 1F1B with the backward split into I (input gradient, passed
    upstream at once) and W (weight gradient, deferred to fill bubbles).

    Rank r runs 1F1B's warmup of min(p-1-r, m) forwards, then F/I pairs, but
    holds back its r most recent W's: a W runs after an I only once r others
    are pending, and the pending ones run at the end. Rank 0 thus runs W at
    once while rank p-1 delays p-1 of them: the I's travel upstream earlier
    than 1F1B's B's would, and the deferred W's fill the cooldown bubbles.
    (This is the ZB-H1 order of Qi et al. Fig. 3 and of torch's
    ScheduleInterleavedZeroBubble with one stage per rank.)

    Constraints: num_chunks == 1; any p >= 1, m >= 1.

    Bubble (stage times T_F, T_I, T_W, zero latency): for m >= p, each rank idles
    (p-1)(T_F + T_I - T_W) -- a third of 1F1B's (p-1)(T_F + T_I + T_W) when the
    three are equal (Qi et al. §3.1). For m < p the pipeline never fills:
    the step takes (m+p-1)(T_F + T_I) + T_W.

    Peak memory: min(p, m) microbatches in flight on every rank (counting a
    microbatch until its W), the same as 1F1B's worst rank (Qi et al. §3.1:
    "the same peak memory as 1F1B").
    """
    check_sizes("zb-h1", num_ranks, num_microbatches, num_chunks, chunks=(1,))
    p, m = num_ranks, num_microbatches
    per_rank = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        ops = [act(r, F, j) for j in range(warmup)]
        pending: list[int] = []  # microbatches whose I ran and W did not, oldest first
        for j in range(m):  # the j-th backward (I), preceded by a forward while any remain
            if j + warmup < m:
                ops.append(act(r, F, j + warmup))
            ops.append(act(r, I, j))
            pending.append(j)
            if len(pending) > r:
                ops.append(act(r, W, pending.pop(0)))
        ops += [act(r, W, j) for j in pending]
        per_rank.append(ops)
    return schedule("zb-h1", m, loop_stage_ranks(p, 1), per_rank)
