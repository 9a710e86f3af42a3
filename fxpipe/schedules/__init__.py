"""Pipeline schedules as data: IR, generators, lowering, validator, simulator, renderers.

Nothing here imports torch.distributed: a schedule is per-rank lists of
actions (``3F0``, ``1SEND_B2``) that the runtime interprets. Typical use::

    from fxpipe import schedules as S
    sched = S.lower(S.generate("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2))
    S.validate(sched)
    result = S.simulate(sched, S.StageDurations.uniform(sched.num_stages, 1.0, 2.0))
    result.bubble_fraction, result.peak_in_flight, sched.stage_to_rank(5)

See docs/schedules.md for conventions and each generator's bubble and memory.
"""
from fxpipe.schedules.actions import Action, ActionKind, loop_stage_ranks, v_stage_ranks
from fxpipe.schedules.lowering import lower
from fxpipe.schedules.registry import SCHEDULES, ScheduleKind, ScheduleSpec, generate, get_spec, schedule_names
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.simulate import SimResult, StageDurations, simulate
from fxpipe.schedules.timeline import Event, Timeline
from fxpipe.schedules.validate import ScheduleError, validate
from fxpipe.schedules.vocab_actions import add_vocab_passes, split_output_layer

__all__ = [
    "Action",
    "ActionKind",
    "Event",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "ScheduleSpec",
    "SimResult",
    "StageDurations",
    "add_vocab_passes",
    "Timeline",
    "generate",
    "get_spec",
    "loop_stage_ranks",
    "lower",
    "schedule_names",
    "simulate",
    "split_output_layer",
    "v_stage_ranks",
    "validate",
]
