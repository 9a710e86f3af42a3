"""Gantt chart of a Timeline in the style of Megatron SC21 Figure 4.

One row per rank, rank 0 on top; time runs left to right; forward boxes blue,
backward green (as in the paper), the I/W halves of a split backward in
green/orange; with several stages per rank each chunk gets its own shade
(chunk 0 darkest), so the chunks of one microbatch are told apart as in the
paper's dark/light interleaved boxes. Vocabulary passes (S, T) are purple and
pink, one shade (they are the rank's block of the output layer, not a chunk). Each box carries its microbatch number
(0-based, as in the action text); gaps are bubbles. matplotlib is imported
only when drawing.
"""
from __future__ import annotations

import os

from fxpipe.schedules.actions import ActionKind
from fxpipe.schedules.render.ascii import summary_line
from fxpipe.schedules.timeline import Timeline

_CMAP = {ActionKind.F: "Blues", ActionKind.B: "Greens", ActionKind.I: "Greens", ActionKind.W: "Oranges",
         ActionKind.S: "Purples", ActionKind.T: "RdPu"}


def _chunk_of(timeline: Timeline) -> dict[int, int]:
    """stage -> chunk index on its rank (0 = the rank's first stage)."""
    stages: dict[int, set[int]] = {}
    for r, acts in enumerate(timeline.actions):
        stages[r] = {a.stage for a in acts if a.kind.is_compute}
    return {s: sorted(ss).index(s) for ss in stages.values() for s in ss}


def render_gantt(timeline: Timeline, path: str | os.PathLike, *, dpi: int = 150) -> None:
    """Draw the chart to ``path``; the format follows the extension (.png, .svg, .pdf)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    chunk_of = _chunk_of(timeline)
    num_chunks = max(chunk_of.values(), default=0) + 1

    def colour(kind: ActionKind, chunk: int):
        if kind.is_vocab:
            return colormaps[_CMAP[kind]](0.6)
        # Darkest shade for chunk 0, lighter for later chunks (SC21 Fig. 4).
        level = 0.8 - 0.45 * chunk / max(1, num_chunks - 1) if num_chunks > 1 else 0.65
        if kind is ActionKind.I:
            level = min(level + 0.1, 0.9)
        return colormaps[_CMAP[kind]](level)

    span = timeline.makespan
    origin = timeline.origin
    p = timeline.num_ranks
    width = min(24.0, max(8.0, 0.22 * span / max(1e-12, _shortest(timeline))))
    kinds = [k for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.S, ActionKind.T)
             if any(a.kind is k for acts in timeline.actions for a in acts)]
    legend_rows = -(-sum(1 if k.is_vocab else num_chunks for k in kinds) // 4)
    legend_h = 0.1 + 0.22 * legend_rows  # inches reserved under the axes for the legend
    height = 1.6 + 0.45 * p + legend_h
    fig = Figure(figsize=(width, height), dpi=dpi)
    ax = fig.add_subplot()
    n_boxes = max((len(a) for a in timeline.actions), default=0)
    label_size = max(4.0, min(9.0, 600.0 / max(1, n_boxes)))
    for r in range(p):
        y = p - 1 - r  # rank 0 on top
        boxes: dict[tuple[ActionKind, int], list[tuple[float, float]]] = {}
        for e in timeline.events(r):
            a = e.action
            if not a.kind.is_compute:
                continue
            chunk = chunk_of.get(a.stage, 0)
            boxes.setdefault((a.kind, chunk), []).append((e.start - origin, e.end - e.start))
            if n_boxes <= 400:  # numbers stay legible up to a few hundred boxes per row
                face = colour(a.kind, chunk)
                ax.text(e.start - origin + (e.end - e.start) / 2, y, str(a.microbatch),
                        ha="center", va="center", fontsize=label_size,
                        color="white" if sum(face[:3]) < 1.6 else "black")
        # One broken_barh per colour and row: fast even for a million boxes.
        for (kind, chunk), spans in boxes.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colour(kind, chunk),
                           edgecolors="black", linewidth=0.4 if n_boxes <= 400 else 0.0)
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
    ax.set_xlabel("time" if timeline.unit == "unit" else f"time ({timeline.unit})")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    names = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "backward (input)",
             ActionKind.W: "backward (weight)", ActionKind.S: "vocabulary S (logits, softmax stats)",
             ActionKind.T: "vocabulary T (output-layer backward)"}
    handles = [
        Patch(facecolor=colour(k, c), edgecolor="black", linewidth=0.4,
              label=names[k] + (f", chunk {c}" if num_chunks > 1 and not k.is_vocab else ""))
        for k in kinds for c in range(1 if k.is_vocab else num_chunks)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    ax.set_title(f"{timeline.title}\n{summary_line(timeline)}", fontsize=10)
    fig.tight_layout(rect=(0, legend_h / height, 1, 1))
    fig.savefig(path)


def _shortest(timeline: Timeline) -> float:
    return min(
        (e.end - e.start for r in range(timeline.num_ranks) for e in timeline.events(r)
         if e.action.kind.is_compute and e.end > e.start),
        default=1.0,
    )
