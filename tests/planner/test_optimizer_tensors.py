"""The optimizer step's cost per parameter tensor (``Hardware.optimizer_tensor_s``): torch's
AdamW on a CPU steps tensor by tensor, so a rank's step costs a fixed time per tensor it
holds beside its bytes (``step_price.optimizer_step_s``), counted per pipeline rank from
the tensors its stages read (``layout_price._rank_tensors``)."""
import dataclasses

import pytest

from fxpipe.base.hardware import get_hardware
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner import layout_price
from fxpipe.planner.step_price import ADAM_FP32_BYTES, optimizer_step_s


def test_the_step_is_its_bytes_plus_a_fixed_cost_per_tensor():
    hw = dataclasses.replace(get_hardware("cpu"), optimizer_tensor_s=1e-4)
    bytes_only = optimizer_step_s(hw, 1e6, dp=1, zero=False, traffic_bytes=ADAM_FP32_BYTES)
    assert bytes_only == pytest.approx(hw.memory_s(1e6 * ADAM_FP32_BYTES, 4), rel=1e-12)
    assert optimizer_step_s(hw, 1e6, dp=1, zero=False, traffic_bytes=ADAM_FP32_BYTES, tensors=50) == \
        pytest.approx(bytes_only + 50 * 1e-4, rel=1e-12)
    # ZeRO-1: each replica steps 1/dp of the parameters and of the tensors.
    assert optimizer_step_s(hw, 1e6, dp=4, zero=True, traffic_bytes=ADAM_FP32_BYTES, tensors=40) == \
        pytest.approx(hw.memory_s(1e6 / 4 * ADAM_FP32_BYTES, 4) + 10 * 1e-4, rel=1e-12)


@pytest.mark.parametrize("pp", [1, 2])
def test_each_rank_counts_the_tensors_its_stages_read(pp):
    w = build_workload("gpt-tiny", batch=4, seq=16, layers=2)
    config = ParallelConfig(pp=pp, microbatches=2, costs="model").with_world(pp)
    program = capture_for(w.model, tuple(t[:2] for t in w.example_inputs), config, w.loss_fn)
    compiled = compile_program(program, config)
    counts = layout_price._rank_tensors(compiled)
    # The search prices layouts compiled only to the partition (no stage plan): the same.
    partial = compile_program(program, config, until="coalesce_blocks")
    assert partial.plan is None and layout_price._rank_tensors(partial) == counts
    trainable = {p.canonical for p in compiled.program.params if p.requires_grad}
    assert all(e == 0 for _, e in counts)  # no experts
    # Every trainable tensor is stepped on some rank; a tied one (gpt-tiny's embedding and
    # head) on each rank that holds a copy, so the ranks' counts add up to at least all.
    assert sum(d for d, _ in counts) >= len(trainable)
    # Against the stage plan: each rank steps what its stages hold, and a table whose rows
    # are split over the pipeline ranks (passes/vocab_rows.py) is counted on every rank
    # that reads it, whether or not it holds rows.
    plan = compiled.plan
    held = [{n for n in plan.rank_params(r, [s for s, q in enumerate(compiled.schedule.stage_ranks) if q == r])
             if n in trainable} for r in range(pp)]
    for (d, _), names in zip(counts, held):
        assert len(names) <= d <= len(names | set(plan.row_shards))
    if pp == 1:
        assert counts == [(len(trainable), 0)]
    # The price's optimizer step carries them.
    hw = dataclasses.replace(get_hardware("cpu"), optimizer_tensor_s=1e-3)
    _, with_tensors = layout_price.gradient_sync_s(compiled, hw)
    _, without = layout_price.gradient_sync_s(compiled, dataclasses.replace(hw, optimizer_tensor_s=0.0))
    assert [a - b for a, b in zip(with_tensors, without)] == pytest.approx([1e-3 * d for d, _ in counts], rel=1e-9)


def test_the_steps_own_collectives_are_priced_once_per_step():
    """The runtime ends every step with one gather over the world of the batch digests and
    each rank's loss sum (runtime/api.py); a world of one runs none."""
    from fxpipe.base.hardware import Collective
    from fxpipe.planner.step_price import step_collectives_s
    hw = get_hardware("cpu")
    assert step_collectives_s(hw, world=1, pp=1, dp=1, per_node=1) == 0.0
    got = step_collectives_s(hw, world=4, pp=2, dp=2, per_node=4)
    assert got == pytest.approx(hw.collective_s(Collective.ALL_GATHER, 256, 4, 4), rel=1e-12)
    # Latency-bound: at least one latency per ring step of the gather.
    assert got >= 3 * hw.intra_node.collective_latency
