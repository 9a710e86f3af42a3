"""``Schedule``: per pipeline rank, an ordered list of actions (``actions.py``), the stage ->
rank map, its array form for the simulator and validator, and its text forms (torch's
CSV and the step x rank grid)."""
from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from fxpipe.schedules.actions import KIND_CODE, Action, ActionKind


@dataclass(frozen=True, kw_only=True, repr=False)
class Schedule:
    """A pipeline schedule: for every pp rank, the ordered actions it runs.

    ``actions[r]`` is rank r's list. A *compute-only* schedule holds F/B/I/W;
    ``lower()`` returns one with SEND/RECV inserted.
    """

    name: str
    """Generator name (``"1f1b"``, ...) or ``"csv"`` for a loaded file."""
    num_microbatches: int
    """Microbatches per step (m)."""
    stage_ranks: tuple[int, ...]
    """stage index -> pp rank; its length is the number of stages (p * v)."""
    actions: tuple[tuple[Action, ...], ...]
    """Per pp rank, the actions in execution order."""

    def __post_init__(self) -> None:
        assert self.num_microbatches >= 1, self.num_microbatches
        assert len(self.actions) >= 1
        assert all(0 <= r < len(self.actions) for r in self.stage_ranks), self.stage_ranks
        assert len(self.stage_ranks) % len(self.actions) == 0, (
            "every rank must hold the same number of stages",
            self.stage_ranks,
        )

    def __repr__(self) -> str:  # the actions can number millions; show the shape
        return (
            f"Schedule(name={self.name!r}, p={self.num_ranks}, m={self.num_microbatches}, "
            f"v={self.num_chunks}, actions={sum(map(len, self.actions))}, lowered={self.is_lowered})"
        )

    @property
    def num_ranks(self) -> int:
        """Pipeline-parallel size (p)."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Total number of model chunks (p * v)."""
        return len(self.stage_ranks)

    @property
    def num_chunks(self) -> int:
        """Stages per rank (v)."""
        return self.num_stages // self.num_ranks

    def stage_to_rank(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    @cached_property
    def is_lowered(self) -> bool:
        """True if SEND/RECV actions are present."""
        return any(a.kind.is_p2p for rank in self.actions for a in rank)

    @cached_property
    def has_vocab_passes(self) -> bool:
        """True if the output layer runs as S/T passes on every rank (``add_vocab_passes``)."""
        return any(a.kind.is_vocab for rank in self.actions for a in rank)

    @cached_property
    def splits_backward(self) -> bool:
        """True if the backward is split into I and W (zero-bubble family)."""
        return any(a.kind in (ActionKind.I, ActionKind.W) for rank in self.actions for a in rank)

    def compute_only(self) -> "Schedule":
        """The same schedule with SEND/RECV removed (vocabulary collectives stay:
        they belong to the passes, not to the lowering)."""
        return self.with_actions(
            tuple(a for a in rank if not a.kind.is_p2p) for rank in self.actions
        )

    def with_actions(self, actions: Iterable[Iterable[Action]]) -> "Schedule":
        return Schedule(
            name=self.name,
            num_microbatches=self.num_microbatches,
            stage_ranks=self.stage_ranks,
            actions=tuple(tuple(rank) for rank in actions),
        )

    @cached_property
    def arrays(self) -> "ScheduleArrays":
        """The actions as flat integer arrays (rank r's actions are
        ``[offsets[r], offsets[r+1])``), built once per schedule: the numba
        simulator reads these, so a planner re-simulating one schedule with
        other durations pays the Python-object walk only once."""
        codes = KIND_CODE
        flat = [a for rank in self.actions for a in rank]
        offsets = np.zeros(self.num_ranks + 1, dtype=np.int64)
        np.cumsum([len(rank) for rank in self.actions], out=offsets[1:])
        return ScheduleArrays(
            kind=np.fromiter((codes[a.kind] for a in flat), dtype=np.int8, count=len(flat)),
            stage=np.fromiter((a.stage for a in flat), dtype=np.int32, count=len(flat)),
            microbatch=np.fromiter((a.microbatch for a in flat), dtype=np.int32, count=len(flat)),
            offsets=offsets,
            stage_ranks=np.asarray(self.stage_ranks, dtype=np.int32),
        )

    # ---- text forms (the functions at the end of this module) --------------

    def to_csv(self) -> str:
        """One row per rank, one cell per action: the format of torch's
        ``_dump_csv``, which its ``_load_csv`` reads back."""
        return schedule_to_csv(self)

    def write_csv(self, path: str | os.PathLike) -> None:
        with open(path, "w", newline="") as f:
            f.write(self.to_csv())

    @staticmethod
    def read_csv(path: str | os.PathLike, **kwargs) -> "Schedule":
        with open(path, newline="") as f:
            return Schedule.from_csv(f.read(), **kwargs)

    @staticmethod
    def from_csv(text: str, *, name: str = "csv", num_microbatches: int | None = None) -> "Schedule":
        """Parse CSV text written by ``to_csv`` or by torch's ``_dump_csv``;
        the stage -> rank mapping is inferred (see ``schedule_from_csv`` below)."""
        return schedule_from_csv(text, name=name, num_microbatches=num_microbatches)

    def format_grid(self, marks: dict[tuple[int, int], str] | None = None, window: int | None = 12) -> str:
        """The step x rank grid, marked cells shown as ``>3F0<`` (see ``format_grid`` below)."""
        return format_grid(self, marks, window)


class ScheduleArrays(NamedTuple):
    kind: np.ndarray  # int8 codes, see KIND_CODE
    stage: np.ndarray  # int32
    microbatch: np.ndarray  # int32
    offsets: np.ndarray  # int64, length num_ranks + 1
    stage_ranks: np.ndarray  # int32, stage -> rank


def prime_arrays(schedule: Schedule, arrays: ScheduleArrays) -> None:
    """Fill ``schedule.arrays``'s cache with arrays a pass already built (they
    must describe ``schedule.actions`` exactly; checked by assert)."""
    assert len(arrays.kind) == sum(map(len, schedule.actions))
    assert "arrays" not in schedule.__dict__
    schedule.__dict__["arrays"] = arrays  # where functools.cached_property keeps it


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
