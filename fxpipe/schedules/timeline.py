"""A timeline: what each rank ran, and when.

The simulator produces one; the runtime records one from a measured step; the
renderers draw either. Metrics (makespan, bubble, peak in-flight) are defined
here once, on the timeline, so simulated and measured runs are compared with
the same definitions.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from fxpipe.schedules.actions import Action, ActionKind


class Event(NamedTuple):
    action: Action
    start: float
    end: float


@dataclass(frozen=True, kw_only=True, eq=False)
class Timeline:
    """Per rank: the actions it ran, in order, with their start and end times.

    ``start[r][k]``, ``end[r][k]`` are the times of ``actions[r][k]``. Compute
    actions on a rank never overlap; SEND/RECV entries (if present) span the
    transfer and overlap compute, as they would on a separate comm stream.
    """

    actions: tuple[tuple[Action, ...], ...]
    start: tuple[np.ndarray, ...]
    end: tuple[np.ndarray, ...]
    unit: str = "unit"
    """Time unit of start/end: "unit" for simulated unit costs, else e.g. "ms"."""
    title: str = ""
    """What this is, for plot titles: e.g. "interleaved p=4 m=8 v=2"."""
    num_chunks: int = 1
    """Stages per rank; a chunk-microbatch holds 1/num_chunks of a stage's activations."""

    def __post_init__(self) -> None:
        assert len(self.actions) == len(self.start) == len(self.end)
        for acts, s, e in zip(self.actions, self.start, self.end):
            assert len(acts) == len(s) == len(e)

    @staticmethod
    def from_events(
        events: Sequence[Sequence[tuple[Action, float, float]]], **kwargs
    ) -> "Timeline":
        """Build from per-rank lists of (action, start, end), e.g. measured by
        the runtime. Each rank's events are sorted by start time."""
        ranks = [sorted(rank, key=lambda e: (e[1], e[2])) for rank in events]
        return Timeline(
            actions=tuple(tuple(e[0] for e in rank) for rank in ranks),
            start=tuple(np.array([e[1] for e in rank], dtype=np.float64) for rank in ranks),
            end=tuple(np.array([e[2] for e in rank], dtype=np.float64) for rank in ranks),
            **kwargs,
        )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def events(self, rank: int) -> Iterator[Event]:
        for a, s, e in zip(self.actions[rank], self.start[rank], self.end[rank]):
            yield Event(a, float(s), float(e))

    @cached_property
    def _compute_masks(self) -> tuple[np.ndarray, ...]:
        return tuple(np.fromiter((a.kind.is_compute for a in acts), bool, len(acts)) for acts in self.actions)

    def _compute_mask(self, rank: int) -> np.ndarray:
        return self._compute_masks[rank]

    @property
    def origin(self) -> float:
        """Earliest start on any rank (0 for simulations)."""
        return min((float(s.min()) for s in self.start if len(s)), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last compute end, over all ranks."""
        ends = [self.end[r][self._compute_mask(r)] for r in range(self.num_ranks)]
        return max((float(e.max()) for e in ends if len(e)), default=self.origin) - self.origin

    def busy(self) -> tuple[float, ...]:
        """Per rank, the total duration of its compute actions."""
        return tuple(
            float((self.end[r] - self.start[r])[self._compute_mask(r)].sum()) for r in range(self.num_ranks)
        )

    def bubble_fraction(self) -> tuple[float, ...]:
        """Per rank, idle / makespan: the share of the step a rank does no
        compute (GPipe paper and zero-bubble tables; (p-1)/(m+p-1) for 1F1B)."""
        span = self.makespan
        return tuple((span - b) / span if span > 0 else 0.0 for b in self.busy())

    def bubble_ratio(self) -> tuple[float, ...]:
        """Per rank, idle / busy: bubble relative to ideal compute (Megatron
        SC21 convention; (p-1)/m for 1F1B, (p-1)/(v*m) interleaved)."""
        span = self.makespan
        return tuple((span - b) / b if b > 0 else 0.0 for b in self.busy())

    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most chunk-microbatches whose activations are held at
        once: counted from a stage's F until the backward part that frees them
        -- B, or W when the backward is split (W still needs the layer inputs
        saved by F; I frees only what W does not need). Depends on order only."""
        return tuple(_peak(self.actions[r]) for r in range(self.num_ranks))

    def peak_activation(self) -> tuple[float, ...]:
        """``peak_in_flight`` in units of one full stage-microbatch (one
        chunk-microbatch = 1/num_chunks of it, assuming equal chunks)."""
        return tuple(k / self.num_chunks for k in self.peak_in_flight())


def _peak(actions: Sequence[Action]) -> int:
    # Each (stage, microbatch) is freed exactly once: by B, or by W if split.
    held = peak = 0
    for a in actions:
        if a.kind is ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif a.kind is ActionKind.B or a.kind is ActionKind.W:
            held -= 1
    return peak
