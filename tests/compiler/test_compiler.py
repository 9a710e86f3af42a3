"""The one compile pipeline (fxpipe/compiler/pipeline.py) and its config (fxpipe/ir/parallel_config.py)."""
from __future__ import annotations

import pytest

import fxpipe
from fxpipe.compiler.pipeline import CompileHooks, compile_pipeline, pipeline_names
from fxpipe.ir.parallel_config import ParallelConfig, ScheduleKind
from fxpipe.models import build_workload
from fxpipe.partition import Method
from fxpipe.passes import canonicalize_pass, cost_pass, total_cost
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.runtime.mixed_precision import Precision
from fxpipe.schedules.registry import SCHEDULES, schedule_names


def test_config_parses_names_into_enums_and_resolves_defaults():
    c = ParallelConfig(tp=2, pp=2, microbatches=4, schedule="Interleaved", partition="dp",
                       precision="bf16", recompute="full", costs="model")
    assert (c.schedule, c.partition, c.precision, c.recompute) == \
        (ScheduleKind.INTERLEAVED, Method.DP, Precision.BF16, RecomputeMode.FULL)
    assert c.chunks == SCHEDULES["interleaved"].default_chunks and c.num_stages == 2 * c.chunks
    # Scatter-gather is decided here once: on with tp > 1 unless sp, off without TP.
    assert c.scatter_gather is True
    assert ParallelConfig(tp=2, sp=True, costs="model").scatter_gather is False
    assert ParallelConfig(tp=1, scatter_gather=True, costs="model").scatter_gather is False
    assert ParallelConfig(tp=2, scatter_gather=False, costs="model").scatter_gather is False
    assert c.tensor_parallel.scatter_gather == c.scatter_gather


def test_schedule_kinds_are_the_registry():
    assert sorted(k.value for k in ScheduleKind) == sorted(schedule_names())


@pytest.mark.parametrize("kwargs, words", [
    (dict(schedule="pipedream"), ["unknown schedule 'pipedream'", "zb-v"]),
    (dict(partition="greedy"), ["unknown partition method 'greedy'", "ilp"]),
    (dict(schedule="zb-v", chunks=1), ["zb-v", "chunks", "got 1"]),
    (dict(microbatches=0), ["microbatches must be >= 1, got 0"]),
    (dict(sp=True), ["sp=True needs tp > 1"]),
    (dict(zero=2), ["zero must be 0", "got 2"]),
    (dict(costs="mesure"), ["costs must be 'measure', 'model'"]),
    (dict(timeout_s=0.0), ["timeout", "got 0.0"]),
])
def test_config_refuses_with_the_choices(kwargs, words):
    with pytest.raises(ValueError) as exc:
        ParallelConfig(**kwargs)
    for w in words:
        assert w in str(exc.value), str(exc.value)


def test_with_world_resolves_dp():
    c = ParallelConfig(tp=2, pp=2, costs="model")
    assert c.with_world(8).dp == 2
    with pytest.raises(ValueError, match="not divisible by tp·pp"):
        c.with_world(6)


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=2, seq=32)


def test_pipeline_runs_every_pass_through_the_driver(tiny):
    config = ParallelConfig(tp=2, pp=2, microbatches=4, costs="model", recompute="selective")
    solved = []

    def decide(fn):  # rank 0's answer for every rank: here, the partition's (two stages)
        assignment, result = fn()
        solved.append(result.num_stages)
        return assignment, result

    result = compile_pipeline(tiny.model, tiny.example_inputs, config, loss_fn=tiny.loss_fn,
                              hooks=CompileHooks(decide=decide), debug=True)
    assert [t.name for t in result.timings] == pipeline_names()
    assert solved == [2]
    plan = result.plan
    assert plan.num_stages == 2 and plan.program is result.program
    assert set(plan.program.stages.values()) == {0, 1}
    assert result.program.tensor_parallel is not None and result.program.partition is not None
    # Model FLOPs are the whole model's, counted before TP halves every matmul.
    whole = total_cost(cost_pass(canonicalize_pass(fxpipe.capture(tiny.model, tiny.example_inputs,
                                                                  tiny.loss_fn))))
    assert result.program.model_stats.flops_per_step == (whole.fwd_flops + whole.bwd_flops) * 4
    per_rank = sum(c.fwd_flops + c.bwd_flops for c in result.program.costs.values())
    assert per_rank < result.program.model_stats.flops_per_step / 4


def test_pipeline_stops_where_asked_and_skips_by_name(tiny):
    from tests.runtime._reuse_capture import captures_reused

    config = ParallelConfig(pp=2, microbatches=2, costs="model")
    with captures_reused():  # three compiles of one model: the later two copy the first's capture
        early = compile_pipeline(tiny.model, tiny.example_inputs, config, loss_fn=tiny.loss_fn, until="cost")
        assert early.plan is None and early.program.costs and early.program.partition is None
        assert [t.name for t in early.timings] == pipeline_names()[:pipeline_names().index("cost") + 1]
        with pytest.raises(ValueError, match="unknown pass 'nope'"):
            compile_pipeline(tiny.model, tiny.example_inputs, config, loss_fn=tiny.loss_fn, until="nope")
        with pytest.raises(ValueError, match="the partition pass needs costs"):
            compile_pipeline(tiny.model, tiny.example_inputs, config, loss_fn=tiny.loss_fn, skip=["cost"])
