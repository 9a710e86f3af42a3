"""Chrome / Perfetto trace JSON of a Timeline, with flow arrows send -> recv.

Open the file at https://ui.perfetto.dev or chrome://tracing. One process per
pp rank; thread 0 is compute, threads 1.. ("comm k") hold the transfers. Flow arrows join
each SEND to its RECV; a timeline without SEND/RECV entries (a simulated
compute-only schedule) gets arrows from each producer to its consumer on
another rank instead.
"""
from __future__ import annotations

import json
import os

from fxpipe.base.safe_io import open_output
from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.timeline import Timeline

_US_PER_UNIT = {"us": 1.0, "ms": 1e3, "s": 1e6, "unit": 1e3}  # a simulated unit shows as 1 ms
_COMM_PARTNER = {
    ActionKind.SEND_F: (ActionKind.RECV_F, 1),
    ActionKind.SEND_B: (ActionKind.RECV_B, -1),
}


def _consumers(a: Action) -> list[Action]:
    """Compute actions on the next stage that read ``a``'s output."""
    if a.kind is ActionKind.F:
        return [Action(a.stage + 1, ActionKind.F, a.microbatch)]
    if a.kind in (ActionKind.B, ActionKind.I):
        return [Action(a.stage - 1, k, a.microbatch) for k in (ActionKind.B, ActionKind.I)]
    return []


def trace_events(timeline: Timeline) -> list[dict]:
    scale = _US_PER_UNIT.get(timeline.unit, 1e3)
    events: list[dict] = []
    where: dict[Action, tuple[int, int, float, float]] = {}  # action -> (pid, tid, start_us, end_us)
    for r in range(timeline.num_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        lanes: list[float] = []  # end time of the last comm slice on each comm thread
        for e in sorted(timeline.events(r), key=lambda e: (e.start, e.end)):
            ts, te = e.start * scale, e.end * scale
            if e.action.kind.is_compute:
                tid = 0
            else:
                te = max(te, ts + 1.0)  # a zero-latency transfer still needs a slice (1 us) to anchor its arrow
                # Transfers overlap; trace viewers need slices on one thread to nest,
                # so each goes to the first comm thread that is free by then.
                free = [k for k, end in enumerate(lanes) if end <= ts]
                if not free:
                    lanes.append(0.0)
                    events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": len(lanes),
                                   "args": {"name": f"comm {len(lanes) - 1}"}})
                lane = free[0] if free else len(lanes) - 1
                lanes[lane] = te
                tid = 1 + lane
            where[e.action] = (r, tid, ts, te)
            events.append({
                "ph": "X", "name": str(e.action), "cat": e.action.kind.name,
                "pid": r, "tid": tid, "ts": ts, "dur": te - ts,
                "args": {"stage": e.action.stage, "microbatch": e.action.microbatch},
            })
    has_comm = any(tid >= 1 for (_, tid, _, _) in where.values())
    flow_id = 0
    for a, (pid, tid, ts, te) in where.items():
        if has_comm:
            if a.kind not in _COMM_PARTNER:
                continue
            kind, offset = _COMM_PARTNER[a.kind]
            targets = [Action(a.stage + offset, kind, a.microbatch)]
        else:
            targets = _consumers(a)
        # Flow points sit at slice starts: Perfetto binds each to its
        # enclosing slice ("bp": "e") and draws the arrow between the slices.
        for target in targets:
            if target not in where or where[target][0] == pid:
                continue
            dst_pid, dst_tid, dst_ts, dst_te = where[target]
            flow_id += 1
            common = {"name": "p2p", "cat": "p2p", "id": flow_id}
            events.append({**common, "ph": "s", "pid": pid, "tid": tid, "ts": ts})
            events.append({**common, "ph": "f", "bp": "e", "pid": dst_pid, "tid": dst_tid, "ts": dst_ts})
    return events


def render_trace(timeline: Timeline, path: str | os.PathLike,
                 forbidden: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Write the trace JSON (``{"traceEvents": [...]}``) to ``path`` (never over a file of
    identity in ``forbidden``: ``base/safe_io.open_output``)."""
    with open_output(path, line_buffered=False, forbidden=forbidden) as f:
        json.dump({"traceEvents": trace_events(timeline), "displayTimeUnit": "ms",
                   "otherData": {"title": timeline.title, "unit": timeline.unit}}, f)
