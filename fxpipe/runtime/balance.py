"""Stage balance as it ran: per-stage forward/backward times predicted by the
partitioner beside those measured in training steps, and the measured imbalance.

Imbalance is max/mean over stages of the busy time per step (the sum of a stage's
F, B, I and W durations, and under vocabulary passes the S and T passes of the
vocabulary block that stage's rank owns — block r runs on the rank of stage r): 1.0 is a perfect split, and the pipeline's step is paced
by the max (Narayanan et al. SC21 §3.3: the slowest stage sets the throughput).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from fxpipe.schedules.actions import ActionKind

K = ActionKind


@dataclass(frozen=True)
class StageBalance:
    stage: int
    rank: int
    predicted_f_ms: float
    predicted_b_ms: float
    measured_f_ms: float
    measured_b_ms: float
    """Per microbatch; I + W under the split schedules."""
    busy_ms: float
    """Measured compute time of the stage in one step (median over steps)."""


class BalanceMeter:
    """Collects one rank's per-action durations over steps (the first step warms up)."""

    def __init__(self) -> None:
        self.durations: dict[tuple[int, str], list[float]] = defaultdict(list)
        self.busy: dict[int, list[float]] = defaultdict(list)

    def add(self, events: Iterable) -> None:
        per_stage: dict[int, float] = defaultdict(float)
        for action, start, end in events:
            if action.kind in (K.F, K.B, K.I, K.W):
                self.durations[(action.stage, action.kind.name)].append((end - start) * 1e3)
                per_stage[action.stage] += (end - start) * 1e3
            elif action.kind in (K.S, K.T):  # the output layer's block: work of that rank too
                per_stage[action.stage] += (end - start) * 1e3
        for s, t in per_stage.items():
            self.busy[s].append(t)

    def summary(self) -> dict:
        """Medians, picklable, for gathering over the pipeline group."""
        return dict(durations={k: statistics.median(v) for k, v in self.durations.items()},
                    busy={s: statistics.median(v) for s, v in self.busy.items()})


def balance(partition, summaries: Sequence[dict]) -> tuple[list[StageBalance], float]:
    """Per-stage rows and the measured imbalance, from the partition result and every
    pipeline rank's ``BalanceMeter.summary()``."""
    med: dict = {}
    busy: dict[int, float] = {}
    for s in summaries:
        med.update(s["durations"])
        busy.update(s["busy"])
    rows = []
    for c in partition.stages:
        f = med.get((c.stage, "F"), 0.0)
        b = med.get((c.stage, "B"), med.get((c.stage, "I"), 0.0) + med.get((c.stage, "W"), 0.0))
        rows.append(StageBalance(stage=c.stage, rank=c.rank, predicted_f_ms=c.fwd_s * 1e3,
                                 predicted_b_ms=c.bwd_s * 1e3, measured_f_ms=f, measured_b_ms=b,
                                 busy_ms=busy.get(c.stage, 0.0)))
    loads = [r.busy_ms for r in rows]
    mean = sum(loads) / len(loads) if loads else 0.0
    return rows, (max(loads) / mean if mean > 0 else 1.0)


def balance_table(rows: Sequence[StageBalance], imbalance: float) -> str:
    lines = ["stage balance (per microbatch; predicted by the partitioner, measured in training):",
             f"{'stage':>5}{'rank':>5}{'F pred ms':>11}{'F meas ms':>11}{'B pred ms':>11}{'B meas ms':>11}"
             f"{'busy ms/step':>14}"]
    for r in rows:
        lines.append(f"{r.stage:>5}{r.rank:>5}{r.predicted_f_ms:>11.2f}{r.measured_f_ms:>11.2f}"
                     f"{r.predicted_b_ms:>11.2f}{r.measured_b_ms:>11.2f}{r.busy_ms:>14.1f}")
    lines.append(f"measured imbalance (max/mean busy time per stage): {imbalance:.3f}")
    return "\n".join(lines)
