"""Schedule generators by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fxpipe.base.enums import NamedEnum
from fxpipe.schedules.generators import gpipe, interleaved, one_f_one_b, zb_h1, zb_v
from fxpipe.schedules.schedule import Schedule


class ScheduleKind(NamedEnum, what="schedule", valid="valid names are"):
    """The pipeline schedules, by their registered names (``SCHEDULES`` generates each).
    The one schedule enum: the layout (``ParallelConfig``), the runtime and the planner
    (which prices a subset, ``planner.config.PLANNED``) all use it."""
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """A registered generator."""

    name: str
    build: Callable[[int, int, int], Schedule]
    """(num_ranks, num_microbatches, num_chunks) -> compute-only schedule."""
    default_chunks: int
    """Stages per rank when the caller gives none."""
    chunks: tuple[int, ...] | None
    """Allowed stages per rank; None: any >= 1."""
    summary: str


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec(name="gpipe", build=gpipe, default_chunks=1, chunks=(1,),
                     summary="all forwards, then all backwards; m microbatches in flight"),
        ScheduleSpec(name="1f1b", build=one_f_one_b, default_chunks=1, chunks=(1,),
                     summary="PipeDream-Flush; bubble (p-1)/m, min(p-r, m) in flight"),
        ScheduleSpec(name="interleaved", build=interleaved, default_chunks=2, chunks=None,
                     summary="Megatron interleaved 1F1B, v stages per rank; bubble (p-1)/(v m)"),
        ScheduleSpec(name="zb-h1", build=zb_h1, default_chunks=1, chunks=(1,),
                     summary="zero bubble H1: B split into I and W; 1/3 of 1F1B's bubble"),
        ScheduleSpec(name="zb-v", build=zb_v, default_chunks=2, chunks=(2,),
                     summary="zero bubble V: 2 stages per rank in a V; only the fill bubble"),
    )
}


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def get_spec(name: "str | ScheduleKind") -> ScheduleSpec:
    return SCHEDULES[ScheduleKind.parse(name).value]


def generate(
    name: "str | ScheduleKind", num_ranks: int, num_microbatches: int, num_chunks: int | None = None
) -> Schedule:
    """The compute-only schedule ``name`` for p=num_ranks, m=num_microbatches
    and v=num_chunks stages per rank (None: the schedule's default, 2 for
    'interleaved' and 'zb-v', else 1). Add communication with ``lower``.

    >>> [str(a) for a in generate("1f1b", 2, 3).actions[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    spec = get_spec(name)
    chunks = spec.default_chunks if num_chunks is None else num_chunks
    # Every generator's time and memory grow with p·v·m (``MAX_PAIRS`` builds in seconds); beyond
    # it a caller (the layout search pricing p=1000) would wait minutes for one candidate.
    check_size(num_ranks, num_microbatches, chunks)
    return spec.build(num_ranks, num_microbatches, chunks)


MAX_PAIRS = 100_000


MAX_PAIRS_IMAGE = 20_000


def check_size(pp: int, microbatches: int, chunks: int | None, *, image: bool = False) -> None:
    """Refuse a schedule too large to generate and draw here, naming the limit."""
    limit = MAX_PAIRS_IMAGE if image else MAX_PAIRS
    v = chunks or 1
    if pp * v * microbatches > limit:
        what = "an image" if image else "a schedule"
        raise ValueError(f"--pp {pp} × --microbatches {microbatches} × {v} chunk(s) = {pp * v * microbatches} "
                         f"stage-microbatch pairs; fxpipe draws {what} of at most {limit}: use fewer")
