"""Input checks and small helpers shared by the generators."""
from __future__ import annotations

from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.schedule import Schedule

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


def check_sizes(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int,
    *,
    chunks: tuple[int, ...] | None,
) -> None:
    """Raise ValueError, with the numbers and a fix, for sizes a generator
    cannot build. ``chunks`` lists the allowed chunk counts (None: any >= 1)."""
    for label, value, flag in (
        ("num_ranks (pp size)", num_ranks, "--pp"),
        ("num_microbatches", num_microbatches, "--microbatches"),
        ("num_chunks (stages per rank)", num_chunks, "--chunks"),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}: {label} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: {label} must be >= 1, got {value}; pass {flag} 1 or more")
    if chunks is not None and num_chunks not in chunks:
        if chunks == (1,):
            hint = "use 'interleaved' for several stages per rank, or pass num_chunks=1"
        else:
            hint = f"pass num_chunks={chunks[0]}"
        raise ValueError(
            f"{name}: got num_chunks={num_chunks}, but this schedule supports "
            f"num_chunks in {list(chunks)}; {hint}"
        )


def schedule(name: str, num_microbatches: int, stage_ranks, per_rank) -> Schedule:
    return Schedule(
        name=name,
        num_microbatches=num_microbatches,
        stage_ranks=tuple(stage_ranks),
        actions=tuple(tuple(rank) for rank in per_rank),
    )


def act(stage: int, kind: ActionKind, microbatch: int) -> Action:
    return Action(stage, kind, microbatch)
