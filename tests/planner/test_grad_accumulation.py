"""Gradient accumulation as its own pass (``GradAccumulation.SEPARATE``, 2021 Megatron's
``main_grad.add_(grad)``): every microbatch, every parameter a rank holds is read as a
fresh gradient and added to the accumulator. Checked against the closed form written
out here: bytes = dtype + 2·grad_bytes per parameter, at the preset's memory bandwidth."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.base.hardware import A100
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner import predict
from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.options import (CandidateLayout, GradAccumulation, LayerBalance, PlannerOptions,
                                    ScheduleKind)
from fxpipe.planner.sc21 import SC21_OPTIMIZER_BYTES, TABLE1
from fxpipe.planner.shapes import TransformerShape
from fxpipe.planner.stages import plan_stages
from fxpipe.planner.work import Component

SHAPE = TransformerShape(name="small", layers=8, hidden=1024, heads=16, seq=1024, vocab=32000, dropout=True)


def _options(accumulation: GradAccumulation, grad_bytes: int = 2) -> PlannerOptions:
    return PlannerOptions(balance=LayerBalance.MEGATRON, grad_accumulation=accumulation, grad_bytes=grad_bytes,
                          bytes_per_param=14.0 + grad_bytes)


@pytest.mark.parametrize("grad_bytes", [2, 4])
def test_each_stage_backward_pays_one_pass_over_its_parameters(grad_bytes):
    cfg = CandidateLayout(tp=2, pp=2, dp=1, micro_batch=2, num_microbatches=4, recompute=RecomputeMode.FULL)
    fused = plan_stages(CostModel(SHAPE, _options(GradAccumulation.FUSED, grad_bytes)), cfg)
    separate = plan_stages(CostModel(SHAPE, _options(GradAccumulation.SEPARATE, grad_bytes)), cfg)
    per_param_s = (2 + 2 * grad_bytes) / (A100.peak_memory_bw * A100.memory_efficiency)
    # parameters per GPU, written out (t = 2, h = 1024, s = 1024, V = 32000, a multiple of 128·t already):
    # 4 layers of 12h²/t + 7h/t (split) + 6h (replicated) each; the first stage adds the
    # learned positions (s·h) and its half of the word table, the last the final norm (2h)
    # and its copy of the tied table
    h, t = 1024, 2
    layer = 12 * h * h / t + 7 * h / t + 6 * h
    table = 32000 * h / t
    params = [4 * layer + 1024 * h + table, 4 * layer + 2 * h + table]
    assert list(separate.params) == pytest.approx(params, rel=1e-12)
    expected = separate.params * per_param_s
    assert separate.backward - fused.backward == pytest.approx(expected, rel=1e-12)
    assert separate.weight - fused.weight == pytest.approx(expected, rel=1e-12)
    assert (separate.forward == fused.forward).all()
    # a 1e8-parameter stage at 1.73 TB/s: 6 bytes take 0.35 ms, 10 bytes 0.58 ms
    assert 1e8 * per_param_s == pytest.approx(1e8 * (2 + 2 * grad_bytes) / 1.73315e12, rel=1e-4)


def test_without_a_pipeline_the_step_grows_by_m_passes():
    """p = 1, d = 1: the step is m·(F + B) + optimizer, so SEPARATE adds exactly m passes
    over every parameter, and the breakdown (element-wise) carries them."""
    m = 5
    cfg = CandidateLayout(tp=1, pp=1, dp=1, micro_batch=1, num_microbatches=m, schedule=ScheduleKind.ONE_F_ONE_B)
    fused = predict(SHAPE, cfg, _options(GradAccumulation.FUSED))
    separate = predict(SHAPE, cfg, _options(GradAccumulation.SEPARATE))
    params = separate.memory.params
    passes = m * params * 6 / (A100.peak_memory_bw * A100.memory_efficiency)
    assert separate.iteration_s - fused.iteration_s == pytest.approx(passes, rel=1e-9)
    ew = separate.breakdown[Component.ELEMENTWISE] - fused.breakdown[Component.ELEMENTWISE]
    assert ew == pytest.approx(passes, rel=1e-9)
    assert sum(separate.breakdown.values()) == pytest.approx(separate.iteration_s, rel=1e-12)


def test_fused_is_the_default_and_costs_nothing():
    assert PlannerOptions().grad_accumulation is GradAccumulation.FUSED
    assert PlannerOptions().accumulation_bytes_per_param == 0.0
    assert replace(PlannerOptions(), grad_accumulation=GradAccumulation.SEPARATE).accumulation_bytes_per_param == 10.0


def test_sc21_rows_run_2021_megatron():
    """The SC21 rows select the 2021 settings; the 1T row's passes are 512 over each
    rank's ~2e9 fp16 gradients (the gap to Korthikanti et al.'s d = 1 run of the same pipeline)."""
    assert SC21_OPTIMIZER_BYTES == 52
    row = next(r for r in TABLE1 if r.label == "1T")
    opts = row.options()
    assert opts.grad_accumulation is GradAccumulation.SEPARATE and opts.accumulation_bytes_per_param == 6.0
    with_passes = predict(row.shape(), row.config(), opts)
    without = predict(row.shape(), row.config(), replace(opts, grad_accumulation=GradAccumulation.FUSED))
    ranks = with_passes.stages.ranks(with_passes.stages.params)
    # two layers of 12h²/8 + 7h/8 + 6h; the first rank adds the word table and positions
    assert float(ranks[1]) == pytest.approx(2 * (12 * 25600**2 / 8 + 7 * 25600 / 8 + 6 * 25600), rel=1e-12)
    params = float(ranks.max())
    assert params == pytest.approx(float(ranks[1]) + 51200 * 25600 / 8 + 2048 * 25600, rel=1e-12)
    per_rank = 512 * params * 6 / (A100.peak_memory_bw * A100.memory_efficiency)
    # every backward is longer, so the bubble grows with it: at least the rank's own passes
    gap = with_passes.iteration_s - without.iteration_s
    assert per_rank <= gap <= per_rank * (1 + 2 * with_passes.bubble_ratio)


def test_plan_flag_selects_it():
    import argparse

    from fxpipe.cli.plan import add_plan_arguments, options_from_args
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    base = ["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512"]
    assert options_from_args(p.parse_args(base)).grad_accumulation is GradAccumulation.FUSED
    opts = options_from_args(p.parse_args(base + ["--grad-accumulation", "separate"]))
    assert opts.grad_accumulation is GradAccumulation.SEPARATE
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--grad-accumulation", "sometimes"])
