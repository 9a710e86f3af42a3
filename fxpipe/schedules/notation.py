"""Text forms of a schedule: CSV (torch.distributed.pipelining's format) and
the step x rank grid that error messages print."""
from __future__ import annotations

import csv
import io
from typing import Sequence

from fxpipe.schedules.actions import Action, Schedule


def parse_actions(cells: Sequence[str]) -> tuple[Action, ...]:
    """Parse action strings, skipping empty cells (torch writes its ``None``
    placeholders as empty cells)."""
    return tuple(Action.parse(c) for c in cells if c.strip())


def schedule_to_csv(schedule: Schedule) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in schedule.actions:
        writer.writerow([str(a) for a in rank])
    return buf.getvalue()


def schedule_from_csv(text: str, *, name: str = "csv", num_microbatches: int | None = None) -> Schedule:
    """One row per rank. The stage -> rank mapping is inferred from where each
    stage's actions sit, as torch's ``_validate_schedule`` does;
    ``num_microbatches`` defaults to the largest microbatch index + 1."""
    actions = tuple(parse_actions(row) for row in csv.reader(io.StringIO(text)))
    if not any(actions):
        raise ValueError("empty schedule CSV: expected one row of actions per pipeline rank")
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for a in row:
            # Every kind, comm included, is named by a stage of the rank that posts it.
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"stage {a.stage} appears on rank {owner[a.stage]} and on rank {rank} "
                    f"(action {a}); a stage must live on exactly one rank"
                )
    num_stages = max(owner) + 1
    missing = sorted(set(range(num_stages)) - set(owner))
    if missing:
        raise ValueError(f"stages {missing} have no actions in the CSV; cannot infer their rank")
    if num_stages % len(actions) != 0:
        raise ValueError(
            f"{num_stages} stages over {len(actions)} ranks: every rank must hold the same number of stages"
        )
    if num_microbatches is None:
        num_microbatches = 1 + max(a.microbatch for row in actions for a in row)
    return Schedule(
        name=name,
        num_microbatches=num_microbatches,
        stage_ranks=tuple(owner[s] for s in range(num_stages)),
        actions=actions,
    )


def format_grid(
    schedule: Schedule,
    marks: dict[tuple[int, int], str] | None = None,
    window: int | None = 12,
) -> str:
    """The step x rank grid (one row per step, one column per rank, like
    torch's ``_format_pipeline_order``). ``marks`` maps (rank, step) to a
    note; marked cells print as ``>3F0<`` and their row ends with the note.
    With marks and a ``window``, only the rows within ``window`` steps of a
    mark are shown, so errors in long schedules stay readable."""
    marks = marks or {}
    # Marks past a rank's end (a missing action) get a row of their own.
    num_steps = max([len(r) for r in schedule.actions] + [s + 1 for (_, s) in marks])

    def cell(r: int, step: int) -> str:
        rank = schedule.actions[r]
        text = str(rank[step]) if step < len(rank) else ""
        if (r, step) in marks:
            return f">{text or '?'}<"
        return text

    keep = list(range(num_steps))
    if marks and window is not None:  # only rows near a mark: errors in long schedules stay short
        keep = sorted({
            s for (_, m) in marks for s in range(max(0, m - window), min(num_steps, m + window + 1))
        })
    cells = {step: [cell(r, step) for r in range(schedule.num_ranks)] for step in keep}
    labels = [f"rank {r}" for r in range(schedule.num_ranks)]
    widths = [max([len(labels[r])] + [len(row[r]) for row in cells.values()]) for r in range(schedule.num_ranks)]
    step_w = len(f"step {num_steps - 1}")
    lines = [" " * (step_w + 2) + " ".join(label.ljust(w) for label, w in zip(labels, widths))]
    prev = -1
    for step in keep:
        if step != prev + 1:
            lines.append(f"... ({step - prev - 1} steps not shown)")
        notes = [f"rank {r}: {note}" for (r, s), note in sorted(marks.items()) if s == step]
        row = f"step {step}".ljust(step_w) + ": " + " ".join(c.ljust(w) for c, w in zip(cells[step], widths))
        lines.append(row.rstrip() + ("   <-- " + "; ".join(notes) if notes else ""))
        prev = step
    if prev != num_steps - 1:
        lines.append(f"... ({num_steps - 1 - prev} steps not shown)")
    return "\n".join(lines)
