"""The memory model against the closed forms of Korthikanti et al. 2022)."""
import pytest

from fxpipe.passes.recompute import RecomputeMode
from fxpipe.planner import CandidateLayout, PlannerOptions, ScheduleKind, TransformerShape, predict
from fxpipe.planner.options import LayerBalance
from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.memory_model import head_activation_bytes, layer_activation_bytes
from fxpipe.planner.pipeline_time import in_flight
from fxpipe.planner.predict import rank_memory
from fxpipe.planner.stages import plan_stages

NONE, SELECTIVE, FULL = RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (1024, 4, 1024, 16), (512, 2, 2304, 24)])
def test_layer_activation_matches_reference_table(s, b, h, a, t):
    sbh = s * b * h
    f = dict(seq=s, micro_batch=b, hidden=h, heads=a, tp=t)
    assert layer_activation_bytes(**f) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert layer_activation_bytes(**f, sequence_parallel=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert layer_activation_bytes(**f, recompute=SELECTIVE) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert layer_activation_bytes(**f, recompute=SELECTIVE, sequence_parallel=True) == pytest.approx(34 * sbh / t, rel=1e-12)
    assert layer_activation_bytes(**f, recompute=FULL) == 2 * sbh
    if t == 1:  # no parallelism: sbh(34 + 5as/h)
        assert layer_activation_bytes(**f) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    # a fused (flash) kernel keeps no s×s tensor: only the 5as/h term goes
    assert layer_activation_bytes(**f, fused_attention=True) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)


def test_rank_zero_of_1f1b_holds_p_microbatches():
    """SC21 / Korthikanti: 1F1B rank 0 holds p microbatches of its l/p layers, plus its
    state at 18 bytes per parameter (no embedding extras: dropout off)."""
    shape = TransformerShape(name="x", layers=16, hidden=1024, heads=16, seq=1024, vocab=51200, dropout=False)
    cfg = CandidateLayout(tp=2, pp=4, dp=1, micro_batch=2, num_microbatches=8, recompute=NONE)
    opts = PlannerOptions(balance=LayerBalance.MEGATRON)
    model = CostModel(shape, opts)
    flight = in_flight(cfg.schedule, 4, 8, 1)
    assert flight == (4, 3, 2, 1)
    r0 = rank_memory(model, cfg, plan_stages(model, cfg), flight)[0]
    per_layer = layer_activation_bytes(seq=1024, micro_batch=2, hidden=1024, heads=16, tp=2, dropout=False)
    # without dropout no masks (2sbh) and only the softmax of the scores (2as²b/t) are kept
    sbh = 1024 * 2 * 1024
    assert per_layer == pytest.approx(sbh * (8 + 24 / 2 + 2 * 16 * 1024 / (1024 * 2)))
    assert r0.activation_bytes == pytest.approx(4 * 4 * per_layer)
    h, t = 1024, 2
    params = 4 * (12 * h * h / t + 7 * h / t + 6 * h) + 51200 * h / t + 1024 * h
    assert r0.params == pytest.approx(params)
    assert r0.state_bytes == pytest.approx(18 * params)
    assert r0.working_bytes == 0
    assert predict(shape, cfg, opts).memory.total >= r0.total


def test_interleaving_holds_more_and_full_recompute_adds_a_working_layer():
    shape = TransformerShape(name="x", layers=16, hidden=1024, heads=16, seq=1024, vocab=51200)
    base = dict(tp=1, pp=4, dp=1, micro_batch=1, num_microbatches=8)
    opts = PlannerOptions()
    one = predict(shape, CandidateLayout(**base, recompute=NONE), opts)
    inter = predict(shape, CandidateLayout(**base, chunks=2, schedule=ScheduleKind.INTERLEAVED, recompute=NONE), opts)
    # Korthikanti §4.2.3: interleaving holds (1 + (p-1)/(p·v)) × 1F1B's activations on rank 0
    assert inter.pipeline.in_flight[0] / 2 == pytest.approx(4 * (1 + 3 / (4 * 2)))
    full = predict(shape, CandidateLayout(**base, recompute=FULL), opts)
    whole = layer_activation_bytes(seq=1024, micro_batch=1, hidden=1024, heads=16)
    assert full.memory.working_bytes == pytest.approx(whole)
    assert full.memory.activation_bytes < one.memory.activation_bytes


def test_head_keeps_fp32_logits():
    shape = TransformerShape(name="x", layers=2, hidden=64, heads=4, seq=32, vocab=1000)
    # 4sbh (norm and projection inputs) + 4·s·b·V_padded/t (fp32 logits)
    assert head_activation_bytes(shape, 2, 2, False) == 4 * 32 * 2 * 64 + 4 * 32 * 2 * 1024 / 2
