"""The runtime's schedule under vocabulary passes, placed on the compiled stages' costs
(fxpipe/compiler/vocab_placement.py, ``compile_program``). In process, on the tied wide-vocabulary
model at pp=2 with the cost model's times: the compiled schedule validates, is the one
``place_vocab_passes`` finds on the stage and head times (never slower than the unit
placement, here strictly faster), keeps the partition's F/B order, is the same on every
compile, follows what the ``agree`` hook returns (rank 0's value), and falls back to
unit times where the partition balanced no times. The losses and gradients under the
passes are the equivalence worlds' (tests/runtime/test_equivalence.py)."""
import dataclasses

import pytest

from fxpipe.base.hardware import get_hardware
from fxpipe.compiler.pipeline import CompileHooks, capture_for, compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.schedules import StageDurations, add_vocab_passes, generate, lower, simulate, validate
from fxpipe.schedules.vocab_actions import place_vocab_passes
from fxpipe.compiler.vocab_placement import describe, placed_schedule
from tests.runtime import _wide_vocab

M = 4
LAYOUT = dict(pp=2, microbatches=M, schedule="interleaved", chunks=2, costs="model", vocab_passes=True)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    model, batch, loss_fn = _wide_vocab.workload_tied()
    # The CPU preset without its per-kernel overhead: on this small model the overhead of
    # the stages' many small kernels outweighs the head's FLOPs, and the placement has
    # nothing to win over the unit one; by FLOPs and bytes alone the head dominates.
    path = str(tmp_path_factory.mktemp("hw") / "cpu-flops.json")
    dataclasses.replace(get_hardware("cpu"), op_overhead_s=0.0).save(path)
    config = ParallelConfig(**LAYOUT, hardware=path).with_world(2)
    program = capture_for(model, tuple(t[:len(t) // M] for t in batch), config, loss_fn)
    return program, config


@pytest.fixture(scope="module")
def compiled(captured):
    program, config = captured
    return compile_program(program, config)


def _span(schedule, timing):
    return simulate(schedule, timing.durations, p2p_latency=timing.p2p_latency,
                    collective_latency=timing.collective_latency).makespan


def test_schedule_is_placed_on_the_stage_and_head_times(compiled):
    timing, config = compiled.vocab_timing, compiled.config
    assert timing is not None
    d = timing.durations
    result = compiled.program.partition
    assert d.forward == tuple(c.fwd_s for c in result.stages) and d.backward == tuple(c.bwd_s for c in result.stages)
    # Nothing lost or counted twice: the stages (the head off them) and the head's S/T
    # on every rank add up to the whole graph's modelled times.
    whole = build_problem_graph(compiled.program, compiled.program.partition_config)
    for key, stages, vocab in (("fwd", d.forward, d.vocab_forward), ("bwd", d.backward, d.vocab_backward)):
        total = sum(x for _, x in whole.nodes(data=key))
        assert sum(stages) + sum(vocab) == pytest.approx(total, rel=1e-9)
        assert len(set(vocab)) == 1 and sum(vocab) > 0.2 * total  # split evenly; a wide head
    validate(compiled.actions)
    assert compiled.actions.compute_only() == compiled.schedule == lower(compiled.schedule).compute_only()
    base = generate(config.schedule, config.pp, M, config.chunks)
    searched = place_vocab_passes(base, d, p2p_latency=timing.p2p_latency,
                                  collective_latency=timing.collective_latency, offsets=(0,))
    assert compiled.schedule.actions == searched.actions
    unit = add_vocab_passes(base)
    assert unit.actions == config.schedule_ir().actions
    assert _span(compiled.schedule, timing) < _span(unit, timing) * (1 - 1e-3)
    # Offset 0: every rank's F/B order is the unit schedule's, whose in-flight counts the
    # partition sized the activation memory for.
    strip = lambda s: [[a for a in acts if not a.kind.is_vocab] for acts in s.actions]  # noqa: E731
    assert strip(compiled.schedule) == strip(unit) == [list(acts) for acts in base.actions]
    line = describe(config, timing, compiled.schedule)  # what fxpipe compile prints
    assert f"{1e3 * _span(compiled.schedule, timing):.3f} ms, {1e3 * _span(unit, timing):.3f} ms" in line


def test_placement_is_deterministic(captured, compiled):
    program, config = captured
    again = compile_program(program, config)
    assert again.vocab_timing == compiled.vocab_timing
    assert again.actions.actions == compiled.actions.actions


def test_every_rank_places_on_what_agree_returns(captured, compiled):
    """The runtime's ``decide`` broadcasts rank 0's timing: the schedule is placed on
    the agreed value, not on this process's own."""
    program, config = captured
    mine = compiled.vocab_timing
    d = mine.durations
    theirs = dataclasses.replace(mine, durations=StageDurations(
        forward=d.forward[::-1], backward=d.backward[::-1], weight=d.weight[::-1],
        vocab_forward=tuple(3 * x for x in d.vocab_forward), vocab_backward=tuple(x / 3 for x in d.vocab_backward)))
    seen = []

    def decide(fn):  # rank 0's timing instead of this process's (the partition's answer stays)
        value = fn()
        if isinstance(value, tuple):
            return value
        seen.append(value)
        return theirs

    agreed = compile_program(program, config, hooks=CompileHooks(decide=decide))
    assert seen == [mine] and agreed.vocab_timing is theirs
    assert agreed.schedule.actions == placed_schedule(config, theirs).actions
    assert agreed.schedule.actions != compiled.schedule.actions
    validate(agreed.actions)


def test_uniform_partition_keeps_unit_times(captured):
    program, config = captured
    config = dataclasses.replace(config, partition="uniform", schedule="1f1b", chunks=None)  # a layer per stage
    uniform = compile_program(program, config)
    assert uniform.vocab_timing is None
    assert uniform.schedule.actions == config.schedule_ir().actions
    assert "unit times" in describe(config, None, uniform.schedule)
    validate(uniform.actions)
