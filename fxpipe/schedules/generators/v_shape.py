"""ZB-V, the V-shaped zero-bubble schedule of Qi et al., ICLR 2024 §6."""
from __future__ import annotations

from fxpipe.schedules.actions import v_stage_ranks
from fxpipe.schedules.generators._common import F, I, W, act, check_sizes, schedule
from fxpipe.schedules.schedule import Schedule


def zb_v(num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """ZB-V: two stages per rank placed in a V -- rank r holds stages r and
    2p-1-r -- so the first and last stage share rank 0, the turn from stage
    p-1 to p needs no communication, and I/W splitting fills the bubbles.

    Per rank (chunk 0 = stage r, chunk 1 = stage 2p-1-r), following Qi et al.
    Fig. 8 as implemented by torch's ScheduleZBVZeroBubble: a warmup of
    2(p-r)-1 chunk-0 forwards; r pairs (F chunk 1, F chunk 0); p-r triples
    (F, I, W of chunk 1); a steady phase alternating (F, I, W) of chunk 0 and
    of chunk 1; a cooldown of r pairs (I chunk 0, I chunk 1), p-r pairs
    (I chunk 0, W chunk 0), then the deferred W's. The order is built for
    max(m, 2p-1) microbatches and the actions of microbatches >= m dropped:
    the dropped set is closed under dependencies, so what remains stays valid.

    Constraints: num_chunks == 2 (the V); any p >= 1, m >= 1.

    Bubble (equal chunk times T_F = T_I = T_W, zero latency, m >= 2p-1):
    each rank idles (p-1)*T_F -- only the forward fill, which no schedule
    avoids (the last rank cannot start before p-1 forwards have run) --
    against 1F1B's 6(p-1)*T_F for the same model (a 1F1B stage is two
    chunks). That is Qi et al.'s "zero bubble" up to the fill. With unequal
    times the fixed order no longer fills exactly (§6 then uses a greedy
    variant); for m < 2p-1 the warmup cannot fill and the bubble grows.

    Peak memory: at most 2p chunk-microbatches per rank (each half a stage's
    activations), i.e. p stage-microbatches, 2*min(m, p) chunk-microbatches
    on the busiest rank -- 1F1B's worst rank (Qi et al. §6: "the same peak
    activation memory as 1F1B").
    """
    check_sizes("zb-v", num_ranks, num_microbatches, num_chunks, chunks=(2,))
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    per_rank = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        ops = []
        count = {(c, k): 0 for c in (c0, c1) for k in (F, I, W)}

        def run(stage, *kinds):
            for kind in kinds:
                ops.append(act(stage, kind, count[(stage, kind)]))
                count[(stage, kind)] += 1

        for _ in range(2 * (p - r) - 1):
            run(c0, F)
        for _ in range(r):
            run(c1, F)
            run(c0, F)
        for _ in range(p - r):
            run(c1, F, I, W)
        while count[(c1, F)] < count[(c0, F)] or count[(c0, F)] < n:
            if count[(c0, F)] < n:
                run(c0, F)
            run(c0, I, W)
            run(c1, F, I, W)
        for _ in range(r):
            run(c0, I)
            run(c1, I)
        for _ in range(p - r):
            run(c0, I, W)
        while count[(c1, W)] < count[(c1, I)]:
            run(c1, W)
        while count[(c0, W)] < count[(c0, I)]:
            run(c0, W)
        assert all(count[(c, F)] == count[(c, I)] == count[(c, W)] == n for c in (c0, c1)), count
        per_rank.append([a for a in ops if a.microbatch < m])
    return schedule("zb-v", m, v_stage_ranks(p), per_rank)
