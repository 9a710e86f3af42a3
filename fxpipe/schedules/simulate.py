"""Simulate a schedule with per-stage durations: when does every action run?

The rank executes its list in order; an action starts when the rank is free
and its inputs exist: F(s) needs F(s-1); B or I (s) needs its own F and the
input gradient of s+1; W(s) needs I(s). Inputs crossing ranks arrive
``p2p_latency`` after the producer ends. SEND/RECV entries do not occupy the
compute stream (they overlap, as on a separate comm stream); they appear in
the timeline spanning the transfer.

Vocabulary passes (``vocab_actions.py``): S and T run on the compute stream for
``vocab_forward[r]`` / ``vocab_backward[r]``; each collective is posted without
blocking when its rank reaches it and completes ``collective_latency`` after the
last rank posted it. S waits for its BCAST_H, T for its ALLREDUCE_S, the last
stage's B (or I) for its REDUCE_G.

The kernel is numba-compiled (``_sim_core``) so a planner can score thousands
of configurations per second; this module is its typed front end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxpipe.schedules import _sim_core
from fxpipe.schedules.actions import KIND_CODE, ActionKind
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.timeline import Timeline
from fxpipe.schedules.validate import ScheduleError, check_structure, locate


def _per_stage(name: str, value: Sequence[float], num_stages: int | None) -> tuple[float, ...]:
    if np.isscalar(value):
        raise TypeError(f"{name}: expected one duration per stage; use StageDurations.uniform for equal stages")
    values = tuple(float(x) for x in value)
    if num_stages is not None and len(values) != num_stages:
        raise ValueError(f"{name}: got {len(values)} per-stage durations for {num_stages} stages")
    if any(not np.isfinite(x) or x < 0 for x in values):
        raise ValueError(f"{name}: durations must be finite and >= 0, got {values}")
    return values


@dataclass(frozen=True, kw_only=True)
class StageDurations:
    """Per-stage compute times, in any one unit.

    ``backward`` is the full backward B. Split schedules run it as I then W,
    with W = ``weight`` and I = backward - weight (B = I + W).
    """

    forward: tuple[float, ...]
    """Forward time of each stage (the last stage's includes the loss)."""
    backward: tuple[float, ...]
    """Full backward time of each stage."""
    weight: tuple[float, ...]
    """Weight-gradient part of the backward of each stage (ZB's T_W)."""
    vocab_forward: tuple[float, ...] = ()
    """Per pp rank, its S pass (its 1/p of the output layer's forward and loss);
    only schedules with vocabulary passes read it. Then the last stage's
    ``forward``/``backward`` must leave the output layer out."""
    vocab_backward: tuple[float, ...] = ()
    """Per pp rank, its T pass (its 1/p of the output layer's backward)."""

    def __post_init__(self) -> None:
        n = len(_per_stage("forward", self.forward, None))
        for name in ("forward", "backward", "weight"):
            object.__setattr__(self, name, _per_stage(name, getattr(self, name), n))
        for name in ("vocab_forward", "vocab_backward"):
            object.__setattr__(self, name, _per_stage(name, getattr(self, name), None))
        if len(self.vocab_forward) != len(self.vocab_backward):
            raise ValueError(f"vocab_forward has {len(self.vocab_forward)} ranks but vocab_backward "
                             f"{len(self.vocab_backward)}: give one S and one T time per pp rank")
        bad = [s for s in range(n) if self.weight[s] > self.backward[s]]
        if bad:
            raise ValueError(
                f"weight must not exceed backward (B = I + W), but stage {bad[0]} has "
                f"weight={self.weight[bad[0]]} > backward={self.backward[bad[0]]}"
            )

    @staticmethod
    def uniform(
        num_stages: int, forward: float = 1.0, backward: float = 2.0, weight: float | None = None
    ) -> "StageDurations":
        """Every stage alike. ``weight`` defaults to half the backward (I == W)."""
        weight = backward / 2 if weight is None else weight
        return StageDurations(
            forward=(forward,) * num_stages,
            backward=(backward,) * num_stages,
            weight=(weight,) * num_stages,
        )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def as_array(self) -> np.ndarray:
        """float64[6, num_stages] rows in kind-code order: F, B, I, W, S, T (S and T
        by vocabulary block = rank, zero past the ranks given)."""
        f, b, w = (np.asarray(x, dtype=np.float64) for x in (self.forward, self.backward, self.weight))
        vs, vt = np.zeros_like(f), np.zeros_like(f)
        vs[:len(self.vocab_forward)] = self.vocab_forward
        vt[:len(self.vocab_backward)] = self.vocab_backward
        out = np.stack([f, b, b - w, w, vs, vt])
        kinds = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.S, ActionKind.T)
        assert [KIND_CODE[k] for k in kinds] == list(range(6))
        return out


