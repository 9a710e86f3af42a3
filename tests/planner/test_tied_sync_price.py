"""``fxpipe plan`` prices the tied embedding's gradient as the runtime reduces it
(``runtime/grad_sync.py``): one all-reduce over the first and last pipeline rank × the
dp replicas, exposed, and the table left out of those ranks' data-parallel buckets —
against the step price's parts recomputed here (``dp_sync_s``, ``collective_s``)."""
import pytest

from fxpipe.base.hardware import Collective
from fxpipe.planner import CandidateLayout, PlannerOptions, ScheduleKind, TransformerShape, predict
from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.options import DPOverlap
from fxpipe.planner.stages import plan_stages
from fxpipe.planner.step_price import DEFAULT_BUCKET_MB, dp_sync_s
from fxpipe.base.recompute_mode import RecomputeMode

SHAPE = TransformerShape(name="x", layers=8, hidden=1024, heads=8, seq=512, vocab=50257, dropout=False)


@pytest.mark.parametrize("dp,zero", [(1, 0), (4, 0), (4, 1)])
def test_the_tied_table_is_one_union_all_reduce(dp, zero):
    t, p = 2, 4
    cfg = CandidateLayout(tp=t, pp=p, dp=dp, micro_batch=1, num_microbatches=8, chunks=1,
                          schedule=ScheduleKind.ONE_F_ONE_B, recompute=RecomputeMode.NONE, zero=zero)
    opts = PlannerOptions(dp_overlap=DPOverlap.BACKWARD)
    model = CostModel(SHAPE, opts)
    hw = opts.hardware
    stages = plan_stages(model, cfg)
    params = stages.ranks(stages.params)
    vocab = SHAPE.padded_vocab(t) * SHAPE.hidden / t
    pred = predict(SHAPE, cfg, opts, model)
    expected = []
    for r in range(p):
        held = vocab if r in (0, p - 1) else 0.0
        sync = dp_sync_s(hw, grad_bytes=(params[r] - held) * opts.grad_bytes,
                         weight_bytes=params[r] * opts.dtype_bytes, dp=dp, per_node=hw.members_per_node(dp, t),
                         zero=bool(zero), backward_s=float(stages.backward[r]), bucket_mb=DEFAULT_BUCKET_MB,
                         gather_hidden_s=float(stages.forward[r]))
        if held:
            # t·dp·(p-1) apart: the pair on two nodes for t=2, dp=4, p=4 on 8-GPU nodes
            per_node = hw.members_per_node(dp, t) * hw.members_per_node(2, t * dp * (p - 1))
            union = hw.collective_s(Collective.ALL_REDUCE, held * opts.grad_bytes, 2 * dp, per_node)
            assert union > 0
            sync += union
        expected.append(sync)
    from fxpipe.planner.predict import Component, _sync_s
    assert [_sync_s(model, cfg, stages, r, float(params[r])) for r in range(p)] == pytest.approx(expected, rel=1e-12)
    assert pred.breakdown.get(Component.DP_SYNC, 0.0) == pytest.approx(expected[pred.critical_rank], rel=1e-12)
