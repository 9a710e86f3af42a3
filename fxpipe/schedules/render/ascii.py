"""ASCII rank x time grid of a Timeline."""
from __future__ import annotations

import math

from fxpipe.schedules.timeline import Timeline


def summary_line(timeline: Timeline) -> str:
    """Bubble and memory in one line, shared by the ASCII and Gantt titles."""
    bubble = max(timeline.bubble_fraction(), default=0.0)
    ratio = max(timeline.bubble_ratio(), default=0.0)
    peak = max(timeline.peak_in_flight(), default=0)
    act = max(timeline.peak_activation(), default=0.0)
    mem = f"peak in flight {peak}"
    if timeline.num_chunks > 1:
        mem += f" chunk-microbatches = {act:g} stage-microbatches"
    return (
        f"makespan {timeline.makespan:g} {_unit(timeline)}, bubble {bubble:.1%} of step "
        f"({ratio:.1%} of compute), {mem} (worst rank)"
    )


def _unit(timeline: Timeline) -> str:
    return "time units" if timeline.unit == "unit" else timeline.unit


def render_ascii(timeline: Timeline, *, idle: str = ".") -> str:
    """One row per rank, one column per time quantum (the shortest compute
    action), each compute action printed as its text form (``3F0``) and
    stretched over its duration with '~'; ``idle`` marks bubbles. Times that
    are not multiples of the quantum are rounded to the nearest column (so a
    row may shift by a column); SEND/RECV are not drawn.
    """
    origin = timeline.origin
    events = [
        [e for e in timeline.events(r) if e.action.kind.is_compute] for r in range(timeline.num_ranks)
    ]
    durations = [e.end - e.start for rank in events for e in rank if e.end > e.start]
    if not durations:
        return f"{timeline.title}: empty timeline"
    quantum = min(durations)
    width = 1 + max(len(str(e.action)) for rank in events for e in rank)
    columns = max(1, math.ceil(timeline.makespan / quantum - 1e-9))
    label_w = len(f"rank {timeline.num_ranks - 1}")
    lines = [timeline.title, summary_line(timeline), ""]
    ticks = [" "] * (columns * width + 16)
    for c in range(0, columns, 5):  # a time label every 5 columns
        label = f"{c * quantum:g}"
        ticks[c * width:c * width + len(label)] = label
    lines.append(" " * (label_w + 2) + "".join(ticks).rstrip())
    for r, rank in enumerate(events):
        cells: list[str] = []
        col = 0
        for e in rank:
            # Round half up (not Python's half-to-even) so equal durations keep equal widths.
            first = max(col, math.floor((e.start - origin) / quantum + 0.5))
            last = max(first + 1, math.floor((e.end - origin) / quantum + 0.5))
            cells.append((idle + " " * (width - 1)) * (first - col))
            text = str(e.action)
            cells.append((text + "~" * ((last - first) * width - 1 - len(text)) + " "))
            col = last
        cells.append((idle + " " * (width - 1)) * max(0, columns - col))
        lines.append(f"rank {r}".ljust(label_w) + "| " + "".join(cells).rstrip())
    return "\n".join(lines) + "\n"
