"""Microbatches in flight per stage: what a schedule makes each stage hold at once."""
from __future__ import annotations

from fxpipe.schedules.actions import ActionKind
from fxpipe.schedules.schedule import Schedule


def stage_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches between their F and the backward action that
    frees them (B, or W when the backward is split), from the action order alone."""
    frees = ActionKind.W if schedule.splits_backward else ActionKind.B
    peak = [0] * schedule.num_stages
    for rank in schedule.actions:
        live = [0] * schedule.num_stages
        for a in rank:
            if a.kind is ActionKind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is frees:
                live[a.stage] -= 1
    return tuple(max(1, x) for x in peak)
