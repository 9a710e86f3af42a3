"""Interleaved 1F1B (Narayanan et al. SC21 §2.2.2, Fig. 4), for any m."""
from __future__ import annotations

from fxpipe.schedules.actions import loop_stage_ranks
from fxpipe.schedules.generators._common import B, F, act, check_sizes, schedule
from fxpipe.schedules.schedule import Schedule


def microbatch_groups(num_ranks: int, num_microbatches: int) -> list[range]:
    """Split microbatches 0..m-1 into consecutive groups of at least p.

    Megatron runs the v chunks over groups of exactly p microbatches and so
    needs m % p == 0. We use max(1, m // p) groups of as equal size as
    possible, larger groups first: m=10, p=4 -> [0..4], [5..9]; m=11, p=4 ->
    [0..5], [6..10]; m=3, p=4 -> [0..2]. For m % p == 0 this is Megatron's
    grouping; where torch's "flex" variant (ScheduleInterleaved1F1B) needs
    m % (m // p) == 0, this works for every m.
    """
    num_groups = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, num_groups)
    groups, start = [], 0
    for g in range(num_groups):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    assert start == num_microbatches
    return groups


def interleaved(num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B: v stages ("model chunks") per rank, stage c on rank
    c mod p; each rank alternates one forward and one backward in steady state.

    Order (SC21 §2.2.2, Megatron-LM ``forward_backward_pipelining_with_interleaving``):
    microbatches are split into groups (see ``microbatch_groups``); for each
    group, a rank runs forward chunk 0 for every microbatch of the group, then
    chunk 1, ..., chunk v-1; backwards follow the same order with the chunks
    reversed. Rank r first runs a warmup of (v-1)*g0 + 2*(p-1-r) forwards (g0 =
    size of the first group; Megatron's (v-1)*p + 2*(p-1-r) when m % p == 0),
    capped at m*v; then steady forward/backward pairs; then the remaining
    backwards. With v == 1 the warmup is 1F1B's min(p-1-r, m) and the schedule
    *is* 1F1B.

    Constraints: any p >= 1, m >= 1, v >= 1. Megatron requires m % p == 0;
    here, m not a multiple of p uses groups larger than p (validity is tested
    for all p <= 16, m <= 64, v <= 4).

    Bubble: (p-1)(T_F+T_B)/v per rank, i.e. (p-1)/(v*m) of the ideal compute
    (SC21 §2.2.2), where T_F, T_B are one rank's full-model-slice times (a
    chunk takes 1/v of them). Exact for m % p == 0 with equal stage times;
    otherwise the simulator measures it.

    Peak memory: min(warmup + 1, m*v) chunk-microbatches on rank r, each 1/v of
    a full stage's activations; on rank 0 with m % p == 0 and m >= 2p that is
    p + (p-1)/v stage-microbatches, (1 + (p-1)/(p*v)) times 1F1B's p
    (Korthikanti et al. 2022 §4.2.3, whose "m" is our v); with m == p the
    warmup covers everything and rank 0 holds p, like 1F1B.
    """
    check_sizes("interleaved", num_ranks, num_microbatches, num_chunks, chunks=None)
    p, m, v = num_ranks, num_microbatches, num_chunks
    groups = microbatch_groups(p, m)
    # (chunk, microbatch) units in the order every rank runs them.
    forward_units = [(c, j) for g in groups for c in range(v) for j in g]
    backward_units = [(c, j) for g in groups for c in reversed(range(v)) for j in g]
    total = m * v
    per_rank = []
    for r in range(p):
        if v == 1:
            warmup = min(p - 1 - r, m)
        else:
            warmup = min((v - 1) * len(groups[0]) + 2 * (p - 1 - r), total)
        fwd = [act(c * p + r, F, j) for c, j in forward_units]
        bwd = [act(c * p + r, B, j) for c, j in backward_units]
        ops = fwd[:warmup]
        for k in range(total - warmup):
            ops += [fwd[warmup + k], bwd[k]]
        ops += bwd[total - warmup:]
        per_rank.append(ops)
    return schedule("interleaved", m, loop_stage_ranks(p, v), per_rank)
