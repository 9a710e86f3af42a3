"""GPipe (Huang et al. 2019): all forwards, then all backwards."""
from __future__ import annotations

from fxpipe.schedules.actions import loop_stage_ranks
from fxpipe.schedules.generators._common import B, F, act, check_sizes, schedule
from fxpipe.schedules.schedule import Schedule


def gpipe(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """GPipe: every rank runs F for all m microbatches, then B for all of them.

    Constraints: num_chunks == 1; any p >= 1, m >= 1.

    Bubble (T_F, T_B per stage, zero p2p latency): (p-1)(T_F+T_B) per rank,
    i.e. (p-1)/m of the ideal compute (Megatron SC21 §2.2.1) or
    (p-1)/(m+p-1) of the step time (GPipe paper §2.3).

    Peak memory: m microbatches of activations on every rank -- all forwards
    finish before the first backward frees anything.

    The backwards run in microbatch order 0..m-1, as torch's ScheduleGPipe does;
    any order gives the same makespan because the last rank sets the pace.
    """
    check_sizes("gpipe", num_ranks, num_microbatches, num_chunks, chunks=(1,))
    per_rank = [
        [act(r, F, j) for j in range(num_microbatches)]
        + [act(r, B, j) for j in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return schedule("gpipe", num_microbatches, loop_stage_ranks(num_ranks, 1), per_rank)