@dataclass(frozen=True, kw_only=True, eq=False)
class SimResult:
    """What ``simulate`` found. Per-rank tuples are indexed by pp rank."""

    timeline: Timeline
    makespan: float
    """Time from the first start to the last compute end."""
    busy: tuple[float, ...]
    """Compute time per rank."""
    bubble_fraction: tuple[float, ...]
    """Idle / makespan per rank (GPipe and zero-bubble papers' convention)."""
    bubble_ratio: tuple[float, ...]
    """Idle / busy per rank: bubble relative to ideal compute (Megatron SC21)."""
    peak_in_flight: tuple[int, ...]
    """Most chunk-microbatches held at once per rank, from F until B, or W if split."""
    peak_activation: tuple[float, ...]
    """peak_in_flight / num_chunks: in units of one full stage's activations."""

    @property
    def max_bubble_fraction(self) -> float:
        return max(self.bubble_fraction)


def simulate(
    schedule: Schedule,
    durations: StageDurations | None = None,
    *,
    p2p_latency: float = 0.0,
    collective_latency: float | Sequence[float] | None = None,
) -> SimResult:
    """Run the list scheduler on ``schedule`` (compute-only or lowered).

    ``durations`` defaults to F=1, B=2 (I=1, W=1) on every stage. Raises
    ScheduleError (with the rank x step grid) on a deadlock, a repeated or
    missing action, or an action on the wrong rank; see ``validate`` for the
    full checks, including send/recv matching. ``collective_latency``: the time of
    the vocabulary collectives, one number or (BCAST_H, ALLREDUCE_S, REDUCE_G);
    None: ``p2p_latency`` each.
    """
    if durations is None:
        durations = StageDurations.uniform(schedule.num_stages)
    if durations.num_stages != schedule.num_stages:
        raise ValueError(
            f"durations cover {durations.num_stages} stages but the schedule has "
            f"{schedule.num_stages} (p={schedule.num_ranks} x v={schedule.num_chunks})"
        )
    if not np.isfinite(p2p_latency) or p2p_latency < 0:
        raise ValueError(f"p2p_latency must be finite and >= 0, got {p2p_latency}")
    if schedule.has_vocab_passes and len(durations.vocab_forward) != schedule.num_ranks:
        raise ValueError(
            f"the schedule runs vocabulary passes on {schedule.num_ranks} ranks but durations give "
            f"{len(durations.vocab_forward)} S/T times: set StageDurations(vocab_forward=..., "
            f"vocab_backward=...) with one per rank"
        )
    coll = np.broadcast_to(np.asarray(p2p_latency if collective_latency is None else collective_latency,
                                      dtype=np.float64), (3,)).copy()
    if not np.all(np.isfinite(coll)) or np.any(coll < 0):
        raise ValueError(f"collective_latency must be finite and >= 0, got {collective_latency}")
    check_structure(schedule)
    arr = schedule.arrays
    status, start, end, blocked, peak, busy, finish = _sim_core.simulate_kernel(
        arr.kind, arr.stage, arr.microbatch, arr.offsets, arr.stage_ranks,
        durations.as_array(), float(p2p_latency), schedule.num_microbatches, coll,
    )
    if status != _sim_core.OK:
        raise kernel_error(schedule, status, blocked)
    offsets = arr.offsets
    p = schedule.num_ranks
    makespan = float(finish.max())  # simulations start at 0
    idle = makespan - busy
    timeline = Timeline(
        actions=schedule.actions,
        start=tuple(start[offsets[r]:offsets[r + 1]] for r in range(p)),
        end=tuple(end[offsets[r]:offsets[r + 1]] for r in range(p)),
        title=_title(schedule),
        num_chunks=schedule.num_chunks,
    )
    return SimResult(
        timeline=timeline,
        makespan=makespan,
        busy=tuple(busy.tolist()),
        bubble_fraction=tuple((idle / makespan).tolist()) if makespan > 0 else (0.0,) * p,
        bubble_ratio=tuple(float(i / b) if b > 0 else 0.0 for i, b in zip(idle, busy)),
        peak_in_flight=tuple(peak.tolist()),
        peak_activation=tuple((peak / schedule.num_chunks).tolist()),
    )


def _title(schedule: Schedule) -> str:
    v = f" v={schedule.num_chunks}" if schedule.num_chunks > 1 else ""
    return f"{schedule.name} p={schedule.num_ranks} m={schedule.num_microbatches}{v}"


def kernel_error(schedule: Schedule, status: int, blocked: np.ndarray) -> ScheduleError:
    """The ScheduleError for a failed kernel run (also used by ``lower``)."""
    if status == _sim_core.DEADLOCK:
        marks = {}
        for r, n in enumerate(blocked):
            if n >= 0:
                marks[locate(schedule, int(n))] = "blocked: its inputs never arrive"
        return ScheduleError("deadlock: no rank can make progress", schedule, marks)
    if status == _sim_core.DUPLICATE:
        return ScheduleError(
            "an action is repeated (or W follows a full B)", schedule, {locate(schedule, int(blocked[0])): "repeated"}
        )
    return ScheduleError(
        "incomplete: some stage/microbatch lacks its F, its B (or I), or its W; "
        "run validate() for the exact action", schedule, {},
    )
